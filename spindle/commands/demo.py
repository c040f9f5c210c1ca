"""The end-to-end demo on a built-in tiny model (what `make demo` runs).

1. builds a tiny random checkpoint of the family (`spindle tiny-model`),
2. writes the family's demo dataset (Wan: coloured shapes moving, real mp4 files; Flux: coloured
   shapes, png stills, each with captions; Qwen3/Llama: a small built-in text corpus),
3. fine-tunes until the loss clearly falls (`spindle train`),
4. exports the standard folder (diffusers pipeline / transformers model; loads with no Spindle code),
5. samples from the export (an image or video; a text continuation), and prints where everything is.
What differs per family (data, config, sampling) is the family's demo spec (`DemoSpec`,
`TextDemoSpec` in spindle/contracts/family.py; sampling below, by model kind). Runs in a few minutes on 2 CPU cores.

`--objective grpo` (causal-LM families): online RL instead of the fine-tune. The demo writes prompts and a
verifiable reward function (`rewards.py`: the share of the completion's characters that are "a") into its data
folder, trains the tiny model with `train.objective: grpo` from that reward, and prints the mean reward per step:
the random model starts near 0 and climbs in under a minute on a CPU.

`--objective flow_grpo` (DiT families): online Flow-GRPO instead of the fine-tune. The demo writes prompts and a
reward function (`rewards.py`: the mean brightness of each sample) into its data folder (and a conditioning image,
for a family whose requests take one), trains the tiny model with `train.objective: flow_grpo` from that reward —
each step Spindle's engine generates 4 samples of every prompt on the live weights — and prints the mean reward and
the rollout/update log-prob mismatch per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

HELP = "run the end-to-end demo: tiny model -> data -> fine-tune -> export -> sample"
SFT_STEPS, GRPO_STEPS, FLOW_GRPO_STEPS = 150, 20, 24


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spindle.registry import family_names

    p.add_argument("--out", default="demo_out", help="folder for everything the demo writes (default demo_out)")
    p.add_argument("--family", default="wan", choices=family_names(), help="model family to demo (default wan)")
    p.add_argument(
        "--objective",
        choices=("default", "grpo", "flow_grpo"),
        default="default",
        help="what the demo trains: default, the family's own (a fine-tune); grpo, online RL of a causal-LM "
        "family from a verifiable reward written into the demo folder; flow_grpo, online Flow-GRPO of a DiT family "
        "from a brightness reward written into the demo folder",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps (default {SFT_STEPS}; grpo: {GRPO_STEPS}; flow_grpo: {FLOW_GRPO_STEPS})",
    )
    p.add_argument("--seed", type=int, default=0)


def _loss_summary(output_dir: Path, window: int = 10) -> tuple[float, float]:
    from spindle.train.metrics import read_metrics

    losses = [m["loss"] for m in read_metrics(output_dir)]
    return statistics.mean(losses[:window]), statistics.mean(losses[-window:])


def fresh_run_folder(run: Path) -> Path:
    """The demo's run folder, emptied of an earlier demo's run: a demo always trains from the start (it rebuilds
    its model and data too), while a training job never starts over in a folder holding a run. Anything there
    that is not a Spindle run is left alone and refused."""
    import shutil

    from spindle.train.run_record import read_run_record

    if run.exists() and any(run.iterdir()):
        if read_run_record(run) is None:
            raise ValueError(f"{run} exists and is not an earlier demo's run; give another --out")
        print(f"replacing the earlier demo run in {run}")
        shutil.rmtree(run)
    return run


def run(args: argparse.Namespace) -> int:
    from spindle.api import load_job_config, train
    from spindle.contracts.family import DemoSpec, import_object
    from spindle.registry import get_family

    family = get_family(args.family)
    demo = family.demo
    if demo is None:
        raise ValueError(f"family {args.family!r} has no demo (its FAMILY declares no demo spec)")
    if args.objective == "grpo" and family.kind != "causal_lm":
        raise ValueError(
            f"spindle demo --objective grpo trains a text causal-LM family (qwen3, llama); {args.family} is a "
            f"{family.kind} family: drop --objective"
        )
    if args.objective == "flow_grpo" and family.kind != "dit":
        raise ValueError(
            f"spindle demo --objective flow_grpo trains a DiT family (wan, flux, ...); {args.family} is a "
            f"{family.kind} family: use --objective grpo for a text causal LM, or drop --objective"
        )
    build_tiny = import_object(family.required_code("tiny_model"))
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.objective == "grpo":
        return run_grpo(args, build_tiny, out, t0)
    if args.objective == "flow_grpo":
        return run_flow_grpo(args, family, build_tiny, out, t0)
    args.steps = SFT_STEPS if args.steps is None else args.steps
    print(f"[1/5] building a tiny {args.family} checkpoint in {out / 'model'}")
    model = build_tiny(out / "model", seed=args.seed)
    print(f"[2/5] writing the demo dataset to {out / 'data'}")
    data = demo.write_data(out / "data", seed=args.seed)
    config_path = out / "train.yaml"
    config = demo.train_config(Path(model), Path(data), fresh_run_folder(out / "run"), args.steps, args.seed)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"[3/5] fine-tuning for {args.steps} steps (config: {config_path})")
    result = train(load_job_config(config_path))
    if result.export_dir is None:
        raise ValueError(f"the demo config must export (checkpoint.export: true); {config_path} does not")
    first, last = _loss_summary(result.output_dir)
    print(f"[4/5] exported to {result.export_dir}")
    print("[5/5] sampling from the export")
    sample = (
        sample_dit(demo, result.export_dir, Path(data), out, args.seed)
        if isinstance(demo, DemoSpec)
        else sample_text(demo, result.export_dir, out)
    )
    print(
        f"\ndone in {time.perf_counter() - t0:.0f}s\n"
        f"  loss (mean of first/last 10 steps): {first:.4f} -> {last:.4f}\n"
        f"  metrics:     {result.output_dir / 'metrics.jsonl'}\n"
        f"  checkpoints: {result.output_dir / 'checkpoints'}\n"
        f"  export:      {result.export_dir}  ({family.export_hint})\n"
        f"  {sample}"
    )
    return 0


def sample_dit(demo: Any, export_dir: Path, data: Path, out: Path, seed: int) -> str:
    """Generate from a DiT export with the first caption of the demo data (and its source image, for an edit
    pair); -> what to print."""
    from spindle.api import load_generator
    from spindle.data.datasets import build_dataset

    first = build_dataset(data, demo.size, demo.num_frames, check=False).samples[0]  # a folder or a manifest
    caption = first.caption
    path = out / f"sample{demo.sample_suffix}"
    gen = load_generator(export_dir)
    conditioning: dict[str, Any] = {}
    if first.sources:  # an edit pair: edit its source image
        conditioning["image"] = first_frame(first.sources[0], demo.size)
    elif gen.options.images[0]:  # an image-conditioned family: the caption's clip's first frame
        conditioning["image"] = first_frame(first.path, demo.size)
    result = gen.generate(
        prompt=caption,
        **conditioning,
        height=demo.size[0],
        width=demo.size[1],
        num_inference_steps=20,
        seed=seed,
        **demo.sample_kwargs,
    )
    result.save(path)
    return (
        f"sample for {caption!r}: {path}\n"
        "  (the tiny checkpoint's VAE and text encoders are random, so the sample shows what the DiT learned\n"
        "   in latent space, not recognisable shapes: the falling loss is the signal)"
    )


def first_frame(path: Path, size: tuple[int, int]) -> Any:
    """The first frame of a clip at the demo size, as the uint8 RGB image a user would pass."""
    from spindle.data.media import read_media, tensor_to_image

    return tensor_to_image(read_media(path, 1, size)[:, 0])


def sample_text(demo: Any, export_dir: Path, out: Path) -> str:
    """Greedy continuation of the demo prompt by stock transformers from a language-model export."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    inputs = tok(demo.prompt, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=demo.max_new_tokens, do_sample=False)
    text = tok.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    (out / "sample.txt").write_text(f"{demo.prompt} {text}\n")
    return f"continuation of {demo.prompt!r} (greedy, stock transformers on the export): {text!r}"


