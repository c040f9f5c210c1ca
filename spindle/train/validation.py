"""Validation samples during DiT training, rendered by Spindle's own inference engine.

The family's inference pipeline (`spindle.infer`) is built around the in-training transformer (as
it is: sharded by FSDP2, with SP hooks, LoRA adapters), and the frozen components the condition
model already holds (text encoders, VAE, scheduler; loaded once here when training reads a
precomputed cache). Every rank runs the same requests (a sharded forward is collective) with the
same fixed seed, so a prompt is comparable across steps; rank 0 writes
`output_dir/samples/step-000N/NN.png|mp4`. The trainer runs this with the RNG state forked and the
model in eval mode under no_grad, so the training trajectory is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spindle.distributed.mesh import is_main_process


def trained_component(task: Any, spec: Any) -> str:
    """The checkpoint component the in-training model is (a two-expert model's trained expert)."""
    return str(getattr(task, "component", spec.transformer_component))


def frozen_components(task: Any, spec: Any) -> dict[str, Any]:
    """The inference components other than the trained transformer: the condition model's, else loaded once;
    a two-expert model's other expert (loaded once) and the model_index.json values the stages read."""
    from spindle.infer.pipeline import load_component
    from spindle.model_index import read_model_index

    root = Path(task.cfg.model.path)
    index = read_model_index(root)
    names = [n for n in spec.components if n != spec.transformer_component]
    trained = trained_component(task, spec)
    experts = [n for n in spec.denoiser_components if n != trained]
    pipe = getattr(getattr(task, "condition", None), "pipe", None)
    cached: dict[str, Any] | None = getattr(task, "_validation_components", None)
    if cached is None:
        if pipe is not None and all(getattr(pipe, n, None) is not None for n in names):
            cached = {n: getattr(pipe, n) for n in names}
        else:
            cached = {n: load_component(root, n, index.get(n), task.device, torch.float32) for n in names}
        cached.update({n: load_component(root, n, index.get(n), task.device, torch.float32) for n in experts})
        task._validation_components = cached
    return {**cached, **{key: index.get(key) for key in spec.pipeline_config}}


@torch.no_grad()
def render_samples(task: Any, model: torch.nn.Module, step: int, out_dir: Path) -> list[np.ndarray]:
    """Render one sample per `train.validation.prompts` entry; -> the frames (rank 0 writes the files)."""
    from spindle.engine_config import EngineConfig
    from spindle.infer.generator import DiffusionGenerator
    from spindle.infer.pipeline import InferencePipeline

    cfg = task.cfg
    val = cfg.train.validation
    spec = task.family.inference_spec()
    components = {**frozen_components(task, spec), trained_component(task, spec): model}
    pipeline = InferencePipeline.build(
        spec, components, EngineConfig(device=str(task.device), keep_freed_memory=task.cfg.train.keep_freed_memory)
    )
    generator = DiffusionGenerator(pipeline)
    height, width = val.size or tuple(cfg.data.resolution)
    request: dict[str, Any] = dict(
        height=height, width=width, num_inference_steps=val.num_inference_steps, seed=val.seed
    )
    if val.guidance_scale is not None:
        request["guidance_scale"] = val.guidance_scale
    if generator.defaults.max_sequence_length is not None:  # the prompts padded as training encodes them
        request["max_sequence_length"] = cfg.model.max_text_length
    if spec.media == "video":
        request["num_frames"] = val.num_frames or cfg.data.num_frames
    suffix = ".mp4" if spec.media == "video" else ".png"
    samples = []
    for index, prompt in enumerate(val.prompts):
        image = {"image": val.images[index]} if val.images else {}  # (checked one per prompt before launch)
        result = generator.generate(prompt=prompt, **image, **request, **val.options)
        if is_main_process():
            result.save(out_dir / f"{index:02d}{suffix}", fps=spec.fps)
        samples.append(result.frames[0])
    if is_main_process():
        (out_dir / "prompts.json").write_text(
            json.dumps({"step": step, "prompts": val.prompts, "images": val.images, **request, **val.options}, indent=2)
        )
    return samples
