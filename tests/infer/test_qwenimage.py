"""Qwen-Image family: tiny checkpoint in stock diffusers (Qwen2.5-VL text encoder, chat-template
tokenizer), inference parity with QwenImagePipeline (fp32 CPU, 1e-5) with and without true CFG and
with variable-length prompts in one batch, request validation, `spindle generate`'s one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.models.qwenimage.tiny import build_tiny as build_tiny_qwenimage
from spindle.testing.conformance import before_denoising, check_generator_parity, check_request_error
from spindle.testing.specs import dit_spec
from tests.conftest import run_spindle


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """VAE x2 (32x32 px -> 16x16 latents -> 64 image tokens), 2 blocks of 2 heads x 16 (the session's)."""
    return tiny_checkpoint("qwenimage")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """VAE x4 with a wider base, 3 blocks of 4 heads x 8, a wider 3-layer text encoder."""
    return build_tiny_qwenimage(
        tmp_path_factory.mktemp("qwenimage_other"),
        seed=3,
        transformer={"num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)},
        vae={"base_dim": 12, "dim_mult": [1, 2, 2], "temperal_downsample": [False, True]},
        text_encoder={"hidden_size": 48, "num_attention_heads": 3, "num_hidden_layers": 3},
    )


def qwen_pipe(root):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------ the tiny checkpoint


def test_tiny_qwenimage_layout_and_configs(tiny):
    index = json.loads((tiny / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    tcfg = json.loads((tiny / "transformer" / "config.json").read_text())
    vcfg = json.loads((tiny / "vae" / "config.json").read_text())
    enc = json.loads((tiny / "text_encoder" / "config.json").read_text())
    scfg = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    assert tcfg["in_channels"] == 4 * vcfg["z_dim"] and tcfg["out_channels"] == vcfg["z_dim"]  # 2x2 packing
    assert tcfg["joint_attention_dim"] == enc["text_config"]["hidden_size"]
    assert sum(tcfg["axes_dims_rope"]) == tcfg["attention_head_dim"]
    assert len(set(vcfg["latents_mean"])) > 1 and len(set(vcfg["latents_std"])) > 1 and 0 not in vcfg["latents_mean"]
    assert scfg["use_dynamic_shifting"] is True and scfg["time_shift_type"] == "exponential"
    assert scfg["max_image_seq_len"] == 8192 and scfg["shift_terminal"] == 0.02


def test_tokenizer_template_prefix_is_what_the_pipeline_drops(tiny):
    """QwenImagePipeline drops the first 34 hidden states: exactly the template's system prefix,
    which our tokenizer (like the real Qwen2 one) splits into 34 tokens; the prompt survives."""
    pipe = qwen_pipe(tiny)
    template = pipe.prompt_template_encode
    prefix = template.split("{}")[0]
    tok = pipe.tokenizer
    ids = tok(prefix).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 34
    assert tok.unk_token_id not in ids and ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    full = tok(template.format("a red circle")).input_ids
    kept = tok.convert_ids_to_tokens(full[34:])
    assert kept[:3] == ["a", "red", "circle"] and kept[3] == "<|im_end|>"
    # variable length: two prompts -> embeddings padded to the longer, mask marks the real tokens
    embeds, mask = pipe.encode_prompt(["a cat", "a big red circle moves across the sky"], device="cpu")
    assert embeds.shape[:2] == mask.shape and mask.sum(1).tolist() == [2 + 5, 8 + 5]


# ------------------------------------------------------------------ parity with QwenImagePipeline

# The tiny checkpoint's cases (no CFG; true CFG with a negative prompt longer than the prompt) run in
# the conformance suite (tests/conformance/test_conformance.py::test_inference_equals_the_diffusers_pipeline);
# these are a second configuration with batches of prompts of different lengths.
CASES = {
    "other_no_cfg_batch_of_lengths": (
        "other",
        dict(
            prompt=["waves", "a big blue square moves across the sky at dusk"],
            height=32,
            width=64,
            num_inference_steps=2,
            max_sequence_length=12,  # truncates the long prompt
            seed=123,
        ),
    ),
    "other_true_cfg_batch_of_lengths": (
        "other",
        dict(
            prompt=["waves at dusk", "a cat"],
            negative_prompt=["", "ugly dark blurry picture"],
            true_cfg_scale=2.5,
            num_outputs_per_prompt=2,
            height=48,
            width=32,
            num_inference_steps=3,
            seed=5,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cfg_batch", [False, True], ids=["two_forwards", "cfg_batch"])
def test_images_equal_diffusers(case, cfg_batch, request):
    which, kw = CASES[case]
    stock = {k: v for k, v in kw.items() if k != "num_outputs_per_prompt"}
    stock["num_images_per_prompt"] = kw.get("num_outputs_per_prompt", 1)  # the pipeline's name for it
    check_generator_parity("qwenimage", request.getfixturevalue(which), kw, cfg_batch=cfg_batch, stock_kwargs=stock)


def test_true_cfg_scale_is_the_cfg_scale_and_the_cfg_case_has_texts_of_two_lengths(tiny):
    """true_cfg_scale is the scale the shared stage combines the branches with; the conformance suite's
    CFG case has a negative prompt longer than the prompt, so its batched-CFG checks (one forward of
    two, tests/conformance/test_conformance.py::test_cfg_batch_is_one_forward_equal_to_two, and parity) run with
    the shorter text padded and masked."""

    case = dit_spec("qwenimage").parity_cases["cfg"]
    _, req = before_denoising(tiny, {**case, "true_cfg_scale": 3.0})
    assert req.do_cfg and req.cfg_scale == 3.0
    assert req.embedded_guidance is None  # the tiny Qwen-Image embeds no guidance: guidance_scale means nothing to it
    assert req.prompt_embeds.shape[1] < req.negative_prompt_embeds.shape[1]


# The defaults (QwenImagePipeline's call defaults) and `spindle generate --true-cfg-scale` writing the
# generated png: tests/conformance/test_conformance.py (test_defaults_are_the_diffusers_pipeline_defaults,
# test_generate_cli_writes_the_generated_png).


# ------------------------------------------------------------------ bad requests


@pytest.fixture(scope="module")
def other_gen(other):

    return load_generator(other)


# The bad-request table (the rows every family shares, and what Qwen-Image's tiny checkpoint bounds: its
# ConformanceSpec.request_errors), the declared options, unknown options and frames for an image family:
# tests/conformance/test_conformance.py (test_bad_requests_are_clear_errors, test_bad_options_are_clear_request_errors).
def test_the_size_multiple_follows_the_checkpoints_vae(other_gen):
    """The other checkpoint's VAE downsamples x4 (the tiny one's x2): the multiple is read from the checkpoint."""
    check_request_error(
        other_gen,
        dict(prompt="a cat", height=36, width=32, num_inference_steps=2, seed=0),
        r"height must be a positive multiple of 8 for this model \(VAE x4 x 2x2 packing\) .*try 32 or 40",
    )


def test_generate_cli_option_errors_are_one_line(tiny, tmp_path):
    r = run_spindle(
        "generate", "--model", str(tiny), "--prompt", "x", "--true-cfg-scale", "3", "--height", "32", "--width", "32",
        "--steps", "2", "--out", str(tmp_path / "o.png"),
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "true_cfg_scale=3 enables CFG only with a negative_prompt" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [{"sp": 2}, {"ring": 2}, {"cfg_parallel": True}], ids=["sp2", "ring2", "cfg_parallel"]
)
def test_multiprocess_equals_single_process(tiny, tmp_path, options):
    """Ulysses SP=2 and ring attention ring=2 through the `_cp_plan` (prompts of 9 and 10 tokens: padded
    with masked zeros to even counts, a non-trivial text mask) and CFG-parallel over 2 real processes
    equal one process."""
    from spindle.testing.multiprocess import generate_on_ranks

    kw = dict(
        prompt="a small red fox", negative_prompt="blurry dark low quality picture", true_cfg_scale=3.0,
        height=32, width=48, num_inference_steps=2, seed=21,
    )  # fmt: skip
    exact = load_generator(tiny).generate(**kw).frames
    frames, _ = generate_on_ranks(tiny, options, kw, tmp_path)
    for rank_frames in frames:
        np.testing.assert_allclose(rank_frames, exact, atol=1e-5, rtol=0)


def test_sizes_past_the_rotary_table_are_refused_naming_the_field(tiny, tmp_path, spindle_cli):
    """diffusers' QwenEmbedRope has 4096 positions; the text's come after half the longer image
    axis. The largest size that fits gets every text position; one patch more would leave the text
    short of them (a failure mid-run), so validation refuses it, naming the field and the limit."""
    from spindle.infer import RequestError, SamplingParams

    gen = load_generator(tiny)
    rope, multiple, text = gen.transformer.pos_embed, 4, 512  # VAE x2 x 2x2 packing; the default text length
    assert rope.pos_freqs.shape[0] == 4096
    largest = ((4096 - text) * 2 + 1) * multiple  # 28676 px: 7169 patches, the text at 3584..4095
    rows = largest // multiple
    _, txt = rope([(1, rows, 1)], max_txt_seq_len=text, device=torch.device("cpu"))
    assert txt.shape[0] == text
    _, txt = rope([(1, rows + 1, 1)], max_txt_seq_len=text, device=torch.device("cpu"))
    assert txt.shape[0] == text - 1  # diffusers' own table, one patch further: the text is short a position

    base = dict(prompt="a cat", num_inference_steps=2, max_sequence_length=text)
    assert gen.validate(SamplingParams(**base, height=largest, width=multiple)).params.height == largest
    for field, size in (("height", dict(height=largest + multiple, width=multiple)),
                        ("width", dict(height=multiple, width=largest + multiple))):  # fmt: skip
        with pytest.raises(RequestError, match=rf"{field} is past this model's positional range") as e:
            gen.validate(SamplingParams(**base, **size))
        assert e.value.field == field
        assert f"at most {largest} with max_sequence_length 512" in str(e.value) and "4096" in str(e.value)
    # a shorter text makes room for the same size
    assert gen.validate(SamplingParams(**{**base, "max_sequence_length": text - 1}, height=largest + multiple, width=4))
    # `spindle generate` says the same in one line
    r = spindle_cli(
        "generate", "--model", tiny, "--prompt", "x", "--height", largest + multiple, "--width", multiple,
        "--steps", 2, "--out", tmp_path / "o.png",
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "height is past this model's positional range" in r.stderr and f"at most {largest}" in r.stderr