# The demo's verifiable reward, written into its data folder as a user would write one (TRL's signature).
GRPO_REWARD = '''def letter_a(completions, **columns):
    """The share of each completion's characters that are "a": checkable, and learnable by a tiny model."""
    return [c.count("a") / max(len(c), 1) for c in completions]
'''
GRPO_PROMPTS = ("Write:", "Say something", "Go on", "Next:", "Hello", "Tell me", "A story:", "Word:")


def grpo_config(model: Path, data: Path, rewards: Path, output_dir: Path, steps: int, seed: int) -> dict[str, Any]:
    """A short online GRPO run: 4 prompts x 8 completions of 6 tokens a step, no KL, a high learning rate."""
    return {
        "model": {"path": str(model)},
        "data": {"path": str(data), "seq_len": 64},
        "train": {
            "objective": "grpo",
            "output_dir": str(output_dir),
            "max_steps": steps,
            "global_batch_size": 4,
            "micro_batch_size": 4,
            "lr": 1e-2,
            "seed": seed,
            "log_every": 5,
        },
        "grpo": {"num_generations": 8, "max_new_tokens": 6, "rewards": [f"{rewards}:letter_a"], "beta": 0.0},
        "checkpoint": {"every_steps": 50, "resume": "none"},
    }


def run_grpo(args: argparse.Namespace, build_tiny: Any, out: Path, t0: float) -> int:
    """`spindle demo --objective grpo`: tiny model -> prompts + reward file -> online GRPO -> the reward curve."""
    import json

    from spindle.api import load_job_config, train
    from spindle.train.metrics import read_metrics

    steps = GRPO_STEPS if args.steps is None else args.steps
    print(f"[1/4] building a tiny {args.family} checkpoint in {out / 'model'}")
    model = build_tiny(out / "model", seed=args.seed)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts, rewards = data_dir / "prompts.jsonl", data_dir / "rewards.py"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GRPO_PROMPTS))
    rewards.write_text(GRPO_REWARD)
    print(f"[2/4] wrote {len(GRPO_PROMPTS)} prompts to {prompts} and the reward function to {rewards}:letter_a")
    config_path = out / "train.yaml"
    config = grpo_config(Path(model), prompts, rewards, fresh_run_folder(out / "run"), steps, args.seed)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"[3/4] online GRPO for {steps} steps (config: {config_path})")
    result = train(load_job_config(config_path))
    curve = [m["reward_mean"] for m in read_metrics(result.output_dir)]
    print("[4/4] mean reward per step (the share of 'a' in the completions):")
    for step, reward in enumerate(curve, 1):
        print(f"  step {step:3d}  {reward:.3f}  {'#' * round(reward * 50)}")
    window = min(3, len(curve))
    first, last = statistics.mean(curve[:window]), statistics.mean(curve[-window:])
    print(
        f"\ndone in {time.perf_counter() - t0:.0f}s\n"
        f"  mean reward (first/last {window} steps): {first:.3f} -> {last:.3f}\n"
        f"  metrics:     {result.output_dir / 'metrics.jsonl'}\n"
        f"  samples:     {result.output_dir / 'samples' / 'grpo.jsonl'}  (prompts, completions, rewards)\n"
        f"  export:      {result.export_dir}"
    )
    return 0


