"""Packed-document causal attention whose memory is linear in the row length: no [S, S] mask, ever.

A packed row lays documents end to end, positions restarting at 0 per document. transformers' sdpa
path turns that into a boolean `[rows, 1, S, S]` block-diagonal mask (1 GiB per row at S = 32K, then
an additive float copy inside SDPA): memory grows with S^2 while the model's activations grow with S.
Here the documents' boundaries are read from the position ids instead (`documents`: a document starts
wherever a position does not follow its predecessor, transformers' `find_packed_sequence_indices`
rule) and attention runs per document:

- `varlen` (portable: CPU and CUDA): each document's causal SDPA (transformers' own
  `sdpa_attention_forward` with `is_causal=True`, so GQA, scaling and the kernel choice are the dense
  path's), outputs concatenated. On CPU that is the flash kernel, on CUDA flash / memory-efficient:
  linear memory either way. Rows sharing one document layout run batched.
- `flash_attention_2` / `flash_attention_3` (CUDA, the `flash_attn` / `flash_attn_interface` packages):
  one varlen call over every row's documents (`cu_seqlens` of the flattened rows).

A row holding one document is plain causal attention. The functions are registered in transformers'
`AttentionInterface` (`register`) under names (`IMPLEMENTATIONS`) absent from its mask registry, so
the model builds no mask at all (`masking_utils._preprocess_mask_arguments`) and passes `position_ids`
to attention. Under Ulysses SP the wrapper (spindle/distributed/ulysses_attention.py) calls the same
function over the full sequence with the full row's position ids. Modules that are not causal (a
vision tower's blocks) or that come with their own explicit mask keep transformers' sdpa unchanged.

Padding: rows are padded on the right and padding continues the last document's positions, so it is
part of that document, as in the dense path; causal attention keeps it out of real tokens.

transformers is imported lazily (the kernels are pure torch).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

# Spindle's attention setting -> the name its function is registered under in transformers.
IMPLEMENTATIONS = {
    "varlen": "spindle_varlen",
    "flash_attention_2": "spindle_varlen_fa2",
    "flash_attention_3": "spindle_varlen_fa3",
}
# The module each flash kernel comes from (pip package: flash-attn; FA3: its hopper/ build).
FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


# ---------------------------------------------------------------- document boundaries


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a document starts after the first one of its row (the position does not
    follow its predecessor's)."""
    first = position_ids[:, :1] - 1
    return torch.diff(position_ids, prepend=first, dim=-1) != 1


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, S] document index of each token, or None when every row is one document."""
    docs = document_starts(position_ids).cumsum(-1)
    if bool((docs[:, -1] == docs[:, 0]).all()):
        return None
    return docs


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of rows: `lengths[b]` the token counts of row b's documents, in order."""

    lengths: tuple[tuple[int, ...], ...]

    @property
    def single(self) -> bool:
        """Every row is one document (plain causal attention)."""
        return all(len(row) == 1 for row in self.lengths)

    @property
    def uniform(self) -> bool:
        """Every row has the same document layout (attention runs batched over the rows)."""
        return len(set(self.lengths)) == 1

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 [documents + 1]: the documents' start offsets in the flattened rows, then the total."""
        flat = [n for row in self.lengths for n in row]
        return torch.tensor([0, *flat], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

    @property
    def max_seqlen(self) -> int:
        return max(n for row in self.lengths for n in row)


def documents(position_ids: torch.Tensor) -> Documents:
    """The document layout of [B, S] position ids (one host sync)."""
    s = position_ids.shape[1]
    out = []
    for row in document_starts(position_ids).cpu():
        begin = [0, *row.nonzero().flatten().tolist()]
        ends = [*begin[1:], s]
        out.append(tuple(e - b for b, e in zip(begin, ends, strict=True)))
    return Documents(tuple(out))


class _LayoutCache:
    """The `Documents` of the last position-id tensor seen: every layer of one forward (and an activation-
    checkpoint recomputation) passes the same tensor, so the host sync happens once per forward. Holding
    the key tensor keeps its identity from being reused by another forward's tensor."""

    def __init__(self) -> None:
        self._key: torch.Tensor | None = None
        self._value: Documents | None = None

    def get(self, position_ids: torch.Tensor, batch: int) -> Documents:
        if self._key is not position_ids or self._value is None:
            self._value = documents(position_ids.expand(batch, -1))
            self._key = position_ids
        return self._value


_LAYOUTS = _LayoutCache()


# ---------------------------------------------------------------- kernels


def _sdpa(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float | None
) -> torch.Tensor:
    """One causal SDPA call of transformers' sdpa function: [B, H, s, D] -> [B, s, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)
    result: torch.Tensor = out
    return result


def per_document_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    docs: Documents,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """[B, H, S, D] query/key/value -> [B, S, H, D]: causal attention within each document.

    `split`/`unbind` views (their backward is one concatenation, not a zero-filled copy per piece),
    one SDPA call per document, or per (row, document) when the rows' layouts differ."""
    if docs.uniform:
        sizes = list(docs.lengths[0])
        pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), strict=True)
        return torch.cat([_sdpa(module, q, k, v, dropout, scaling) for q, k, v in pieces], dim=1)
    rows = []
    for row, q_row, k_row, v_row in zip(docs.lengths, query.unbind(0), key.unbind(0), value.unbind(0), strict=True):
        sizes = list(row)
        pieces = zip(q_row.split(sizes, 1), k_row.split(sizes, 1), v_row.split(sizes, 1), strict=True)
        rows.append(torch.cat([_sdpa(module, q[None], k[None], v[None], dropout, scaling) for q, k, v in pieces], 1))
    return torch.cat(rows, dim=0)


