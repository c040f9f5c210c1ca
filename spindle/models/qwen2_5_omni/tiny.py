"""A tiny random Qwen2.5-Omni in the published folder layout (`spindle tiny-model qwen2_5_omni`): the whole
`Qwen2_5OmniForConditionalGeneration` (thinker, talker, token2wav) in one safetensors file, `spk_dict.pt`,
a tokenizer with Qwen-Omni's special tokens, `extra_special_tokens` and chat template, and one
`preprocessor_config.json` holding the image processor's and the `WhisperFeatureExtractor`'s fields (as
the published checkpoints have it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.models.qwen2_5_vl.tiny import TINY_TEXT
from spindle.models.qwen2_5_vl.tiny import TINY_VISION as QWEN2_5_VL_VISION
from spindle.models.shared.tiny_vlm import (
    QWEN_VL_CHAT_TEMPLATE,
    TINY_SPEECH_DECODER,
    omni_thinker,
    save_image_processor_config,
    seeded_model,
)

# Qwen2.5-Omni's added tokens, in the order (so the relative ids) of the real vocabulary: Qwen-VL's list with
# the audio tokens in place of the object-ref/box tokens and the vision tokens renamed.
OMNI_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# tokenizer_config's extra_special_tokens: the attributes Qwen2_5OmniProcessor reads from its tokenizer.
OMNI_NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# the thinker config's token ids
OMNI_TOKEN_IDS = {
    "audio_token_index": "<|AUDIO|>",
    "image_token_index": "<|IMAGE|>",
    "video_token_index": "<|VIDEO|>",
    "audio_start_token_id": "<|audio_bos|>",
    "audio_end_token_id": "<|audio_eos|>",
    "vision_start_token_id": "<|vision_bos|>",
    "vision_end_token_id": "<|vision_eos|>",
}
# Qwen2.5-Omni's chat template for string and image/audio/video-part messages (the published one also
# carries tool calls): Qwen-VL's with Qwen-Omni's vision token names and audio parts, one
# <|audio_bos|><|AUDIO|><|audio_eos|> each, expanded to the clip's token count by the processor (or
# spindle.data.multimodal).
_VISION_NAMES = {
    "<|vision_start|>": "<|vision_bos|>",
    "<|vision_end|>": "<|vision_eos|>",
    "<|image_pad|>": "<|IMAGE|>",
    "<|video_pad|>": "<|VIDEO|>",
}
_AUDIO_PART = (
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
)
OMNI_CHAT_TEMPLATE = QWEN_VL_CHAT_TEMPLATE
for _old, _new in _VISION_NAMES.items():
    OMNI_CHAT_TEMPLATE = OMNI_CHAT_TEMPLATE.replace(_old, _new)
OMNI_CHAT_TEMPLATE = OMNI_CHAT_TEMPLATE.replace(
    "{% set image_count", "{% set audio_count = namespace(value=0) %}{% set image_count", 1
).replace("{% elif content['type'] == 'video'", _AUDIO_PART + "{% elif content['type'] == 'video'", 1)

# The thinker, scaled down: Qwen2.5-VL's decoder and windowed vision tower (the tiny Qwen2.5-VL's), and a
# Whisper-style audio encoder over 128 mel bins whose attention windows are n_window * 2 frames.
TINY_VISION = {k: v for k, v in QWEN2_5_VL_VISION.items() if k != "tokens_per_second"}  # the thinker's has none
TINY_AUDIO = dict(
    num_mel_bins=128,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
    max_source_positions=64,
    n_window=8,  # 16-frame attention windows: a half-second clip spans several
)
THINKER_SIZES = (TINY_TEXT, TINY_VISION, TINY_AUDIO)
# Not trained by Spindle; small enough to keep the folder light, complete enough that the stock class builds
# and loads them.
TINY_TALKER = dict(
    TINY_SPEECH_DECODER,
    vocab_size=8448,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
TINY_DIT: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=16,
    ff_mult=2,
    emb_dim=16,
    enc_emb_dim=16,
    enc_dim=16,
    enc_channels=[16, 16, 16, 16, 48],
    enc_attention_channels=8,
    enc_se_channels=8,
    look_ahead_layers=[1],
    look_backward_layers=[0],
)
TINY_TOKEN2WAV = dict(
    dit_config=TINY_DIT,
    bigvgan_config=dict(upsample_initial_channel=64, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]]),
)
# WhisperFeatureExtractor as Qwen2.5-Omni configures it (128 mel bins, 16 kHz, attention mask), with a
# 10-second window (the published 300 s makes each clip's features 30x dearer to compute).
TINY_AUDIO_FEATURES = dict(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=10, n_fft=400)


OMNI_TOKENIZER = dict(chat_template=OMNI_CHAT_TEMPLATE, specials=OMNI_SPECIALS, named_tokens=OMNI_NAMED_TOKENS)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    """Write the tiny folder to `out`; returns `out`. `transformer`: overrides of the thinker config (top level
    or under "text_config" / "vision_config" / "audio_config")."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    out = Path(out)
    tokenizer, thinker, ids = omni_thinker(out, transformer, OMNI_TOKENIZER, THINKER_SIZES, OMNI_TOKEN_IDS)
    text, vision = thinker["text_config"], thinker["vision_config"]
    talker = {**TINY_TALKER, "embedding_size": text["hidden_size"], **ids}
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=TINY_TOKEN2WAV)
    model = seeded_model(
        lambda: Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=torch.float32), seed, tokenizer
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The speaker table the stock class reads on load: per voice, the talker's codec bos token and the
    # token2wav's speaker conditioning and reference mel.
    g = torch.Generator().manual_seed(seed + 1)
    speakers = {
        name: {
            "bos_token": 8293,
            "cond": torch.randn(TINY_DIT["enc_emb_dim"], generator=g),
            "ref_mel": torch.randn(8, 80, generator=g),
        }
        for name in ("Chelsie", "Ethan")
    }
    torch.save(speakers, out / "spk_dict.pt")
    save_omni_preprocessor(out, vision, "Qwen2_5OmniProcessor")
    return out


def save_omni_preprocessor(out: Path, vision: dict[str, Any], processor_class: str, **image_fields: Any) -> None:
    """One preprocessor_config.json, as the published omni checkpoints have it: Qwen2-VL's image processor
    fields (`vision`'s patching, `image_fields`) + the WhisperFeatureExtractor's (TINY_AUDIO_FEATURES)."""
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    features = WhisperFeatureExtractor(**TINY_AUDIO_FEATURES, return_attention_mask=True, padding_side="right")
    save_image_processor_config(out, vision, **image_fields, **features.to_dict(), processor_class=processor_class)
    fields = json.loads((out / "preprocessor_config.json").read_text())
    assert fields["feature_extractor_type"] == "WhisperFeatureExtractor", "one file holds both processors' fields"
