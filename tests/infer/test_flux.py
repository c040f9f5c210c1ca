"""FLUX.1 family: tiny checkpoint in stock diffusers, inference parity with FluxPipeline (fp32 CPU,
1e-5), request validation, `spindle generate`'s one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.models.flux.tiny import build_tiny as build_tiny_flux
from spindle.testing.conformance import before_denoising, check_generator_parity, check_request_error

TOL = 1e-5


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """FLUX.1-schnell style (no guidance embedding), VAE x8 as the real one, 2+2 blocks, 4 heads x 8,
    wider encoders."""
    return build_tiny_flux(
        tmp_path_factory.mktemp("flux_other"),
        seed=3,
        transformer={
            "guidance_embeds": False,
            "num_layers": 2,
            "num_single_layers": 2,
            "num_attention_heads": 4,
            "attention_head_dim": 8,
            "axes_dims_rope": (2, 2, 4),
        },
        vae={"block_out_channels": (8, 8, 16, 16)},
        text_encoder={"hidden_size": 24, "num_attention_heads": 2},
        text_encoder_2={"d_model": 40, "num_heads": 5},
    )


def flux_pipe(root):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------ the tiny checkpoint


def test_tiny_flux_layout_and_configs(tiny_flux):
    index = json.loads((tiny_flux / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    tcfg = json.loads((tiny_flux / "transformer" / "config.json").read_text())
    vcfg = json.loads((tiny_flux / "vae" / "config.json").read_text())
    clip = json.loads((tiny_flux / "text_encoder" / "config.json").read_text())
    t5 = json.loads((tiny_flux / "text_encoder_2" / "config.json").read_text())
    scfg = json.loads((tiny_flux / "scheduler" / "scheduler_config.json").read_text())
    assert tcfg["in_channels"] == 4 * vcfg["latent_channels"]  # 2x2 packing
    assert tcfg["joint_attention_dim"] == t5["d_model"] and tcfg["pooled_projection_dim"] == clip["hidden_size"]
    assert sum(tcfg["axes_dims_rope"]) == tcfg["attention_head_dim"] and tcfg["guidance_embeds"] is True
    assert vcfg["shift_factor"] != 0 and vcfg["scaling_factor"] != 1
    assert scfg["use_dynamic_shifting"] is True and scfg["base_shift"] == 0.5 and scfg["max_shift"] == 1.15


def test_clip_tokenizer_has_bos_and_eos_for_pooling(tiny_flux):
    from transformers import AutoTokenizer, CLIPTextModel

    tok = AutoTokenizer.from_pretrained(tiny_flux / "tokenizer")
    assert tok.model_max_length == 77
    ids = tok("A red circle", padding="max_length", max_length=77).input_ids
    assert ids[0] == tok.bos_token_id and ids[4] == tok.eos_token_id == 1 and ids[5:] == [0] * 72
    assert tok.unk_token_id not in ids
    # CLIPTextModel pools at the first eos: the pooled output must not depend on padding.
    model = CLIPTextModel.from_pretrained(tiny_flux / "text_encoder")
    short = model(torch.tensor([ids[:10]])).pooler_output
    full = model(torch.tensor([ids])).pooler_output
    torch.testing.assert_close(short, full)


# ------------------------------------------------------------------ parity with FluxPipeline
# The tiny checkpoint's cases (embedded guidance; true CFG) run in the conformance suite; these are
# a second configuration.

CASES = {
    "other_schnell": (
        "other",
        dict(
            prompt="waves at dusk",
            height=48,
            width=32,
            num_inference_steps=2,
            guidance_scale=0.0,
            max_sequence_length=24,
            seed=123,
        ),
    ),
    "other_true_cfg": (
        "other",
        dict(
            prompt="waves at dusk",
            negative_prompt="low quality",
            height=32,
            width=64,
            num_inference_steps=3,
            guidance_scale=0.0,
            max_sequence_length=8,
            seed=5,
            true_cfg_scale=2.5,  # FluxPipeline and generate() both take it as a keyword
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cfg_batch", [False, True], ids=["two_forwards", "cfg_batch"])
def test_images_equal_diffusers(case, cfg_batch, request):
    which, kw = CASES[case]
    check_generator_parity("flux", request.getfixturevalue(which), kw, cfg_batch=cfg_batch)


def test_true_cfg_scale_is_the_cfg_scale_and_guidance_stays_embedded(tiny_flux):
    """true_cfg_scale is the scale the shared stage combines the two branches with; guidance_scale
    (unset: FluxPipeline's 3.5) stays the embedded guidance. (That the batched CFG step is one forward
    equal to two: tests/conformance/test_conformance.py::test_cfg_batch_is_one_forward_equal_to_two.)"""
    kw = dict(prompt="a boat", negative_prompt="ugly", height=32, width=32, num_inference_steps=2, seed=1)
    _, req = before_denoising(tiny_flux, {**kw, "max_sequence_length": 16, "true_cfg_scale": 3.0})
    assert req.do_cfg and req.cfg_scale == 3.0
    assert torch.equal(req.embedded_guidance, torch.full((1,), 3.5))
    assert "guidance" not in req.extra  # one place for it: the Req field the transformer's guidance= reads


def test_batch_of_prompts_and_outputs_per_prompt(tiny_flux):

    kw = dict(
        prompt=["a cat", "a dog"],
        negative_prompt=["dark", "noisy"],
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=2.0,
        max_sequence_length=16,
    )
    ref = flux_pipe(tiny_flux)(
        **kw, true_cfg_scale=2.0, num_images_per_prompt=2, generator=torch.Generator().manual_seed(11), output_type="np"
    ).images
    out = load_generator(tiny_flux).generate(**kw, true_cfg_scale=2.0, num_outputs_per_prompt=2, seed=11)
    assert out.frames.shape == ref.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(out.frames, ref, atol=TOL, rtol=0)


# The defaults (FluxPipeline's call defaults) and `spindle generate` writing the generated png:
# tests/conformance/test_conformance.py (test_defaults_are_the_diffusers_pipeline_defaults,
# test_generate_cli_writes_the_generated_png).


# ------------------------------------------------------------------ bad requests


@pytest.fixture(scope="module")
def other_gen(other):

    return load_generator(other)


# The bad-request table (the rows every family shares, and what Flux's tiny checkpoint bounds: its
# ConformanceSpec.request_errors), the declared options, unknown options and frames for an image family:
# tests/conformance/test_conformance.py (test_bad_requests_are_clear_errors, test_bad_options_are_clear_request_errors).
def test_the_size_multiple_follows_the_checkpoints_vae(other_gen):
    """The other checkpoint's VAE downsamples x8 (the tiny one's x2): the multiple is read from the checkpoint."""
    base = dict(prompt="a cat", height=32, width=32, num_inference_steps=1, max_sequence_length=8, seed=0)
    check_request_error(
        other_gen,
        {**base, "height": 40},
        r"height must be a positive multiple of 16 for this model \(VAE x8 x 2x2 packing\) \(got 40\); try 32 or 48",
    )


def test_flux_has_no_positional_range_to_check(other):
    """FluxPosEmbed computes every rotary angle from the position id (no table to overrun, unlike
    Wan's rope_max_seq_len or Qwen-Image's 4096 positions), so a size far past those is valid; what
    Flux does bound (size multiple, images only, max_sequence_length <= 512) is checked above. Very
    large sizes are past what the checkpoints were trained on, not past what runs: the server's
    --max-pixels bounds them."""
    from spindle.infer import SamplingParams

    gen = load_generator(other)
    tall = 16 * 8200  # 8200 patch rows: past 4096 positions
    assert gen.validate(SamplingParams(prompt="x", height=tall, width=16, num_inference_steps=1)).params.height == tall
    rope = gen.transformer.pos_embed
    cos, sin = rope(torch.tensor([[0.0, 8199.0, 0.0]]))  # image id (0, row, col) of the last row
    d0, d1, _ = rope.axes_dim
    freqs = 1.0 / rope.theta ** (torch.arange(0, d1, 2, dtype=torch.float64) / d1)
    angles = (8199.0 * freqs).repeat_interleave(2)  # the row axis: the exact angles, not a clamped position
    torch.testing.assert_close(cos[0, d0 : d0 + d1].double(), torch.cos(angles), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0, d0 : d0 + d1].double(), torch.sin(angles), atol=1e-6, rtol=0)


def test_generate_cli_bad_size_is_one_line(tiny_flux, tmp_path, spindle_cli):
    r = spindle_cli(
        "generate",
        "--model",
        tiny_flux,
        "--prompt",
        "x",
        "--height",
        "30",
        "--width",
        "32",
        "--steps",
        "1",
        "--out",
        tmp_path / "o.png",
    )
    assert r.returncode == 2
    assert "height must be a positive multiple of 4" in r.stderr and "Traceback" not in r.stderr
