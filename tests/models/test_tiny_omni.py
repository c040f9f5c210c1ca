"""`spindle tiny-model qwen2_5_omni`: a seeded whole Qwen2.5-Omni folder that the stock full model class loads
(thinker, talker, token2wav, speakers), one preprocessor_config.json that both the image processor and the
WhisperFeatureExtractor read, a tokenizer carrying the Omni tokens and chat template, and the family record."""

from __future__ import annotations

import json

import torch


def test_cli_tiny_qwen2_5_omni_is_seeded_and_loads_in_the_stock_full_model(tmp_path, spindle_cli):
    from safetensors.torch import load_file
    from transformers import Qwen2_5OmniForConditionalGeneration

    for name in ("a", "b"):
        r = spindle_cli("tiny-model", "qwen2_5_omni", tmp_path / name, "--seed", "3")
        assert r.returncode == 0, r.stderr
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k.split(".")[0] for k in a} == {"thinker", "talker", "token2wav"}

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tmp_path / "a")
    assert model.has_talker and set(model.speaker_map) == {"Chelsie", "Ethan"}
    stored = load_file(tmp_path / "a" / "model.safetensors")
    assert all(torch.equal(v, stored[f"talker.{k}"]) for k, v in model.talker.state_dict().items())


def test_one_preprocessor_config_serves_images_and_audio(tiny_qwen2_5_omni):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

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


def test_family_record_resolves_and_names_its_parts(tiny_qwen2_5_omni):
    from spindle.contracts.family import OmniFamily
    from spindle.registry import resolve_family

    family = resolve_family(tiny_qwen2_5_omni)
    assert isinstance(family, OmniFamily) and family.kind == "omni" and family.task == "omni"
    assert family.part_of("model.audio_tower.layers.0.fc1.weight") == "audio"
    assert family.part_of("model.audio_tower.proj.weight") == "aligner"
    assert family.part_of("model.visual.merger.mlp.0.weight") == "aligner"
    assert family.part_of("model.language_model.layers.0.mlp.up_proj.weight") == "language"
    assert family.is_untrained("talker.model.layers.0.mlp.up_proj.weight")
    assert not family.is_untrained("thinker.model.layers.0.mlp.up_proj.weight")
    assert "Qwen2_5OmniForConditionalGeneration" in family.export_hint


def test_cli_tiny_qwen3_omni_moe_is_seeded_and_loads_in_the_stock_full_model(tmp_path, spindle_cli):
    """`spindle tiny-model qwen3_omni_moe`: thinker, talker and code2wav in stock's layout (the thinker's experts
    per expert, as Qwen's checkpoints store them), Qwen3-Omni's tokens and one preprocessor_config.json."""
    from safetensors.torch import load_file
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3OmniMoeForConditionalGeneration,
    )

    from spindle.contracts.family import OmniFamily
    from spindle.registry import resolve_family

    for name in ("a", "b"):
        r = spindle_cli("tiny-model", "qwen3_omni_moe", tmp_path / name, "--seed", "3")
        assert r.returncode == 0, r.stderr
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k.split(".")[0] for k in a} == {"thinker", "talker", "code2wav"}
    assert "thinker.model.layers.0.mlp.experts.7.gate_proj.weight" in a

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert model.has_talker and not info["missing_keys"] and not info["unexpected_keys"]
    talker = model.talker.state_dict()  # its experts fused on load from the stored per-expert tensors
    assert all(torch.equal(v, a[f"talker.{k}"]) for k, v in talker.items() if ".experts." not in k)
    down = talker["model.layers.0.mlp.experts.down_proj"]
    assert down.abs().sum() > 0 and torch.equal(down[3], a["talker.model.layers.0.mlp.experts.3.down_proj.weight"])

    fields = json.loads((tmp_path / "a" / "preprocessor_config.json").read_text())
    assert fields["processor_class"] == "Qwen3OmniMoeProcessor"
    assert AutoImageProcessor.from_pretrained(tmp_path / "a").merge_size == 2
    assert AutoFeatureExtractor.from_pretrained(tmp_path / "a").feature_size == 128
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert (tok.audio_token, tok.image_token, tok.audio_bos_token) == (
        "<|audio_pad|>",
        "<|image_pad|>",
        "<|audio_start|>",
    )
    assert tok.convert_tokens_to_ids(tok.audio_token) == model.config.thinker_config.audio_token_id

    family = resolve_family(tmp_path / "a")
    assert isinstance(family, OmniFamily) and family.name == "qwen3_omni_moe" and family.task == "omni_moe"
    assert family.part_of("model.audio_tower.proj2.weight") == "aligner"
    assert family.part_of("model.language_model.layers.0.mlp.experts.gate_up_proj") == "language"
