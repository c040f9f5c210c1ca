"""Tiny random vision-language models in the standard transformers folder layout (shared by the VLM
families' `tiny.py`).

`config.json`, `model.safetensors`, `generation_config.json`, a byte-level BPE tokenizer carrying Qwen's
special tokens and Qwen-VL's chat template, and `preprocessor_config.json` (the image processor's
fields): what `AutoModelForImageTextToText`, `AutoTokenizer` and the image processor load from a real
checkpoint, at a few hundred thousand parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Qwen's special tokens, in the order (and so the relative ids) of the real vocabulary's added tokens.
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# What the tiny Qwen-VL decoders and vision towers share (each family adds its own attention and patching):
# GQA over 64 wide, 2 layers; a 2-block tower 32 wide, merging 2x2 patches of 2 frames.
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
# The speech side's decoders of the tiny omni models (talker, code predictor): not trained by Spindle, so as small as
# the stock classes build and load
TINY_SPEECH_DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)
TINY_TOWER = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, spatial_merge_size=2, temporal_patch_size=2
)

# Qwen2-VL / Qwen2.5-VL's chat template (as their checkpoints ship it): string or content-part messages,
# one <|vision_start|><|image_pad|><|vision_end|> per image part (expanded to the image's token count by
# the processor, or spindle.data.multimodal), a default system turn.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL's chat template for string and image/video-part messages (its checkpoints ship a longer one with
# tool calls and reasoning, which renders these conversations the same): no default system turn.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Words the byte-level BPE learns merges for (the rest falls back to bytes, as in any byte-level BPE).
_CORPUS = (
    "You are a helpful assistant. What colour is the shape in the picture? Describe the image. "
    "The red circle is on the left. A blue square moves to the right. Yes, no, a green triangle. "
    "What is in this video? Which way does it move? The small yellow ball bounces."
)


def save_qwen_bpe_tokenizer(
    out: Path,
    vocab_size: int = 384,
    model_max_length: int = 32768,
    chat_template: str = QWEN_VL_CHAT_TEMPLATE,
    specials: tuple[str, ...] = QWEN_SPECIALS,
    named_tokens: dict[str, str] | None = None,
) -> Any:
    """A byte-level BPE tokenizer (Qwen's pre-tokenizer regex, no prefix space) trained locally on a few
    sentences, with `specials` (Qwen's special tokens) and `chat_template` (Qwen-VL's); `named_tokens`:
    tokenizer_config's `extra_special_tokens` (attribute name -> token, e.g. Qwen-Omni's `audio_token`, which
    its processor reads); -> the loaded transformers tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # Qwen2's split: contractions, letters, single digits, punctuation runs, newlines, spaces.
    qwen_split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen_split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "padding_side": "right",
        "split_special_tokens": False,
        "chat_template": chat_template,
        **({"extra_special_tokens": named_tokens} if named_tokens else {}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return AutoTokenizer.from_pretrained(out)


def save_image_processor_config(
    out: Path, vision: dict[str, Any], min_pixels: int = 28 * 28, max_pixels: int = 56 * 56, **kw: Any
) -> None:
    """preprocessor_config.json with Qwen2-VL's image processor fields (the Pil backend loads it without
    torchvision): the patching of the vision config `vision`, images of `min_pixels` to `max_pixels`, `kw` over
    the rest."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    fields = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "do_convert_rgb": True,
        "resample": 3,
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **kw,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(fields, indent=2))


def thinker_configs(
    tokenizer: Any, text: dict[str, Any], vision: dict[str, Any], over: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text and vision configs of a tiny Qwen-VL-style model (a VLM, an omni model's thinker): `text` over
    the tokenizer's vocabulary and special ids, `vision` projecting to the text width, each with the overrides
    `over` holds under "text_config" / "vision_config" (popped: the rest is the top level's)."""
    text_cfg = {
        **text,
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **over.pop("text_config", {}),
    }
    return text_cfg, {**vision, "out_hidden_size": text_cfg["hidden_size"], **over.pop("vision_config", {})}


def omni_thinker(
    out: Path,
    transformer: dict | None,
    tokenizer_fields: dict[str, Any],
    sizes: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    token_ids: dict[str, str],
) -> tuple[Any, dict[str, Any], dict[str, int]]:
    """The tokenizer (`save_qwen_bpe_tokenizer(out, **tokenizer_fields)`) and thinker config of a tiny omni model:
    its text, vision and audio `sizes` fitted to the tokenizer and the text width, `token_ids` (config field ->
    token) resolved, and the overrides in `transformer` (top level or under "text_config" / "vision_config" /
    "audio_config"); -> (tokenizer, thinker config, the resolved ids, which the talker's config repeats)."""
    tokenizer = save_qwen_bpe_tokenizer(out, **tokenizer_fields)
    over = dict(transformer or {})
    text, vision = thinker_configs(tokenizer, sizes[0], sizes[1], over)
    audio = {**sizes[2], "output_dim": text["hidden_size"], **over.pop("audio_config", {})}
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in token_ids.items()}
    return tokenizer, {"text_config": text, "vision_config": vision, "audio_config": audio, **ids, **over}, ids


def seeded_model(build: Callable[[], Any], seed: int, tokenizer: Any) -> Any:
    """The model `build()` makes with seeded random weights, its generation config stopping at the tokenizer's
    end of turn or of text."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = build()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build_tiny_vlm(
    model_type: str,
    out: str | Path,
    text: dict[str, Any],
    vision: dict[str, Any],
    seed: int = 0,
    transformer: dict | None = None,
    min_pixels: int = 28 * 28,
    max_pixels: int = 56 * 56,
    chat_template: str = QWEN_VL_CHAT_TEMPLATE,
    processor: dict[str, Any] | None = None,
    video_processor: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random `model_type` image-text-to-text model + tokenizer + image processor config to
    `out`; returns `out`. `transformer`: overrides merged last, top level or under "text_config" /
    "vision_config". `processor`: preprocessor_config.json fields over Qwen2-VL's defaults.
    `video_processor`: video_preprocessor_config.json's fields (the vision geometry added), written when given
    (Qwen3-VL checkpoints ship one; without it stock reads the image processor's file for videos too)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = Path(out)
    tokenizer = save_qwen_bpe_tokenizer(out, chat_template=chat_template)
    over = dict(transformer or {})
    text_cfg, vision_cfg = thinker_configs(tokenizer, text, vision, over)
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    config = AutoConfig.for_model(model_type, text_config=text_cfg, vision_config=vision_cfg, **ids, **over)
    model = seeded_model(lambda: AutoModelForImageTextToText.from_config(config, dtype=torch.float32), seed, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_image_processor_config(out, vision_cfg, min_pixels, max_pixels, **(processor or {}))
    if video_processor is not None:
        geometry = {
            "patch_size": vision_cfg["patch_size"],
            "temporal_patch_size": vision_cfg["temporal_patch_size"],
            "merge_size": vision_cfg["spatial_merge_size"],
        }
        (out / "video_preprocessor_config.json").write_text(json.dumps({**geometry, **video_processor}, indent=2))
    return out
