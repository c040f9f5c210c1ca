"""A Flow-GRPO rollout through Spindle's own inference engine on the tiny Flux, with the SDE recorder in
place of the scheduler's step (what the engine's denoising loop will call), and the trainer's recomputation
through the same `DenoisingStage.predict`: the `logprob_mismatch` the issue asks for is at float error."""

from __future__ import annotations

import torch

from spindle.train.objectives.flow_grpo import SdeRecorder, logprob_mismatch, rollout_generators

NOISE_LEVEL = 0.7


def test_engine_rollout_log_probs_are_recomputed_exactly(tiny_flux):
    from spindle.api import load_generator
    from spindle.contracts.request import SamplingParams
    from spindle.train.rewards.images import reward_images
    from spindle.train.tasks.flow_matching import sample_generator

    engine = load_generator(tiny_flux, exact=True)
    pipeline = engine.pipeline
    params = SamplingParams(
        prompt="a red circle",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.5,
        seed=0,
        num_outputs_per_prompt=2,
        max_sequence_length=16,
    )

    def rollout() -> tuple:
        req = engine.make_request(engine.validated(params))
        req.generator = rollout_generators(sample_generator, 0, 4, [0], 2)  # per-sample initial noise
        req = pipeline.before_denoising(req)
        recorder = SdeRecorder(NOISE_LEVEL, req.generator)
        latents = req.latents
        with torch.no_grad():
            for i, t in enumerate(req.timesteps):
                latents = recorder(req.scheduler, pipeline.denoising.predict(req, latents, t, i), t, i, latents)
        req.latents = latents
        return req, recorder.trajectory()

    req, traj = rollout()
    assert traj.log_probs.shape == (2, 3) and torch.isfinite(traj.log_probs).all()
    # the trainer: the same denoiser, now with gradients, on the recorded inputs
    transformer = pipeline.transformer
    transformer.requires_grad_(True)
    for j, t in enumerate(req.timesteps):
        velocity = pipeline.denoising.predict(req, traj.latents[:, j], t, j)
        recomputed = traj.transition_log_prob(velocity, j, NOISE_LEVEL).log_prob
        assert logprob_mismatch(traj.log_probs[:, j], recomputed) <= 1e-5
        transformer.zero_grad()
        recomputed.sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in transformer.parameters())

    # the samples are their generators': a second rollout is the same, the two samples differ
    _, again = rollout()
    assert torch.equal(again.latents, traj.latents) and torch.equal(again.log_probs, traj.log_probs)
    assert not torch.allclose(traj.latents[0, -1], traj.latents[1, -1])

    # decoded by the engine's own decoding stage into what rewards receive
    decoded = pipeline.stages[-1](req)
    images = reward_images(decoded.output)
    assert len(images) == 2 and images[0].shape == (32, 32, 3) and 0 <= images[0].min() <= images[0].max() <= 1


def test_denoising_stage_takes_the_requests_step_in_place_of_the_schedulers(tiny_flux):
    """`Req.step` (the engine hook a rollout uses): the stage's own loop runs the SDE recorder, and its
    trajectory is the one a hand-written loop over `predict` records, with the same final latents."""
    from spindle.api import load_generator
    from spindle.contracts.request import SamplingParams
    from spindle.train.tasks.flow_matching import sample_generator

    engine = load_generator(tiny_flux, exact=True)
    pipeline = engine.pipeline
    params = SamplingParams(
        prompt="a red circle",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.5,
        seed=0,
        num_outputs_per_prompt=2,
        max_sequence_length=16,
    )

    def prepared():
        req = engine.make_request(engine.validated(params))
        req.generator = rollout_generators(sample_generator, 0, 4, [0], 2)
        return pipeline.before_denoising(req)

    by_hand = prepared()
    manual = SdeRecorder(NOISE_LEVEL, by_hand.generator)
    latents = by_hand.latents
    with torch.no_grad():
        for i, t in enumerate(by_hand.timesteps):
            latents = manual(by_hand.scheduler, pipeline.denoising.predict(by_hand, latents, t, i), t, i, latents)

    req = prepared()
    hooked = SdeRecorder(NOISE_LEVEL, req.generator)
    req.step = hooked
    with torch.no_grad():
        req = pipeline.denoising(req)
    expected, got = manual.trajectory(), hooked.trajectory()
    assert torch.equal(got.latents, expected.latents) and torch.equal(got.log_probs, expected.log_probs)
    assert torch.equal(req.latents, latents)
