"""Tiny random FLUX.2 pipelines in the diffusers layout (`spindle tiny-model flux2`, `flux2_klein`).

Both share the FLUX.2 parts: `Flux2Transformer2DModel`, `AutoencoderKLFlux2` (its latents 2x2-patchified into
the channels and normalized by the VAE's own batch-norm statistics, set non-trivial here so a missed
normalization shows), the dynamic-shift flow-matching scheduler. The text encoders differ:

- FLUX.2-dev: `Mistral3ForConditionalGeneration` (a tiny Mistral text model + Pixtral vision tower) and a
  `tokenizer/` folder as the checkpoint ships its `PixtralProcessor` (tokenizer files with the chat template,
  the processor and Pixtral image processor configs, written by hand: transformers cannot import
  `PixtralProcessor` without torchvision). The one departure from the real layout: model_index.json names the
  tokenizer component `PreTrainedTokenizerFast`, so stock diffusers loads the folder here (it can build no
  PixtralProcessor, nor take one passed in); `processor=True` writes the real name, which Spindle reads the same
  (`processor.py`).
- FLUX.2 [klein]: `Qwen3ForCausalLM` with a Qwen chat-template tokenizer; `is_distilled` in model_index.json.

The pipelines stack the text encoder's hidden states at fixed layers ((10, 20, 30) and (9, 18, 27)), so the
tiny text models keep that depth at a tiny width; the transformer's text width is 3 x theirs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.models.shared.tiny import (
    Overrides,
    component_overrides,
    dynamic_shift_scheduler,
    save_seeded_pipeline,
    update_model_index,
)

FLUX2_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # VAE latent channels x 2x2 patchify
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),  # (T, H, W, L) position axes; sums to attention_head_dim
    guidance_embeds=True,  # FLUX.2-dev: guidance-distilled (Klein's: False)
)
FLUX2_VAE = dict(
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),  # 2 blocks: x2 spatial compression
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
)
TEXT_WIDTH = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MISTRAL_TEXT = dict(TEXT_WIDTH, num_hidden_layers=30, max_position_embeddings=1024)  # layers 10, 20, 30 stacked
PIXTRAL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
QWEN3_TEXT = dict(TEXT_WIDTH, num_hidden_layers=28, max_position_embeddings=1024)  # layers 9, 18, 27 stacked
# FLUX.2-dev's scheduler config: resolution-dependent ("dynamic") shift
FLUX2_SCHEDULER = dynamic_shift_scheduler(shift=3.0, max_shift=1.15, max_image_seq_len=4096)

# Mistral's chat conventions (the Mistral-Small-3 processor's template, text and image blocks)
MISTRAL_SPECIALS = [
    "<s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% else %}[IMG]{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}{% endfor %}"
)
# Pixtral's image processor fields (those of FLUX.2-dev's tokenizer/preprocessor_config.json)
PIXTRAL_IMAGE_PROCESSOR = {
    "image_processor_type": "PixtralImageProcessor",
    "processor_class": "PixtralProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 64},
}


def flux2_configs(transformer: dict[str, Any], vae: dict[str, Any], text_width: int) -> tuple[dict, dict]:
    """The transformer and VAE configs: defaults + overrides, the VAE's block types following its depth, the
    transformer's input channels 4 x the VAE's latents and its text width 3 x the text encoder's."""
    tcfg = {**FLUX2_TRANSFORMER, **transformer}
    vcfg = {**FLUX2_VAE, **vae}
    depth = len(vcfg["block_out_channels"])
    vcfg["down_block_types"] = tuple(vcfg["down_block_types"][:1]) * depth
    vcfg["up_block_types"] = tuple(vcfg["up_block_types"][:1]) * depth
    if tcfg["in_channels"] % 4:
        raise ValueError(
            f"FLUX.2 in_channels must be 4 x VAE latent channels (2x2 patchify); got {tcfg['in_channels']}"
        )
    vcfg["latent_channels"] = tcfg["in_channels"] // 4
    tcfg["joint_attention_dim"] = 3 * text_width  # three hidden-state layers stacked
    return tcfg, vcfg


