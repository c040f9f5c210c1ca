"""A tiny random Gemma 3 image-text model in the transformers layout (`spindle tiny-model gemma3_vl`).

The folder a gemma-3-4b-it checkpoint is, scaled down: config.json (`Gemma3Config`: a SigLIP vision tower, a
Gemma 3 text decoder with sliding-window and global layers), the weights, a byte-level tokenizer with Gemma's
special tokens (turns, <start_of_image> / <end_of_image> / <image_soft_token>, named in tokenizer_config's
`extra_special_tokens` as Gemma3Processor reads them) and Gemma 3's chat template, preprocessor_config.json
(Gemma3ImageProcessor: a fixed-size resize, 0.5 mean/std, no pan-and-scan) and processor_config.json
(`image_seq_length`: the soft tokens per image).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spindle.models.gemma3.tiny import TINY_DEFAULTS as TEXT_LAYOUT
from spindle.models.shared.tiny_llm import LlmTokenizerSpec, save_llm_tokenizer

# gemma-3-4b-it's chat template: as the text model's (tokenizer(text) prepends <bos> through the template's
# bos_token, the assistant is "model", a system message folds into the first user turn, roles alternate), with
# content parts: an image part renders <start_of_image>, which the processor expands to the image's soft tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# The roles Gemma3Processor reads from the tokenizer (tokenizer_config's `extra_special_tokens`).
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TOKENIZER = LlmTokenizerSpec(
    special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *IMAGE_TOKENS.values()],
    bos_token="<bos>",
    eos_token="<eos>",
    pad_token="<pad>",
    stop_tokens=["<eos>", "<end_of_turn>"],
    chat_template=CHAT_TEMPLATE,
)
# The text decoder: the tiny text family's layout (alternating local and global layers, a window shorter than a
# conversation) at the tiny VLMs' width.
TINY_TEXT = dict(
    TEXT_LAYOUT,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    max_position_embeddings=1024,
)
# SigLIP at 32x32 pixels in 8-pixel patches (4x4), average-pooled 2x2 to 4 soft tokens an image (the real
# models: 896 pixels, 14-pixel patches, 64x64 pooled to 256 tokens).
TINY_VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    vision_use_head=False,
)
MM_TOKENS_PER_IMAGE = 4


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    """`transformer`: overrides merged last, top level or under "text_config" / "vision_config"."""
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForConditionalGeneration, GenerationConfig

    out = Path(out)
    save_llm_tokenizer(out, TOKENIZER)
    config_path = out / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "extra_special_tokens": IMAGE_TOKENS}))
    tokenizer = AutoTokenizer.from_pretrained(out)
    over = dict(transformer or {})
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    text = {**TINY_TEXT, **ids, **over.pop("text_config", {})}
    vision = {**TINY_VISION, **over.pop("vision_config", {})}
    config = AutoConfig.for_model(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["eoi_token"]),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["image_token"]),
        **over,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    # transformers initialises the projection to zeros (every image the same soft tokens, whatever its pixels):
    # random, of unit scale, so the tiny model sees its images and tests of the vision side can fail
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    torch.nn.init.normal_(projection, std=projection.shape[0] ** -0.5)
    # generation stops at the end of a turn or of the text, as the instruct checkpoints' generation config says
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(TOKENIZER.stop_tokens),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = int(config.vision_config.image_size)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma3ImageProcessor",
                "processor_class": "Gemma3Processor",
                "do_resize": True,
                "size": {"height": size, "width": size},
                "resample": 2,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": None,
                "do_pan_and_scan": None,
            },
            indent=2,
        )
    )
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": config.mm_tokens_per_image}, indent=2)
    )
    return out
