"""`spindle tiny-model` writes a checkpoint that stock diffusers loads and runs."""

import json

import numpy as np
import torch


def test_stock_wan_pipeline_runs_tiny_checkpoint(tiny_wan):
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    pipe = WanPipeline.from_pretrained(tiny_wan)
    assert isinstance(pipe.transformer, WanTransformer3DModel)
    assert isinstance(pipe.vae, AutoencoderKLWan)
    out = pipe(
        prompt="a red circle moves left",
        negative_prompt="blurry",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    frames = out.frames
    assert frames.shape == (1, 5, 32, 32, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1


def test_tiny_checkpoint_layout(tiny_wan):
    index = json.loads((tiny_wan / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for component in ("tokenizer", "text_encoder", "vae", "scheduler", "transformer"):
        assert (tiny_wan / component).is_dir(), component
    tcfg = json.loads((tiny_wan / "transformer" / "config.json").read_text())
    ecfg = json.loads((tiny_wan / "text_encoder" / "config.json").read_text())
    assert tcfg["text_dim"] == ecfg["d_model"]


def test_tokenizer_is_local_and_t5_style(tiny_wan):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_wan / "tokenizer")
    ids = tok("A red circle").input_ids
    assert ids[-1] == tok.eos_token_id == 1
    assert tok.unk_token_id not in ids  # demo words are in the vocabulary
    assert tok.pad_token_id == 0


def test_cli_tiny_model_is_seeded(tmp_path, spindle_cli):
    for name in ("a", "b"):
        r = spindle_cli("tiny-model", "wan", tmp_path / name, "--seed", "3")
        assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    a = load_file(tmp_path / "a" / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "b" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_component_the_checkpoint_has_not_is_refused_by_name(tmp_path):
    """A misspelt component override (a tiny builder's `**overrides`) is refused before anything is written,
    naming the components the family's checkpoint has."""
    import pytest

    from spindle.testing.tiny import build_tiny

    with pytest.raises(
        TypeError,
        match="no component text_encoder2 to override; this checkpoint has transformer, "
        "vae, text_encoder, text_encoder_2",
    ):
        build_tiny("flux", tmp_path / "flux", text_encoder2={"num_hidden_layers": 1})
    assert not (tmp_path / "flux").exists()