def seeded_vae(vcfg: dict[str, Any], seed: int) -> Any:
    """`AutoencoderKLFlux2(**vcfg)` with non-trivial batch-norm statistics (the latents' normalization)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**vcfg).eval()
    g = torch.Generator().manual_seed(seed + 7)
    channels = vae.bn.running_mean.shape[0]
    vae.bn.running_mean.copy_(torch.rand(channels, generator=g) - 0.5)
    vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(channels, generator=g))
    return vae


def save_flux2_pipeline(pipeline: str, out: Path, seed: int, tcfg: dict, vcfg: dict, **parts: Any) -> Path:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    return save_seeded_pipeline(
        getattr(diffusers, pipeline),
        out,
        seed,
        vae=lambda: seeded_vae(vcfg, seed),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        transformer=lambda: Flux2Transformer2DModel(**tcfg).eval(),
        **parts,
    )


def save_mistral_tokenizer(out: Path) -> Any:
    """FLUX.2-dev's `tokenizer/` folder: a word-level tokenizer (the system message's words one token each, so
    it takes ~40 tokens, not the whole text budget) with Mistral's specials and chat template, and the
    PixtralProcessor's configs as the checkpoint ships them. -> the tokenizer."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PreTrainedTokenizerFast

    from spindle.models.shared.tokenizers import save_qwen_prompt_tokenizer

    words = sorted({w.strip(".,").lower() for w in SYSTEM_MESSAGE.split()})
    save_qwen_prompt_tokenizer(out, MISTRAL_SPECIALS, "<pad>", words)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PIXTRAL_IMAGE_PROCESSOR, indent=2) + "\n")
    processor: dict[str, Any] = {"processor_class": "PixtralProcessor", "image_token": "[IMG]"}
    processor |= {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "patch_size": 16}
    processor["spatial_merge_size"] = 2
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return tokenizer


def build_tiny(out: str | Path, seed: int = 0, processor: bool = False, **overrides: Overrides) -> Path:
    """Write a tiny random FLUX.2-dev pipeline (`Flux2Pipeline`) to `out`; overrides (`transformer`, `vae`,
    `text_encoder`: the Mistral text model's config) merge into the defaults. `processor`: model_index.json names
    the tokenizer component `PixtralProcessor`, as FLUX.2-dev's does (stock diffusers cannot load that here)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    text = {**MISTRAL_TEXT, **text_encoder}
    tcfg, vcfg = flux2_configs(transformer, vae, text["hidden_size"])
    tokenizer = save_mistral_tokenizer(out / "tokenizer")
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    config = Mistral3Config(
        text_config={"model_type": "mistral", **text, **ids, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "pixtral", **PIXTRAL_VISION, "image_size": 64, "patch_size": 16},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    save_flux2_pipeline(
        "Flux2Pipeline",
        out,
        seed,
        tcfg,
        vcfg,
        text_encoder=lambda: Mistral3ForConditionalGeneration(config).eval(),
        tokenizer=None,  # a PixtralProcessor: written above, as the checkpoint ships it
    )
    return update_model_index(
        out, tokenizer=["transformers", "PixtralProcessor" if processor else "PreTrainedTokenizerFast"]
    )


def build_tiny_klein(out: str | Path, seed: int = 0, distilled: bool = False, **overrides: Overrides) -> Path:
    """Write a tiny random FLUX.2 [klein] pipeline (`Flux2KleinPipeline`) to `out`: the base model (classifier-free
    guidance on an empty negative prompt) or, `distilled`, the step-distilled one (no guidance); overrides as
    `build_tiny`'s (`text_encoder`: the Qwen3 config)."""
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, save_llm_tokenizer

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    text = {**QWEN3_TEXT, **text_encoder}
    tcfg, vcfg = flux2_configs({"guidance_embeds": False, **transformer}, vae, text["hidden_size"])
    save_llm_tokenizer(out / "tokenizer", QWEN3_TOKENIZER)
    tokenizer = Qwen2TokenizerFast.from_pretrained(out / "tokenizer")
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Qwen3Config(**text, **ids)
    return save_flux2_pipeline(
        "Flux2KleinPipeline",
        out,
        seed,
        tcfg,
        vcfg,
        text_encoder=lambda: Qwen3ForCausalLM(config).eval(),
        tokenizer=tokenizer,
        is_distilled=distilled,
    )