# The Flow-GRPO demo's reward, written into its data folder as a user would write one.
FLOW_GRPO_REWARD = '''import numpy as np


def brightness(images, prompts, **columns):
    """Mean pixel value in [0, 1] of each image (or video): brighter samples score higher."""
    return [float(np.mean(image)) for image in images]
'''
FLOW_GRPO_PROMPTS = ("a red circle", "a blue square", "a green triangle", "a yellow star")


def flow_grpo_config(
    model: Path, data: Path, rewards: Path, output_dir: Path, steps: int, seed: int, family: Any
) -> dict[str, Any]:
    """A short Flow-GRPO run on the tiny model: every prompt each step, 4 samples of 4 SDE steps each, a high
    learning rate (the tiny random model; a real one trains at ~1e-5 full, ~3e-4 LoRA)."""
    demo = family.demo
    base = demo.train_config(model, data, output_dir, steps, seed)  # the family's model and data settings
    # the family's demo sampling as the rollouts' options (sizes and frames are the data's)
    options = {k: v for k, v in demo.sample_kwargs.items() if k not in ("height", "width", "num_frames")}
    # an input image's pixel area (Qwen-Image-Edit's image_area: 1 megapixel by default) at the demo's size, as
    # the SFT demo encodes its sources: the pipeline's default would encode the small demo images at 1024x1024
    area = demo.size[0] * demo.size[1]
    for option in family.options.extra:
        if option.pixels and option.name not in options:
            options[option.name] = max(area, int(option.minimum or 0))
    guidance = options.pop("guidance_scale", None)
    settings: dict[str, Any] = {"num_generations": 4, "num_inference_steps": 4, "rewards": [f"{rewards}:brightness"]}
    if guidance is not None:
        settings["guidance_scale"] = guidance
    if options:
        settings["options"] = options
    return {
        "model": base["model"],
        "data": base["data"],
        "train": {
            "objective": "flow_grpo",
            "output_dir": str(output_dir),
            "max_steps": steps,
            "global_batch_size": len(FLOW_GRPO_PROMPTS),
            "micro_batch_size": len(FLOW_GRPO_PROMPTS),
            "lr": 3e-3,
            "seed": seed,
            **demo.train,
        },
        "flow_grpo": settings,
        "checkpoint": {"every_steps": 12, "resume": "none"},
    }


