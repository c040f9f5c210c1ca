"""Flow-GRPO benchmark: rollout samples/s through Spindle's engine vs the stock diffusers pipeline, and where a
Flow-GRPO training step's time goes.

    python bench/flow_grpo.py                        # CPU: FLUX.1-shaped small checkpoint (bench/generate.py flux-cpu)
    python bench/flow_grpo.py --preset cpu           # CPU: Wan-shaped small video checkpoint (DanceGRPO's setting)
    python bench/flow_grpo.py --preset flux-gpu      # a GPU: FLUX.1-dev block shapes, LoRA r16 (Flow-GRPO's setting)
    python bench/flow_grpo.py --preset wan1.3b       # a GPU: Wan2.1-T2V-1.3B shapes (DanceGRPO)

1. **Rollouts**, side by side in one process on the same random checkpoint (the presets of bench/generate.py),
   the same prompt, `--generations` samples per prompt, `--rollout-steps` denoising steps, size and guidance:
     spindle  `spindle.train.rollouts.rollout`: Spindle's engine (its training configuration: CFG batched, no
              CPU feed-forward fusion) with the Flow-GRPO SDE sampler recording every step's latents and
              log-probabilities, decoded for the rewards
     stock    the checkpoint's diffusers pipeline called with `num_images_per_prompt` (its deterministic
              scheduler step: no log-probabilities; what a user without an RL stack runs to sample)
   The median of `--repeats` timed rollouts after one warm-up each; samples/s and the ratio.
2. **A training step**: `spindle train` with `train.objective: flow_grpo` on the same checkpoint (full fine-tune,
   or LoRA r16 on the GPU presets), a mean-brightness reward, `--prompts` prompts per step: the median step time
   and its split into rollout (denoising) / decode + reward / update (forward + backward + optimizer), and the
   largest `logprob_mismatch` (rollout vs the update's recomputation).

Prints both, writes JSON (--out, default bench/results/flow_grpo.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402
from bench import generate as gen_bench  # noqa: E402

PRESETS = ("flux-cpu", "cpu", "flux-gpu", "wan1.3b")
REWARD = "import numpy as np\n\ndef brightness(images, prompts, **columns):\n    return [float(np.mean(i)) for i in images]\n"


def rollout_request(preset: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The preset's request (bench/generate.py) with the rollout's steps; true CFG dropped (Flow-GRPO's guidance
    is the family's guidance_scale)."""
    req = {k: v for k, v in preset["request"].items() if k not in ("true_cfg_scale",)}
    return {"prompt": "a red circle on a blue background", **req, "num_inference_steps": a.rollout_steps}


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        gen_bench.sync()
        start = time.perf_counter()
        fn()
        gen_bench.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_rollouts(root: Path, preset: dict[str, Any], a: argparse.Namespace, device: str) -> dict[str, Any]:
    from spindle.api import load_generator
    from spindle.contracts.request import SamplingParams
    from spindle.train.objectives.flow_grpo import SdeRecorder, rollout_generators
    from spindle.train.rollouts import rollout
    from spindle.train.tasks.flow_matching import sample_generator

    dtype = preset.get("dtype", "float32")
    req = rollout_request(preset, a)
    g = a.generations
    spindle = load_generator(root, device=device, dtype=dtype, fast_mlp=False)
    fields = {k: v for k, v in req.items() if k in SamplingParams.__dataclass_fields__}
    extra = {k: v for k, v in req.items() if k not in fields}

    def spindle_rollout() -> Any:
        params = SamplingParams(**fields, extra=extra, seed=0, num_outputs_per_prompt=g)
        gens = rollout_generators(sample_generator, 0, 0, [0], g)
        return rollout(spindle, params, SdeRecorder(0.7, gens))

    spindle_s = timed(spindle_rollout, a.repeats)
    torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype))
    vae_dtype = getattr(torch, preset.get("vae_dtype", "float32"))
    pipe = gen_bench.diffusers_pipe(root, torch_dtype, device, vae_dtype)

    def stock_rollout() -> Any:
        gens = [torch.Generator().manual_seed(k) for k in range(g)]
        return pipe(**req, num_images_per_prompt=g, generator=gens, output_type="np")

    stock_s = timed(stock_rollout, a.repeats)
    return dict(
        generations=g,
        rollout_steps=a.rollout_steps,
        request={k: v for k, v in req.items() if k != "prompt"},
        spindle_s=spindle_s,
        stock_s=stock_s,
        spindle_samples_per_s=g / spindle_s,
        stock_samples_per_s=g / stock_s,
        speedup=stock_s / spindle_s,
    )


