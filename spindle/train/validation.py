"""Validation samples during DiT training, rendered by Spindle's own inference engine.

The family's inference pipeline is built around the in-training transformer (`spindle.train.live_engine`).
Every rank runs the same requests (a sharded forward is collective) with the same fixed seed, so a prompt is
comparable across steps; rank 0 writes `output_dir/samples/step-000N/NN.png|mp4`. The trainer runs this with the RNG state forked and the
model in eval mode under no_grad, so the training trajectory is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spindle.distributed.mesh import is_main_process


@torch.no_grad()
def render_samples(task: Any, model: torch.nn.Module, step: int, out_dir: Path) -> list[np.ndarray]:
    """Render one sample per `train.validation.prompts` entry; -> the frames (rank 0 writes the files)."""
    from spindle.train.live_engine import live_generator

    cfg = task.cfg
    val = cfg.train.validation
    generator = live_generator(task, model)
    spec = generator.pipeline.spec
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