def run_flow_grpo(args: argparse.Namespace, family: Any, build_tiny: Any, out: Path, t0: float) -> int:
    """`spindle demo --family FAMILY --objective flow_grpo`: tiny model -> prompts + reward file -> Flow-GRPO with
    rollouts from the engine on the live weights -> the reward curve."""
    import json

    from spindle.api import load_job_config, train
    from spindle.train.metrics import read_metrics

    steps = FLOW_GRPO_STEPS if args.steps is None else args.steps
    print(f"[1/4] building a tiny {args.family} checkpoint in {out / 'model'}")
    model = build_tiny(out / "model", seed=args.seed)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts, rewards = data_dir / "prompts.jsonl", data_dir / "rewards.py"
    least, _ = family.condition_model_cls().request_images(model) or family.options.images
    images = [conditioning_image(data_dir / f"image_{k}.png", family.demo.size, k) for k in range(least)]
    extra = {"image": [p.name for p in images] if len(images) > 1 else images[0].name} if images else {}
    prompts.write_text("".join(json.dumps({"prompt": p, **extra}) + "\n" for p in FLOW_GRPO_PROMPTS))
    rewards.write_text(FLOW_GRPO_REWARD)
    print(f"[2/4] wrote {len(FLOW_GRPO_PROMPTS)} prompts to {prompts} and the reward function to {rewards}:brightness")
    config_path = out / "train.yaml"
    config = flow_grpo_config(Path(model), prompts, rewards, fresh_run_folder(out / "run"), steps, args.seed, family)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"[3/4] Flow-GRPO for {steps} steps, 4 samples per prompt from the engine (config: {config_path})")
    result = train(load_job_config(config_path))
    metrics = read_metrics(result.output_dir)
    curve = [m["reward_mean"] for m in metrics]
    low, high = min(curve), max(curve)
    print("[4/4] mean reward per step (the samples' mean brightness) and the rollout/update log-prob mismatch:")
    for step, (reward, m) in enumerate(zip(curve, metrics, strict=True), 1):
        bar = "#" * (1 + round(40 * (reward - low) / max(high - low, 1e-12)))
        print(f"  step {step:3d}  {reward:.5f}  mismatch {m['logprob_mismatch']:.1e}  {bar}")
    window = min(5, len(curve))
    first, last = statistics.mean(curve[:window]), statistics.mean(curve[-window:])
    print(
        f"\ndone in {time.perf_counter() - t0:.0f}s\n"
        f"  mean reward (first/last {window} steps): {first:.5f} -> {last:.5f}\n"
        f"  metrics:     {result.output_dir / 'metrics.jsonl'}\n"
        f"  samples:     {result.output_dir / 'samples' / 'flow_grpo.jsonl'}  (prompts and rewards)\n"
        f"  export:      {result.export_dir}"
    )
    return 0


def conditioning_image(path: Path, size: tuple[int, int], seed: int) -> Path:
    """A conditioning image for the demo's prompts (image-to-video and edit families): a coloured disc."""
    from PIL import Image, ImageDraw

    height, width = size
    image = Image.new("RGB", (width, height), (40 + 60 * seed, 40, 90))
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=(230, 200, 40))
    image.save(path)
    return path
