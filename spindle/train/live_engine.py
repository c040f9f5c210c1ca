"""Spindle's inference engine around the in-training transformer: what validation samples and Flow-GRPO
rollouts generate with, so they run the code `spindle generate` and `spindle serve` run, on the live weights.

The family's inference pipeline (`spindle.infer`) is built around the transformer as training holds it (sharded
by FSDP2, with SP hooks, LoRA adapters) — no copy — and the frozen components the condition model already holds
(text encoders, VAE, scheduler; loaded once here when training reads a precomputed cache). A sharded forward is
collective, so every rank runs the same number of requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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
    cached: dict[str, Any] | None = getattr(task, "_engine_components", None)
    if cached is None:
        if pipe is not None and all(getattr(pipe, n, None) is not None for n in names):
            cached = {n: getattr(pipe, n) for n in names}
        else:
            cached = {n: load_component(root, n, index.get(n), task.device, torch.float32) for n in names}
        cached.update({n: load_component(root, n, index.get(n), task.device, torch.float32) for n in experts})
        task._engine_components = cached
    return {**cached, **{key: index.get(key) for key in spec.pipeline_config}}


def live_generator(task: Any, model: torch.nn.Module, **options: Any) -> Any:
    """A `DiffusionGenerator` whose pipeline denoises with `model` (the in-training transformer); `options`:
    `EngineConfig` fields beside the task's device and memory setting."""
    from spindle.engine_config import EngineConfig
    from spindle.infer.generator import DiffusionGenerator
    from spindle.infer.pipeline import InferencePipeline

    spec = task.family.inference_spec()
    components = {**frozen_components(task, spec), trained_component(task, spec): model}
    engine = EngineConfig(device=str(task.device), keep_freed_memory=task.cfg.train.keep_freed_memory, **options)
    return DiffusionGenerator(InferencePipeline.build(spec, components, engine))
