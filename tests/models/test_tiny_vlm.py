"""The tiny Qwen2.5-VL's chat template and family record. (That every VLM family's `spindle tiny-model`
is seeded and loads in stock transformers with Qwen's special tokens and the image processor:
tests/conformance/test_vlm_conformance.py.)"""

from __future__ import annotations

import pytest


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
