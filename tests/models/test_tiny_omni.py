"""The omni tiny checkpoints' own choices (the conformance suite, tests/conformance/test_omni_conformance.py,
checks what every omni family's tiny must be: seeded, the stock full model loads it, one
preprocessor_config.json serving the image processor and the feature extractor): Qwen2.5-Omni's processor
fields, tokens, chat template and speakers, and each family record's parts and task."""

from __future__ import annotations

import json

import torch


def test_tiny_folders_processor_tokens_speakers_and_family_records(tiny_qwen2_5_omni, tiny_qwen3_omni_moe):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    from spindle.contracts.family import OmniFamily
    from spindle.registry import resolve_family

    fields = json.loads((tiny_qwen2_5_omni / "preprocessor_config.json").read_text())
    assert fields["image_processor_type"] == "Qwen2VLImageProcessor"
    assert fields["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert fields["processor_class"] == "Qwen2_5OmniProcessor"
    images = AutoImageProcessor.from_pretrained(tiny_qwen2_5_omni)
    audio = AutoFeatureExtractor.from_pretrained(tiny_qwen2_5_omni)
    assert images.merge_size == 2 and audio.feature_size == 128 and audio.sampling_rate == 16000

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_omni)
    assert (tok.audio_token, tok.image_token, tok.audio_bos_token) == ("<|AUDIO|>", "<|IMAGE|>", "<|audio_bos|>")
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A tone."},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|audio_bos|><|AUDIO|><|audio_eos|>What?<|im_end|>\n<|im_start|>assistant\nA tone.<|im_end|>\n"
    )

    assert set(torch.load(tiny_qwen2_5_omni / "spk_dict.pt", weights_only=True)) == {"Chelsie", "Ethan"}
    family = resolve_family(tiny_qwen2_5_omni)
    assert isinstance(family, OmniFamily) and family.kind == "omni" and family.task == "omni"
    assert family.part_of("model.audio_tower.layers.0.fc1.weight") == "audio"
    assert family.part_of("model.audio_tower.proj.weight") == "aligner"
    assert family.part_of("model.visual.merger.mlp.0.weight") == "aligner"
    assert family.part_of("model.language_model.layers.0.mlp.up_proj.weight") == "language"
    assert family.is_untrained("talker.model.layers.0.mlp.up_proj.weight")
    assert not family.is_untrained("thinker.model.layers.0.mlp.up_proj.weight")
    assert "Qwen2_5OmniForConditionalGeneration" in family.export_hint

    family = resolve_family(tiny_qwen3_omni_moe)
    assert isinstance(family, OmniFamily) and family.name == "qwen3_omni_moe" and family.task == "omni"
    assert family.part_of("model.audio_tower.proj2.weight") == "aligner"
    assert family.part_of("model.language_model.layers.0.mlp.experts.gate_up_proj") == "language"
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_omni_moe)
    assert (tok.audio_token, tok.image_token, tok.audio_bos_token) == (
        "<|audio_pad|>",
        "<|image_pad|>",
        "<|audio_start|>",
    )
