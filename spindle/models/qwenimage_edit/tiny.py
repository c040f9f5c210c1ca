"""Tiny random Qwen-Image-Edit pipelines in the diffusers layout (`spindle tiny-model qwenimage_edit`,
`qwenimage_edit_plus`): Qwen-Image's tiny parts (models/qwenimage/tiny.py) with a tokenizer that
carries Qwen-VL's vision tokens, a text encoder whose vision tower reads them, and the `processor/`
folder (tokenizer + Qwen2-VL image processor config).

Sizes: the pipelines resize every input image to about 1024 x 1024 pixels for the VAE (a constant of
diffusers' pipelines), so the tiny VAE downsamples x8 (three stages, as the real one) to keep that
at 64 x 64 packed tokens; the image processor caps the vision tower's input at `max_pixels` (a field
of the processor config, 56 x 56 here: 4 vision tokens per image).
"""

from __future__ import annotations

from pathlib import Path

from spindle.models.qwenimage.tiny import (
    QWEN_CHAT_TOKENS,
    QWEN_PAD_TOKEN,
    QWEN_TEMPLATE_WORDS,
    QWENIMAGE_VISION,
    qwen_text_encoder_config,
    qwenimage_configs,
    save_qwenimage_pipeline,
)
from spindle.models.qwenimage_edit.processor import save_processor
from spindle.models.shared.tiny import Overrides, component_overrides, update_model_index
from spindle.models.shared.tokenizers import QWEN_PROMPT_SPLIT, save_qwen_prompt_tokenizer

VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
EDIT_VAE = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0, temperal_downsample=[False, True, True, False]
)
EDIT_VISION = dict(QWENIMAGE_VISION, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
# Qwen2-VL's image processor fields (those of real checkpoints, with a tiny pixel budget)
EDIT_IMAGE_PROCESSOR = dict(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=28 * 28,
    max_pixels=56 * 56,
    size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56},
)
# The edit template's words (and instructions' verbs), and Qwen2's pieces "'s" and ")," as single tokens: its system prefix is then
# 64 tokens, as with the real tokenizer (the pipelines drop the first 64 hidden states).
EDIT_TEMPLATE_WORDS = [
    *(
        "describe key features input color shape texture objects then explain how text instruction should alter "
        "modify generate new that meets requirements while maintaining consistency original where appropriate picture"
    ).split(),
    "(",
    "'s",
    "),",
    *"make put turn change into replace remove add".split(),  # instructions' verbs
]
EDIT_SPLIT = r"'s|\),|" + QWEN_PROMPT_SPLIT


def build_tiny(out: str | Path, seed: int = 0, pipeline: str = "QwenImageEditPipeline", **overrides: Overrides) -> Path:
    """Write a tiny random `pipeline` (QwenImageEditPipeline or QwenImageEditPlusPipeline) to `out`."""
    import diffusers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    tcfg, vcfg, ecfg = qwenimage_configs(transformer, {**EDIT_VAE, **vae}, text_encoder, seed)
    vocab = save_qwen_prompt_tokenizer(
        out / "tokenizer",
        [*QWEN_CHAT_TOKENS, *VISION_TOKENS.values()],
        QWEN_PAD_TOKEN,
        QWEN_TEMPLATE_WORDS + EDIT_TEMPLATE_WORDS,
        split=EDIT_SPLIT,
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    text_config = qwen_text_encoder_config(tokenizer, vocab, ecfg, EDIT_VISION, ids)
    save_qwenimage_pipeline(
        getattr(diffusers, pipeline), out, seed, tcfg, vcfg, text_config, tokenizer=tokenizer, processor=None
    )
    # the processor is written as checkpoints ship it (diffusers cannot build a Qwen2VLProcessor here)
    save_processor(out / "processor", out / "tokenizer", EDIT_IMAGE_PROCESSOR)
    return update_model_index(out, processor=["transformers", "Qwen2VLProcessor"])


def build_tiny_qwenimage_edit_plus(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random QwenImageEditPlusPipeline (several input images) to `out`; overrides as `build_tiny`'s."""
    return build_tiny(out, seed, pipeline="QwenImageEditPlusPipeline", **overrides)
