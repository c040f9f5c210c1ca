"""Parts of the tiny random checkpoints every family builds (`spindle tiny-model`): seeded construction
and latent statistics. No weights can be downloaded here, so tests, the demo and the benchmarks build
their checkpoints locally, in the exact standard layouts, and the real loading code runs on them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spindle.model_index import model_index_path, read_model_index

# a component's config overrides of a tiny builder (`transformer={"num_layers": 4}`), merged into its defaults
Overrides = dict[str, Any] | None


def component_overrides(overrides: dict[str, Overrides], *components: str) -> list[dict[str, Any]]:
    """A tiny builder's `**overrides` -> each of its `components`' config overrides, in that order ({} where
    none); a component the checkpoint has not is refused, naming those it has."""
    unknown = sorted(set(overrides) - set(components))
    if unknown:
        raise TypeError(f"no component {', '.join(unknown)} to override; this checkpoint has {', '.join(components)}")
    return [overrides.get(name) or {} for name in components]


def dynamic_shift_scheduler(**fields: Any) -> dict[str, Any]:
    """A FlowMatchEulerDiscreteScheduler config with resolution-dependent ("dynamic") shift, from 0.5 at 256
    image tokens to `max_shift` at `max_image_seq_len` (FLUX.1's and Qwen-Image's; `fields`: the family's)."""
    return dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256) | fields


def random_latent_stats(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Non-trivial per-channel latent mean/std so that normalization bugs show up in tests."""
    g = torch.Generator().manual_seed(seed + 7)
    mean = (torch.rand(z_dim, generator=g) - 0.5).tolist()
    std = (0.5 + 1.5 * torch.rand(z_dim, generator=g)).tolist()
    return [round(x, 4) for x in mean], [round(x, 4) for x in std]


def t5_text_parts(tokenizer_dir: Path, config_cls: Any, fields: dict[str, Any]) -> tuple[Any, Any]:
    """A T5-style text encoder's tokenizer (`$A </s>`, pad 0, eos 1: spindle.models.shared.tokenizers) saved to
    `tokenizer_dir` and loaded back, and its `config_cls` (T5Config, UMT5Config) config over that vocabulary."""
    from transformers import PreTrainedTokenizerFast

    from spindle.models.shared.tokenizers import save_tokenizer

    vocab_size = save_tokenizer(tokenizer_dir)
    config = config_cls(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **fields)
    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir), config


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    torch.manual_seed(seed)
    return build()


def save_seeded_pipeline(
    pipeline_cls: Any,
    out: str | Path,
    seed: int,
    *,
    text_encoder: Callable[[], Any],
    vae: Callable[[], Any],
    transformer: Callable[[], Any],
    **parts: Any,
) -> Path:
    """`pipeline_cls(**parts, text_encoder=..., vae=..., transformer=...)` saved to `out` (safetensors), its
    models built seeded with seed, seed + 1 and seed + 2 (each on its own, so `--seed` reproduces a
    checkpoint); a family's further models (a second text encoder) come built in `parts`."""
    pipe = pipeline_cls(
        **parts,
        text_encoder=seeded(seed, text_encoder),
        vae=seeded(seed + 1, vae),
        transformer=seeded(seed + 2, transformer),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return Path(out)


def update_model_index(root: Path, **entries: Any) -> Path:
    """Set `entries` in the pipeline folder's model_index.json (what the stock `save_pretrained` does not
    record as real checkpoints have it); -> `root`."""
    index = read_model_index(root)
    index.update(entries)
    model_index_path(root).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return root
