"""A tiny random Qwen3-Omni-MoE in the published folder layout (`spindle tiny-model qwen3_omni_moe`): the whole
`Qwen3OmniMoeForConditionalGeneration` (thinker, talker, code2wav) in one safetensors file, a tokenizer with
Qwen3-Omni's special tokens, `extra_special_tokens` and chat template, and one `preprocessor_config.json`
holding the image processor's and the `WhisperFeatureExtractor`'s fields (as the Qwen2.5-Omni tiny)."""

from __future__ import annotations

from pathlib import Path

import torch

from spindle.models.qwen2_5_omni.tiny import OMNI_CHAT_TEMPLATE, TINY_AUDIO, save_omni_preprocessor
from spindle.models.qwen3_vl.tiny import TINY_TEXT, TINY_VISION
from spindle.models.qwen3_vl_moe.tiny import TINY_MOE
from spindle.models.shared.tiny_vlm import QWEN_SPECIALS, TINY_SPEECH_DECODER, omni_thinker, seeded_model

# Qwen3-Omni's added tokens, in the order (so the relative ids) of the real vocabulary: Qwen3's list, then
# the audio and TTS tokens.
OMNI_MOE_SPECIALS = (
    *QWEN_SPECIALS,
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# tokenizer_config's extra_special_tokens: the attributes Qwen3OmniMoeProcessor reads from its tokenizer.
OMNI_MOE_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# Qwen2.5-Omni's template with Qwen3-Omni's token names (the published one also carries tools and thinking).
_RENAMED = {
    "<|AUDIO|>": "<|audio_pad|>",
    "<|audio_bos|>": "<|audio_start|>",
    "<|audio_eos|>": "<|audio_end|>",
    "<|IMAGE|>": "<|image_pad|>",
    "<|VIDEO|>": "<|video_pad|>",
    "<|vision_bos|>": "<|vision_start|>",
    "<|vision_eos|>": "<|vision_end|>",
}
OMNI_MOE_CHAT_TEMPLATE = OMNI_CHAT_TEMPLATE
for _old, _new in _RENAMED.items():
    OMNI_MOE_CHAT_TEMPLATE = OMNI_MOE_CHAT_TEMPLATE.replace(_old, _new)

# The thinker, scaled down: Qwen3-VL-MoE's decoder and vision tower (tiny_vlm's Qwen3-VL + 8 experts, top-2)
# and Qwen3-Omni's audio encoder: three stride-2 convolutions over 100-frame chunks (n_window 50, which the
# stock processor's token count assumes), attention within n_window_infer frames.
TINY_TEXT_MOE = {k: v for k, v in {**TINY_TEXT, **TINY_MOE}.items() if k != "head_dim"}
TINY_AUDIO_MOE = dict(
    {k: v for k, v in TINY_AUDIO.items() if k != "n_window"},
    n_window=50,
    n_window_infer=200,  # two chunks per attention window: a 3-second clip spans two
    downsample_hidden_size=16,
    conv_chunksize=500,
)
THINKER_SIZES = (TINY_TEXT_MOE, TINY_VISION, TINY_AUDIO_MOE)
# Not trained by Spindle; small enough to keep the folder light, complete enough that the stock class builds
# and loads them. The talker's codec ids (codec_*_id, speaker ids) are below its vocabulary size.
TINY_TALKER_TEXT = dict(
    TINY_SPEECH_DECODER,
    vocab_size=4208,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    # read by the talker's shared expert but not declared by its config class: the published config.json has it
    shared_expert_intermediate_size=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "interleaved": True},
)
TINY_CODE_PREDICTOR = dict(TINY_SPEECH_DECODER, vocab_size=64, num_code_groups=4)
TINY_CODE2WAV = dict(
    codebook_size=64,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    num_hidden_layers=1,
    num_quantizers=4,
    sliding_window=8,
    max_position_embeddings=256,
    upsample_rates=[2, 2],
    upsampling_ratios=[2],
    decoder_dim=32,
)


OMNI_MOE_TOKENIZER = dict(
    chat_template=OMNI_MOE_CHAT_TEMPLATE, specials=OMNI_MOE_SPECIALS, named_tokens=OMNI_MOE_NAMED_TOKENS
)
# the thinker config's token ids
OMNI_MOE_TOKEN_IDS = {
    "audio_token_id": "<|audio_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "audio_start_token_id": "<|audio_start|>",
    "vision_start_token_id": "<|vision_start|>",
}


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    """Write the tiny folder to `out`; returns `out` (`transformer`: as for the tiny Qwen2.5-Omni)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    out = Path(out)
    tokenizer, thinker, ids = omni_thinker(out, transformer, OMNI_MOE_TOKENIZER, THINKER_SIZES, OMNI_MOE_TOKEN_IDS)
    text, vision = thinker["text_config"], thinker["vision_config"]
    token = tokenizer.convert_tokens_to_ids
    talker = {
        "text_config": TINY_TALKER_TEXT,
        "code_predictor_config": TINY_CODE_PREDICTOR,
        "num_code_groups": TINY_CODE_PREDICTOR["num_code_groups"],
        "thinker_hidden_size": text["hidden_size"],
        "accept_hidden_layer": text["num_hidden_layers"] - 1,
        "speaker_id": {"ethan": 4100, "chelsie": 4101},
        # read by the talker's get_rope_index, not declared by its config class (the published config has it)
        "spatial_merge_size": vision["spatial_merge_size"],
        **ids,
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=TINY_CODE2WAV,
        im_start_token_id=token("<|im_start|>"),
        im_end_token_id=token("<|im_end|>"),
        tts_pad_token_id=token("<tts_pad>"),
        tts_bos_token_id=token("<tts_text_bos>"),
        tts_eos_token_id=token("<tts_text_eod>"),
    )
    model = seeded_model(
        lambda: Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.float32), seed, tokenizer
    )
    # transformers' _init_weights leaves the talker's fused experts as allocated (uninitialised memory, so
    # different bytes on every build): drawn here from the seed, as the thinker's are
    with torch.no_grad():
        for name, param in model.talker.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, config.initializer_range)
    # Stock save_pretrained: the thinker's experts fused and transposed (`gate_up_proj [E, H, 2I]`), the
    # layout of Qwen's released checkpoints.
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Qwen3-Omni's processor: 0.5 mean/std normalisation, 32-pixel merged patches.
    save_omni_preprocessor(
        out,
        vision,
        "Qwen3OmniMoeProcessor",
        min_pixels=32 * 32,
        max_pixels=64 * 64,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return out
