"""Wan2.2 A14B two-expert training (families wan22 / wan22_i2v): the expert is chosen with `train.expert`
(refused before launch when missing or stray), its timesteps are drawn on its side of `boundary_ratio`, and
the export rewrites its folder only; a LoRA of the low-noise expert loads where stock diffusers puts it.
(The full-weight run and its stock-loaded export: tests/conformance for wan22 (high_noise) and wan22_i2v
(low_noise, the other folder byte for byte).)"""

from __future__ import annotations

import json

import pytest
import torch

from spindle.api import check_job_plan, load_job_config, make_trainer
from spindle.train.tasks.flow_matching import sample_generator
from tests.conftest import train_overrides


@pytest.fixture(scope="module")
def tiny_wan22(tiny_checkpoint):
    return tiny_checkpoint("wan22")


@pytest.mark.parametrize(
    "model,expert,message",
    [
        ("wan22", None, r"train.expert is required for a two-expert Wan2.2 A14B checkpoint: high_noise .*0.875"),
        ("wan", "low_noise", r"train.expert='low_noise': this checkpoint has one transformer"),
    ],
)
def test_the_expert_choice_is_checked_before_launch(model, expert, message, tiny_checkpoint, shapes_videos, tmp_path):
    extra = {} if expert is None else {"train__expert": expert}
    cfg = load_job_config(None, train_overrides(tiny_checkpoint(model), shapes_videos, tmp_path / "o", **extra))
    with pytest.raises(ValueError, match=message):
        check_job_plan(cfg, 1)


@pytest.mark.parametrize("expert,low,high", [("high_noise", 0.875, 1.0), ("low_noise", 0.0, 0.875)])
def test_timesteps_are_drawn_within_the_experts_range(expert, low, high, tiny_wan22):
    from spindle.config import TimestepConfig
    from spindle.models.wan22.condition import Wan22ConditionModel

    condition = Wan22ConditionModel.from_pretrained(tiny_wan22, max_text_length=16, encoders=False)
    condition.timestep_sampling = TimestepConfig(scheme="logit_normal")
    condition.select_expert(expert)
    latents = torch.zeros(64, 4, 1, 2, 2)
    inputs = condition.training_inputs(
        {"latents": latents, "prompt_embeds": torch.zeros(64, 16, 32)}, [sample_generator(0, 0, i) for i in range(64)]
    )
    t = inputs["timestep"]
    assert bool(((t >= low * 1000) & (t <= high * 1000)).all()), t
    assert t.max() - t.min() > 0.5 * (high - low) * 1000  # spread over the range, not a point
    # inference's switch (`t >= boundary`) sends every one of these timesteps to the trained expert
    assert bool((t >= 875).all() if expert == "high_noise" else (t < 875).all()), t


def test_a_low_noise_lora_exports_for_transformer_2_and_loads_there(tiny_wan22, shapes_videos, tmp_path):
    from diffusers import WanPipeline

    from spindle.api import load_generator

    overrides = train_overrides(
        tiny_wan22, shapes_videos, tmp_path / "run", train__expert="low_noise", train__max_steps=2,
        train__lora__rank=2, model__max_text_length=16,
    )  # fmt: skip
    result = make_trainer(load_job_config(None, overrides)).run()
    lora = result.export_dir / "lora"
    assert json.loads((lora / "spindle.json").read_text())["component"] == "transformer_2"
    assert "load_lora_weights(" in (card := (lora / "README.md").read_text()) and "load_into_transformer_2=True" in card
    pipe = WanPipeline.from_pretrained(tiny_wan22)
    pipe.load_lora_weights(lora, load_into_transformer_2=True)
    assert any("lora" in n for n, _ in pipe.transformer_2.named_parameters())
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())
    gen = load_generator(tiny_wan22, lora=str(lora))
    assert any("lora" in n for n, _ in gen.pipeline.components["transformer_2"].named_parameters())
    assert not any("lora" in n for n, _ in gen.pipeline.components["transformer"].named_parameters())
    # chosen per request at run time (`serve --lora-dir`): loaded into transformer_2 too, the same sample
    served = load_generator(tiny_wan22)
    adapters = served.enable_adapters(lora.parent, max_loras=2)
    assert adapters.load("low", lora).parameters > 0
    assert not any("lora" in n for n, _ in served.pipeline.components["transformer"].named_parameters())
    request = dict(prompt="a red circle", height=32, width=32, num_frames=5, num_inference_steps=3, seed=0)
    want = gen.generate(**request).frames
    assert (served.generate(**request, lora="low").frames == want).all()
    assert not (served.generate(**request).frames == want).all()  # the base alone differs


def test_validation_samples_denoise_with_the_trained_and_the_frozen_expert(tiny_wan22, shapes_videos, tmp_path):
    """Training the low-noise expert, validation renders with it and the checkpoint's high-noise expert: the
    sample equals the exported pipeline's output for the same request."""
    import numpy as np

    from spindle.api import load_generator
    from spindle.train.validation import render_samples

    overrides = train_overrides(
        tiny_wan22, shapes_videos, tmp_path / "run", train__expert="low_noise", train__max_steps=1,
        train__validation__every_steps=1, train__validation__num_inference_steps=3,
        train__validation__prompts='["a red circle"]', train__validation__num_frames=5, model__max_text_length=16,
    )  # fmt: skip
    trainer = make_trainer(load_job_config(None, overrides))
    result = trainer.run()
    assert (result.output_dir / "samples" / "step-000001" / "00.mp4").is_file()
    frames = render_samples(trainer.task, trainer.model, 1, tmp_path / "again")[0]
    # (validation and the export's default both encode at the trained text length, 16)
    exported = load_generator(result.export_dir).generate(
        prompt="a red circle", height=32, width=32, num_frames=5, num_inference_steps=3, seed=0
    )
    np.testing.assert_allclose(frames, exported.frames[0], atol=1e-5, rtol=0)
