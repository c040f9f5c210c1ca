"""Ulysses sequence parallelism (SP) for transformers LLMs, through transformers' own `AttentionInterface`.

Each rank of an SP group holds a contiguous chunk of every row of the batch (`shard_batch`): its
slice of `input_ids`, of the *global* `position_ids` (computed before the split, so RoPE sees the
true positions) and of the pre-shifted labels. Everything in a decoder layer but attention is
per-token, so it runs on the local chunk unchanged. Attention is the one place tokens meet: the
function registered here (`ATTN_IMPLEMENTATION`) is called by the model's attention module with
`[B, H, S/sp, D]` query/key/value, and

    all-to-all: [B, H, S/sp, D] -> [B, H/sp, S, D]   (every rank: the whole sequence, H/sp heads)
    inner attention over the full sequence (Spindle's varlen functions, transformers' sdpa or flex_attention)
    all-to-all back: [B, S, H/sp, D] -> [B, S/sp, H, D]

Layers with a sliding window (Gemma 3, GPT-OSS) or a learned sink logit per head (GPT-OSS), and every layer of
a model trained with eager attention, run spindle.ops.windowed_attention as the inner attention instead: the
window and the documents over the full sequence, in query blocks (no [S, S] mask), with this rank's slice of
the sinks (the heads it holds after the all-to-all). So does every layer of a forward given bidirectional blocks
(`BLOCKS_KWARG`: the full row's span ids, spindle.ops.windowed_attention.block_ids, e.g. Gemma 3's image soft
tokens from its token_type_ids): the model's own mask would OR them with the causal one, but a model under Ulysses
builds none, so the caller passes the whole row's ids with the forward (transformers hands a model's extra keyword
arguments down to each attention call) and the kernel attends causal OR same block, windowed per layer. Gated
DeltaNet linear-attention layers split their heads the same way (spindle/distributed/ulysses_linear_attention.py,
reached through the family's patched modeling).

The all-to-all is an autograd function whose backward is the same all-to-all (with equal splits
the exchange is its own transpose), so gradients flow back to the rank that owns each token.

GQA: the all-to-all splits the key/value heads over the SP ranks too. With fewer KV heads than
`sp` (or a count `sp` does not divide), the KV heads are repeated first, to the least count that
`sp` divides, so each rank gets whole heads that match its query heads (`kv_repeat`).

Masks: transformers builds its mask from the *local* chunk, which is wrong under SP (a chunk's
queries must see the keys of the chunks before it, and packed documents must not see each other
across chunk borders). Our implementation name is absent from transformers' mask registry, so the
model passes no mask (`masking_utils._preprocess_mask_arguments` returns None for such names), and
the documents come from the position ids of the FULL row: the local `position_ids` (which the
decoder layer passes to attention) are all-gathered over the SP group once per forward (cached on
the tensor's identity, so every layer and an activation-checkpoint recomputation reuse it), and a
new document starts wherever the position does not follow its predecessor (the rule of
transformers' `find_packed_sequence_indices`). The varlen inner functions (spindle.ops.varlen_attention)
get the full row's position ids and attend per document, no mask (memory linear in S); for sdpa the
dense [B, 1, S, S] mask is built here, for flex_attention a block mask; the windowed kernel gets the
document ids. A row with one document is plain causal attention.
Padding masks are not used: rows are padded on the right, and under causal attention the pad
tokens (labels -100) never affect a real token.

Loss and gradient scaling: each SP rank's loss covers its own chunk (`loss_sharded_over_sp`), so
the SP ranks' gradients *sum* to the row's gradient; FSDP's divide factor is the data-parallel
size (`spindle.distributed.fsdp`). Both are checked against one process in
tests/distributed/test_ulysses_attention.py.

transformers is imported lazily (the trainer and `spindle.distributed` never import it at module
import time).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spindle.ops import varlen_attention
from spindle.ops.varlen_attention import document_ids
from spindle.ops.windowed_attention import windowed_attention

ATTN_IMPLEMENTATION = "spindle_ulysses"
VARLEN_INNER = tuple(varlen_attention.IMPLEMENTATIONS.values())
MASKED_INNER = ("sdpa", "flex_attention")  # inner functions that take a document mask built here
# eager: transformers' eager attention (GPT-OSS's, with its sinks) is computed by spindle.ops.windowed_attention
INNER_IMPLEMENTATIONS = (*MASKED_INNER, "eager", *VARLEN_INNER)
# Per-token tensors of a causal-LM batch, split along dim 1 (the sequence) by `shard_batch`.
SEQUENCE_KEYS = ("input_ids", "position_ids", "shift_labels", "attention_mask")
_CONTEXT_ATTR = "_spindle_sequence_parallel"
# The forward keyword argument carrying the FULL rows' [B, S] bidirectional block ids (-1 outside a block)
BLOCKS_KWARG = "bidirectional_blocks"


# ---------------------------------------------------------------- layout checks


def kv_repeat(
    num_heads: int, num_kv_heads: int, sp: int, keys: tuple[str, str] = ("num_attention_heads", "num_key_value_heads")
) -> int:
    """How many times each KV head is repeated so that `sp` ranks each get whole, matching heads.

    The least r with (num_kv_heads * r) divisible by sp and dividing num_heads (GQA grouping kept:
    query head h still reads KV head h // (num_heads / num_kv_heads)). ValueError when none exists, naming
    `keys` (the config keys of the two counts; a Gated DeltaNet layer's are its value and key heads).
    """
    r = sp // math.gcd(num_kv_heads, sp)
    if num_heads % (num_kv_heads * r):
        raise ValueError(
            f"sequence parallel cannot split {num_kv_heads} key/value heads ({keys[1]}) over parallel.sp={sp} "
            f"with {num_heads} query heads ({keys[0]}): repeating each KV head {r}x would give "
            f"{num_kv_heads * r} KV heads, which do not divide the query heads (the KV heads must divide the query "
            f"heads; check the config, or set parallel.sp to a divisor of {num_kv_heads})"
        )
    return r


def _check_heads(heads: Any, kv_heads: Any, sp: int, keys: tuple[str, str]) -> None:
    if not isinstance(heads, int):
        raise ValueError(f"the model config has no integer {keys[0]}; cannot run parallel.sp={sp}")
    if heads % sp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"the model has {heads} attention heads ({keys[0]}), not divisible by parallel.sp={sp}: Ulysses "
            f"SP gives each SP rank heads/sp heads; set parallel.sp to a divisor of {heads} ({divisors})"
        )
    kv_repeat(heads, kv_heads, sp, keys)


# the decoder layer kinds (config `layer_types`) Ulysses SP runs: softmax attention, windowed or not (sinks
# included), and Gated DeltaNet linear attention (spindle/distributed/ulysses_linear_attention.py)
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
LINEAR_HEADS = ("linear_num_value_heads", "linear_num_key_heads")


def check_layout(config: Any, sp: int, seq_len: int | None = None) -> None:
    """Fail fast (ValueError naming the key) if `sp`-way Ulysses SP cannot run this transformers config.

    `config`: a transformers config object or its `config.json` dict. `seq_len`: the row length
    (`data.seq_len`) when known. No-op for sp == 1.
    """
    if sp < 1:
        raise ValueError(f"parallel.sp must be >= 1, got {sp}")
    if sp == 1:
        return
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    heads = get("num_attention_heads")
    _check_heads(heads, get("num_key_value_heads") or heads, sp, ("num_attention_heads", "num_key_value_heads"))
    layer_types = tuple(get("layer_types") or ())
    if unknown := sorted(set(layer_types) - set(LAYER_TYPES)):
        raise ValueError(
            f"parallel.sp={sp}: Spindle's Ulysses SP runs layers of the types {LAYER_TYPES}, but the model has "
            f"{unknown} layers (layer_types); set parallel.sp: 1"
        )
    if "linear_attention" in layer_types:
        v_heads = get(LINEAR_HEADS[0])
        _check_heads(v_heads, get(LINEAR_HEADS[1]) or v_heads, sp, LINEAR_HEADS)
    if seq_len is not None and seq_len % sp:
        raise ValueError(
            f"data.seq_len={seq_len} is not divisible by parallel.sp={sp}: each SP rank holds an equal, contiguous "
            f"chunk of every row; set data.seq_len to a multiple of {sp}"
        )


# ---------------------------------------------------------------- batch split


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp: int) -> dict[str, Any]:
    """This SP rank's contiguous chunk of every per-token tensor of a causal-LM batch.

    Splits `SEQUENCE_KEYS` along dim 1; other entries pass through. `position_ids` are created
    (0..S-1 per row) when absent, *before* the split, so each rank gets global positions. Unshifted
    `labels` are turned into `shift_labels` (label of the next token, -100 at the row's end) before
    the split too: after it, a chunk's last token's target lives on the next rank. ValueError naming
    seq_len when the row length does not divide `sp`.
    """
    if sp == 1:
        return dict(batch)
    if "input_ids" not in batch:
        raise ValueError("shard_batch: the batch has no 'input_ids' (the causal-LM batch keys are input_ids, ...)")
    out = dict(batch)
    input_ids = out["input_ids"]
    rows, seq_len = input_ids.shape[:2]
    if seq_len % sp:
        raise ValueError(
            f"the batch's rows have seq_len={seq_len} tokens, not divisible by parallel.sp={sp}: each SP rank holds an "
            f"equal, contiguous chunk; set data.seq_len to a multiple of {sp}"
        )
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand(rows, seq_len)
    if out.get("labels") is not None:
        if out.get("shift_labels") is None:
            labels = out["labels"]
            out["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        del out["labels"]
    chunk = seq_len // sp
    for key in SEQUENCE_KEYS:
        value = out.get(key)
        if isinstance(value, torch.Tensor):
            if value.ndim < 2 or value.shape[1] != seq_len:
                raise ValueError(
                    f"shard_batch: '{key}' has shape {tuple(value.shape)}; expected [rows, seq_len={seq_len}, ...]"
                )
            # contiguous: transformers' loss `.view`s the labels
            out[key] = value[:, sp_rank * chunk : (sp_rank + 1) * chunk].contiguous()
    return out


# ---------------------------------------------------------------- all-to-all


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (chunk j goes to rank j); its backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(x, group)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """[B, H, S/sp, D] (this rank's tokens, all heads) -> [B, H/sp, S, D] (all tokens, this rank's heads)."""
    b, h, s, d = x.shape
    x = x.reshape(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4)  # [sp (dest rank), B, H/sp, S/sp, D]
    x = _all_to_all(x, group)  # [sp (source rank = sequence chunk), B, H/sp, S/sp, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """[B, S, H/sp, D] (attention output layout) -> [B, S/sp, H, D]: back to this rank's tokens, all heads."""
    b, s, h, d = x.shape
    x = x.reshape(b, sp, s // sp, h, d).permute(1, 0, 2, 3, 4)  # [sp (dest rank = chunk), B, S/sp, H/sp, D]
    x = _all_to_all(x, group)  # [sp (source rank = head group), B, S/sp, H/sp, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)


# ---------------------------------------------------------------- masks


def document_causal_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] boolean mask (True = attend): causal and within the query's document."""
    s = docs.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=docs.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def _flex_block_mask(docs: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    b, s = docs.shape
    return create_block_mask(mask_mod, b, None, s, s, device=docs.device)


# ---------------------------------------------------------------- the attention function


@dataclass
class SequenceParallelContext:
    """What the attention function needs, attached to the model's modules by `enable_sequence_parallel`."""

    group: dist.ProcessGroup
    size: int
    rank: int  # this rank's index in the group: it holds sequence chunk `rank`, then heads chunk `rank`
    inner: str  # the attention implementation run over the full sequence (INNER_IMPLEMENTATIONS)
    _key: torch.Tensor | None = field(default=None, repr=False)
    _positions: Any = field(default=None, repr=False)
    _mask: Any = field(default=None, repr=False)
    _docs: torch.Tensor | None = field(default=None, repr=False)

    def for_forward(self, position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, Any]:
        """(the full rows' [B, S] position ids, the mask the inner attention takes: None for the varlen
        functions and for rows of one document) of this forward. Collective on a cache miss."""
        if self._key is not position_ids:
            local = position_ids.expand(batch, -1).contiguous()
            chunks = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(chunks, local, group=self.group)
            full = torch.cat(chunks, dim=1)
            # the windowed kernel (layers with a window or sinks) reads the documents; the masked inner functions
            # take them as a mask
            docs = document_ids(full)
            if docs is None or self.inner not in MASKED_INNER:
                mask = None
            elif self.inner == "flex_attention":
                mask = _flex_block_mask(docs)
            else:
                mask = document_causal_mask(docs)
            # Holding the key tensor keeps its identity from being reused by another forward's tensor.
            self._key, self._positions, self._mask, self._docs = position_ids, full, mask, docs
        return self._positions, self._mask

    def documents(self) -> torch.Tensor | None:
        """The [B, S] document index of the full rows of this forward (None: one document a row), for the windowed
        kernel; `for_forward` computes it."""
        return self._docs


def sequence_parallel_context(module: torch.nn.Module) -> SequenceParallelContext | None:
    """The context `enable_sequence_parallel` attached to a module of the model; None without Ulysses SP."""
    ctx: SequenceParallelContext | None = getattr(module, _CONTEXT_ATTR, None)
    return ctx


class LocalHeads:
    """The attention module as the inner attention function must see it on this rank: same attributes but
    `overrides` (the KV grouping of the heads this rank holds after the all-to-all; the vision tower's own config)."""

    def __init__(self, module: torch.nn.Module, **overrides: Any):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: `[B, H, S/sp, D]` inputs -> `[B, S/sp, H, D]` output, attention
    computed over the whole sequence of the SP group (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ctx = sequence_parallel_context(module)
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTN_IMPLEMENTATION!r} but sequence parallel was not "
            f"enabled on its model; call spindle.distributed.ulysses_attention.enable_sequence_parallel(model, sp_mesh)"
        )
    if attention_mask is not None:
        raise ValueError(
            "Spindle's Ulysses attention builds its own mask from the full row's position_ids; the model was given an "
            "explicit attention mask (pass position_ids, and no attention_mask, under parallel.sp > 1)"
        )
    sinks: torch.Tensor | None = getattr(module, "sinks", None)
    window: int | None = kwargs.pop("sliding_window", None)
    kwargs.pop("s_aux", None)  # GPT-OSS passes its sinks again under this name (the hub kernels' argument)
    blocks: torch.Tensor | None = kwargs.pop(BLOCKS_KWARG, None)
    position_ids = kwargs.pop("position_ids", None)
    if position_ids is None:
        raise ValueError(
            "Spindle's Ulysses attention needs the global position_ids of this rank's chunk (computed before the "
            "sequence split, see shard_batch); the model was called without position_ids"
        )
    # spindle.ops.windowed_attention
    windowed = sinks is not None or window is not None or blocks is not None or ctx.inner == "eager"
    if windowed and not getattr(module, "is_causal", True):
        raise ValueError(
            f"Spindle's Ulysses attention computes causal attention; {type(module).__name__} is bidirectional "
            "(use_bidirectional_attention); set parallel.sp: 1"
        )
    sp, group = ctx.size, ctx.group
    heads, kv_heads = query.shape[1], key.shape[1]
    repeat = kv_repeat(heads, kv_heads, sp)
    if repeat > 1:
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    full_positions, mask = ctx.for_forward(position_ids, query.shape[0])
    if ctx.inner in VARLEN_INNER:  # the varlen functions read the documents from the full row's positions
        kwargs["position_ids"] = full_positions

    query, key, value = (seq_to_heads(t, group, sp) for t in (query, key, value))
    if windowed:
        # this rank holds heads [rank * H/sp, (rank + 1) * H/sp) (seq_to_heads): their sinks, their window
        local_heads = query.shape[1]
        if sinks is not None:
            sinks = sinks[ctx.rank * local_heads : (ctx.rank + 1) * local_heads]
        out = windowed_attention(
            query,
            key,
            value,
            documents=ctx.documents(),
            window=window,
            sinks=sinks,
            blocks=blocks,
            scaling=scaling,
            dropout=dropout,
        )
        return heads_to_seq(out, group, sp), None
    local = LocalHeads(module, num_key_value_groups=query.shape[1] // key.shape[1])
    inner = ALL_ATTENTION_FUNCTIONS[ctx.inner]
    out, _ = inner(local, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return heads_to_seq(out, group, sp), None


# ---------------------------------------------------------------- enabling


def register() -> None:
    """Register `ulysses_attention_forward` under `ATTN_IMPLEMENTATION`, and the varlen inner functions
    (idempotent)."""
    from transformers import AttentionInterface

    varlen_attention.register()
    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)


@contextmanager
def sequence_parallel_paused(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model computes whole sequences on each rank (its inner attention, no all-to-all): what
    generation needs, whose prompts and KV caches are not split over the SP ranks (GRPO's rollouts: every SP rank
    samples the same completions). A no-op for a model without sequence parallelism."""
    ctx: SequenceParallelContext | None = getattr(model, _CONTEXT_ATTR, None)
    if ctx is None:
        yield
        return
    hf_model: Any = model
    hf_model.set_attn_implementation(ctx.inner)
    try:
        yield
    finally:
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)


def enable_sequence_parallel(model: torch.nn.Module, sp_mesh: DeviceMesh, inner: str | None = None) -> torch.nn.Module:
    """Switch a transformers causal LM to Ulysses SP over `sp_mesh` (1-D; degree = its size), in place.

    Call on every rank before FSDP. `inner`: the attention run over the full sequence; default the
    model's current implementation when it is one of `INNER_IMPLEMENTATIONS`, else sdpa. Feed every
    rank its `shard_batch` chunk of the same rows. A no-op when the SP size is 1.
    """
    sp = sp_mesh.size()
    if sp == 1:
        return model
    if sp_mesh.ndim != 1:
        raise ValueError(f"the sequence-parallel mesh must be 1-D, got {sp_mesh.ndim}-D {sp_mesh.mesh_dim_names}")
    hf_model: Any = model  # a transformers PreTrainedModel (config, set_attn_implementation)
    config = hf_model.config
    check_layout(config, sp)
    current = config._attn_implementation
    if inner is None:
        inner = current if current in INNER_IMPLEMENTATIONS else "sdpa"
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"the inner attention of sequence parallel must be one of {INNER_IMPLEMENTATIONS}, got {inner!r}"
        )
    register()
    ctx = SequenceParallelContext(group=sp_mesh.get_group(), size=sp, rank=sp_mesh.get_local_rank(), inner=inner)
    for module in model.modules():
        setattr(module, _CONTEXT_ATTR, ctx)
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
