"""Flow-GRPO rollouts through Spindle's own inference engine on the live training weights.

A rollout is one engine request (a prompt, `num_generations` outputs) run stage by stage on the pipeline that
`spindle.train.live_engine` builds around the in-training transformer: the family's before-denoising stage
(conditions, the initial noise from each sample's own generator, the schedule), the shared denoising loop with
the SDE recorder in place of the scheduler's step (`Req.step`), and the shared decoding stage. The prepared
request is kept: the update recomputes each recorded transition with the same stage's `predict` on the same
conditions, so the recorded and the recomputed log-probabilities are the same computation on the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spindle.contracts.request import Req, SamplingParams


@dataclass
class Rollout:
    """One prompt's group of samples: the prepared request (conditions, timesteps, scheduler), the recorded
    trajectory, the decoded samples as rewards get them, and the time spent denoising and decoding."""

    req: Req
    trajectory: Any  # the recorder's (`spindle.train.objectives.flow_grpo.Trajectory`)
    images: list[np.ndarray]
    timings: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def rollout(generator: Any, params: SamplingParams, recorder: Any) -> Rollout:
    """Generate `params` (one prompt, `num_outputs_per_prompt` samples) with `generator` (a
    `DiffusionGenerator`), the denoising loop stepping with `recorder` (a `flow_grpo.SdeRecorder`): sample b's
    initial noise and every SDE draw come from the recorder's `generators[b]`."""
    from spindle.train.rewards.images import reward_images

    pipeline = generator.pipeline
    req = generator.make_request(generator.validated(params))
    generators = list(recorder.generators)
    if len(generators) != params.batch_size:
        raise ValueError(f"a rollout of {params.batch_size} samples needs as many generators; got {len(generators)}")
    req.generator = generators
    start = time.perf_counter()
    req = pipeline.before_denoising(req)
    req.step = recorder
    req = pipeline.denoising(req)
    req.step = None
    denoised = time.perf_counter()
    req = pipeline.decoding(req)
    images = reward_images(req.output)
    req.output = None  # the decoded batch is the rewards' (as `images`); the update needs the conditions only
    timings = {"denoise_s": denoised - start, "decode_s": time.perf_counter() - denoised}
    return Rollout(req, recorder.trajectory(), images, timings)