def bench_step(root: Path, preset: dict[str, Any], a: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    from spindle.api import load_job_config, train
    from spindle.train.metrics import read_metrics

    req = rollout_request(preset, a)
    with tempfile.TemporaryDirectory() as tmp:
        rewards, prompts = Path(tmp) / "rewards.py", Path(tmp) / "prompts.jsonl"
        rewards.write_text(REWARD)
        prompts.write_text("".join(json.dumps({"prompt": f"a shape number {k}"}) + "\n" for k in range(a.prompts)))
        config: dict[str, Any] = {
            "model": {"path": str(root), "max_text_length": req.get("max_sequence_length", 64)},
            "data": {
                "path": str(prompts),
                "resolution": [req["height"], req["width"]],
                "num_frames": req.get("num_frames", 1),
            },
            "train": {
                "objective": "flow_grpo",
                "output_dir": str(Path(tmp) / "run"),
                "max_steps": a.warmup + a.steps,
                "global_batch_size": a.prompts,
                "micro_batch_size": 1,
                "lr": 1e-5,
                "mixed_precision": "bf16" if gpu else "no",
                **({"lora": {"rank": 16}} if gpu else {}),
            },
            "flow_grpo": {
                "num_generations": a.generations,
                "num_inference_steps": a.rollout_steps,
                "guidance_scale": req.get("guidance_scale"),
                "rewards": [f"{rewards}:brightness"],
            },
            "checkpoint": {"export": False, "resume": "none"},
        }
        cfg = Path(tmp) / "job.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump(config))
        train(load_job_config(cfg))
        metrics = read_metrics(Path(tmp) / "run")[a.warmup :]
    med = {
        k: statistics.median(m[k] for m in metrics)
        for k in ("step_time_s", "time/rollout_s", "time/reward_s", "time/update_s")
    }
    return dict(
        prompts_per_step=a.prompts,
        samples_per_step=a.prompts * a.generations,
        lora=gpu,
        step_s=med["step_time_s"],
        rollout_s=med["time/rollout_s"],
        reward_s=med["time/reward_s"],
        update_s=med["time/update_s"],
        max_logprob_mismatch=max(m["logprob_mismatch"] for m in metrics),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default="flux-cpu")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt (flow_grpo.num_generations)")
    p.add_argument("--rollout-steps", type=int, default=6, help="denoising steps of a rollout")
    p.add_argument("--prompts", type=int, default=2, help="prompts per training step")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per engine (after one warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="training steps not timed")
    p.add_argument("--steps", type=int, default=3, help="timed training steps")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "flow_grpo.json"))
    a = p.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    preset = gen_bench.PRESETS[a.preset]
    with tempfile.TemporaryDirectory() as tmp:
        root = gen_bench.build_checkpoint(a.preset, Path(tmp) / "model")
        print(f"rollouts: {a.generations} samples x {a.rollout_steps} steps ...", flush=True)
        rollouts = bench_rollouts(root, preset, a, device)
        print("training steps ...", flush=True)
        step = bench_step(root, preset, a, gpu)
    print(
        f"\nrollout of {a.generations} samples x {a.rollout_steps} steps: Spindle engine + SDE recorder "
        f"{rollouts['spindle_s']:.3f}s ({rollouts['spindle_samples_per_s']:.2f} samples/s), stock diffusers "
        f"{rollouts['stock_s']:.3f}s ({rollouts['stock_samples_per_s']:.2f} samples/s): {rollouts['speedup']:.2f}x"
    )
    print(
        f"Flow-GRPO step ({step['prompts_per_step']} prompts x {a.generations} samples): {step['step_s']:.3f}s = "
        f"rollout {step['rollout_s']:.3f}s + decode/reward {step['reward_s']:.3f}s + update {step['update_s']:.3f}s; "
        f"max logprob_mismatch {step['max_logprob_mismatch']:.1e}"
    )
    report = dict(
        bench="flow_grpo",
        preset=a.preset,
        device=common.describe_device(),
        torch=torch.__version__,
        rollouts=rollouts,
        step=step,
    )
    common.write_report(report, a.out)


if __name__ == "__main__":
    main()