def flash_varlen(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    docs: Documents,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H, D] by flash-attention's varlen kernel over the flattened rows' documents
    (`kernel`: flash_attention_2 or flash_attention_3; GQA native)."""
    flash = importlib.import_module(FLASH_MODULES[kernel])
    b, h, s, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    cu = docs.cu_seqlens(query.device)
    common: dict[str, Any] = {"softmax_scale": scaling, "causal": True}
    if kernel == "flash_attention_2":
        common["dropout_p"] = dropout
    elif dropout:
        raise ValueError("flash_attention_3 has no attention dropout; set attention_dropout: 0 or use varlen")
    out = flash.flash_attn_varlen_func(q, k, v, cu, cu, docs.max_seqlen, docs.max_seqlen, **common)
    if isinstance(out, tuple):  # some FA3 builds return (out, lse)
        out = out[0]
    result: torch.Tensor = out.reshape(b, s, h, d)
    return result


# ---------------------------------------------------------------- the attention function


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    kernel: str = "varlen",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [B, H, S, D] -> ([B, S, H, D], None), causal within each document
    of the rows that `position_ids` (a keyword argument, the decoder layer's) lay out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "sinks", None) is not None:
        raise ValueError(
            f"model.attn_implementation={kernel}: this layer adds a learned sink logit per head (GPT-OSS), which "
            "Spindle's varlen attention does not compute; set model.attn_implementation: auto (transformers' eager)"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"model.attn_implementation={kernel}: this layer has a sliding window, which Spindle's varlen attention "
            "does not implement; set model.attn_implementation: sdpa"
        )
    position_ids = kwargs.pop("position_ids", None)
    causal = getattr(module, "is_causal", True)
    if attention_mask is not None or position_ids is None or not causal:
        # not a packed causal row (a vision block, an explicit mask): transformers' sdpa, as before
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return out, None
    if position_ids.ndim == 3:  # multimodal RoPE [axes, B, S]: row 0 holds the text positions
        position_ids = position_ids[0]
    docs = _LAYOUTS.get(position_ids, query.shape[0])
    if kernel in FLASH_MODULES:
        return flash_varlen(kernel, query, key, value, docs, dropout, scaling), None
    if docs.single:
        return _sdpa(module, query, key, value, dropout, scaling), None
    return per_document_sdpa(module, query, key, value, docs, dropout, scaling), None


def register() -> None:
    """Register the varlen functions under `IMPLEMENTATIONS` in transformers (idempotent)."""
    from transformers import AttentionInterface

    for kernel, name in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, functools.partial(varlen_attention_forward, kernel=kernel))


def implementation_name(setting: str) -> str:
    """transformers' attn_implementation for a resolved `model.attn_implementation` (sdpa, flex_attention as
    they are; the varlen kernels by their registered names)."""
    return IMPLEMENTATIONS.get(setting, setting)


def use_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch a transformers model (a VLM's language model) to `implementation` (a name `implementation_name`
    gives), registering Spindle's functions first."""
    if implementation in IMPLEMENTATIONS.values():
        register()
    hf_model: Any = model  # a transformers PreTrainedModel
    if hf_model.config._attn_implementation != implementation:
        hf_model.set_attn_implementation(implementation)
