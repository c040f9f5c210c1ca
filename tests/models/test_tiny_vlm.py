"""`spindle tiny-model qwen2_5_vl` writes a transformers folder that stock transformers loads: model,
byte-level tokenizer with Qwen's special tokens and chat template, and the image processor."""

from __future__ import annotations

import json

import pytest
import torch

QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>")


@pytest.mark.parametrize(
    ("family", "cls"),
    [("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), ("qwen3_vl", "Qwen3VLForConditionalGeneration")],
)
def test_tiny_vlm_loads_in_stock_transformers(family, cls, tiny_checkpoint):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = tiny_checkpoint(family)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == cls
    tok = AutoTokenizer.from_pretrained(path)
    for token in (*QWEN_TOKENS, "<|endoftext|>"):
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token, token  # one special token each
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    # byte-level: any text round-trips, no unknown tokens
    text = "Ünïcode & emoji 🙂 survive"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    processor = AutoImageProcessor.from_pretrained(path)  # the PIL backend: no torchvision
    assert processor.merge_size == model.config.vision_config.spatial_merge_size
    assert processor.patch_size == model.config.vision_config.patch_size


def test_chat_template_places_one_pad_per_image_part(tiny_qwen2_5_vl):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A circle."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\nA circle.<|im_end|>\n"
    )


def test_cli_tiny_qwen2_5_vl_is_seeded(tmp_path, spindle_cli):
    from safetensors.torch import load_file

    for name in ("a", "b"):
        r = spindle_cli("tiny-model", "qwen2_5_vl", tmp_path / name, "--seed", "3")
        assert r.returncode == 0, r.stderr
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fields = json.loads((tmp_path / "a" / "preprocessor_config.json").read_text())
    assert fields["image_processor_type"] == "Qwen2VLImageProcessor"


def test_family_record_resolves_and_names_its_parts(tiny_qwen2_5_vl):
    from spindle.contracts.family import VLMFamily
    from spindle.registry import resolve_family

    family = resolve_family(tiny_qwen2_5_vl)
    assert isinstance(family, VLMFamily) and family.kind == "vlm" and family.task == "vlm"
    assert family.part_of("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert family.part_of("model.visual.merger.mlp.0.weight") == "aligner"
    assert family.part_of("model.language_model.layers.0.mlp.up_proj.weight") == "language"
    assert family.part_of("lm_head.weight") == "language"
    with pytest.raises(ValueError, match="rope_index"):
        VLMFamily(name="x", model_types=("x",), model_class="m:C")
