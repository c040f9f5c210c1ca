"""Sequence parallelism inside a VLM's vision tower (Qwen2.5-VL, Qwen3-VL), with module hooks and
transformers' `AttentionInterface`: no patch.

Under `parallel.sp` every rank of an SP group holds the same sample, so without this each runs the whole
vision tower. Here the patch sequence (after the tower's own preparation: patch embedding, position
embeddings, Qwen2.5-VL's window reordering) is padded to a multiple of sp and each rank keeps one chunk
through the blocks: norms, MLPs and the attention's qkv and output projections run on the chunk. Attention
needs every patch of an image; two ways to give it them (`attention=`):

- "ulysses" (the default): a pre-hook on each block's attention cuts the rotary tables to the rank's chunk,
  so the module projects and rotates only its chunk's queries, keys and values; the attention function
  registered here (`VISION_ATTN_IMPLEMENTATION`, set on the attention modules' own copy of the config) gets
  them as [1, heads, chunk, head_dim] with the whole sequence's `cu_seqlens` (windows or full-attention
  layers, images), and

      all-to-all (spindle/distributed/ulysses_attention.py): [heads, chunk] -> [heads/sp, whole sequence]
      padding rows dropped; the tower's own kernel (its `_attn_implementation`: sdpa / eager per segment of
      cu_seqlens, flash-attention varlen over all) on this rank's heads
      padding rows back; all-to-all: [heads/sp, whole sequence] -> [heads, chunk]

  before the module's output projection. Every part of a block then runs on 1/sp of the work.
- "gather" (the fallback when the tower's heads are not divisible by sp, logged in one line; kept for the
  bench): a pre-hook on each block's attention all-gathers the normed chunks (the padding dropped), the
  attention runs unchanged on the whole sequence, and a hook keeps this rank's chunk of its output. The
  attention's projections and kernel run on every patch on every rank.

Before the merger (and each Qwen3-VL deepstack merger) the chunks are all-gathered, so the merged vision
embeddings are whole on every rank, as the language model's hook expects (spindle/train/tasks/vlm.py).

Gradients: the gather's backward sums the gradient over the SP group and keeps this rank's chunk (each
rank back-propagates only through its own language-model chunk), and the all-to-all's backward is the
reverse exchange, so every rank's vision parameters get the gradient of its own patches: the SP ranks'
gradients sum to the sample's, as FSDP's divide factor (the data-parallel size) expects
(spindle/distributed/fsdp.py). Equal to one process: tests/distributed/test_vision_sequence_parallel.py
(both paths, a sequence sp does not divide) and tests/conformance/test_vlm_conformance.py (sp2 training).
Measured: bench/vision_sp.py, docs/training.md.

transformers is imported lazily (spindle.distributed never imports it at module import time).
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from spindle.distributed.ulysses_attention import LocalHeads, heads_to_seq, seq_to_heads

log = logging.getLogger("spindle.train")

# "flash" in the name: transformers' Qwen-VL vision attention hands `cu_seqlens` to the attention function only
# when `is_flash_attention_requested(config)` (a substring test); otherwise it splits q/k/v by cu_seqlens itself,
# which a chunk of the sequence cannot be.
VISION_ATTN_IMPLEMENTATION = "spindle_vision_ulysses_flash"
_STATE_ATTR = "_spindle_vision_sequence_parallel"
VisionAttention = Literal["ulysses", "gather"]


class _GatherChunks(torch.autograd.Function):
    """All-gather equal chunks along dim 0; backward: the gradient summed over the group, this rank's chunk."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, rank, chunk.shape[0]
        parts = [torch.empty_like(chunk) for _ in range(size)]
        dist.all_gather(parts, chunk.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None, None


class VisionSequenceParallel:
    """The hooks' shared state: this rank's place in the SP group and the current image sequence's length."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, attention: VisionAttention = "gather"):
        self.group, self.rank, self.size, self.attention = group, rank, size, attention
        self.length = 0  # patches of the current tower forward (set by the first block's hook)
        self.inner: Any = None  # ulysses: the tower's own attention function (set by enable_...)
        self.config: Any = None  # ulysses: the tower's own config, as its kernel must see it
        self._rotary_key: Any = None
        self._rotary: Any = None

    @property
    def chunk(self) -> int:
        return -(-self.length // self.size)

    def split(self, full: torch.Tensor) -> torch.Tensor:
        """[length, ...] -> this rank's chunk of it padded to `chunk * size` rows."""
        pad = self.chunk * self.size - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
        return full[self.rank * self.chunk : (self.rank + 1) * self.chunk]

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk -> the whole [length, ...] sequence (differentiable)."""
        full: torch.Tensor = _GatherChunks.apply(  # type: ignore[no-untyped-call]  # torch: apply is unannotated
            chunk, self.group, self.rank, self.size
        )
        return full[: self.length]

    # ------------------------------------------------------------ hooks

    def first_block(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.length = hidden.shape[0]
        return (self.split(hidden), *args[1:]), kwargs

    def before_attention(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return (self.gather(hidden), *args[1:]), kwargs

    def after_attention(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return self.split(output)

    def before_merger(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.gather(args[0]), *args[1:])

    def rotary_chunk(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Ulysses: the attention's rotary tables (cos, sin; per patch) cut to this rank's chunk, as its input.
        Cached on the tables' identity: every block of one tower forward gets the same ones."""
        tables = kwargs["position_embeddings"]
        if self._rotary_key is not tables:
            # holding the key keeps its identity from being reused by another forward's tables
            self._rotary_key, self._rotary = tables, tuple(self.split(t) for t in tables)
        kwargs["position_embeddings"] = self._rotary
        return args, kwargs

    # ------------------------------------------------------------ the attention function

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """[1, heads, chunk, head_dim] q/k/v of this rank's patches -> [1, chunk, heads, head_dim], attention over
        the whole sequence's `cu_seqlens` segments (the tower's kernel on heads/sp heads)."""
        from transformers.utils.generic import is_flash_attention_requested

        sp, length = self.size, self.length
        qkv = seq_to_heads(torch.cat([query, key, value]), self.group, sp)[:, :, :length]  # one exchange for 3
        query, key, value = qkv.split(1)
        local = LocalHeads(module, config=self.config)
        if is_flash_attention_requested(self.config):  # the varlen kernel takes the segments itself
            out, _ = self.inner(
                local,
                query,
                key,
                value,
                None,
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=max_seqlen,
                max_length_k=max_seqlen,
                is_causal=False,
                **kwargs,
            )
        else:  # as the module does for these kernels: one call per window / image
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            segments = zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
            out = torch.cat([self.inner(local, q, k, v, None, is_causal=False, **kwargs)[0] for q, k, v in segments], 1)
        pad = self.chunk * sp - length  # [1, length, heads/sp, head_dim] -> padded rows back for the exchange
        if pad:
            out = torch.cat([out, out.new_zeros(1, pad, *out.shape[2:])], dim=1)
        return heads_to_seq(out, self.group, sp)


def vision_ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (`VISION_ATTN_IMPLEMENTATION`): the vision attention module's varlen call
    with this rank's chunk of q/k/v, answered by `VisionSequenceParallel.attend`."""
    state: VisionSequenceParallel | None = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={VISION_ATTN_IMPLEMENTATION!r} but vision sequence "
            f"parallel was not enabled on it; call enable_vision_sequence_parallel(tower, group, rank, size)"
        )
    cu_seqlens = kwargs.pop("cu_seq_lens_q")
    max_seqlen = kwargs.pop("max_length_q", None)
    for name in ("cu_seq_lens_k", "max_length_k", "is_causal"):  # the same segments both sides; never causal
        kwargs.pop(name, None)
    return state.attend(module, query, key, value, cu_seqlens, max_seqlen, **kwargs), None


def _use_ulysses(state: VisionSequenceParallel, attentions: list[nn.Module]) -> None:
    """Point the attention modules at `vision_ulysses_attention` through a copy of their config (the tower's own
    config, shared with the model's, keeps its implementation); their kernel is the tower's own."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(VISION_ATTN_IMPLEMENTATION, vision_ulysses_attention)
    first = attentions[0]
    state.config = first.config
    eager = sys.modules[type(first).__module__].eager_attention_forward  # the module's own default
    state.inner = ALL_ATTENTION_FUNCTIONS.get_interface(state.config._attn_implementation, eager)
    config = copy.copy(state.config)
    config._attn_implementation = VISION_ATTN_IMPLEMENTATION
    for attn in attentions:
        attn.config = config
        setattr(attn, _STATE_ATTR, state)
        attn.register_forward_pre_hook(state.rotary_chunk, with_kwargs=True)


def enable_vision_sequence_parallel(
    tower: nn.Module, group: dist.ProcessGroup, rank: int, size: int, attention: VisionAttention = "ulysses"
) -> VisionSequenceParallel:
    """Install the hooks on a Qwen-VL vision tower (`blocks[i].attn`, `merger`, optional
    `deepstack_merger_list`); -> their state. Before FSDP wrapping (hooks sit on the modules themselves).
    `attention`: "ulysses" (heads split over the ranks; "gather" when sp does not divide the heads, logged)
    or "gather" (module docstring)."""
    blocks: Any = tower.blocks
    attentions: list[nn.Module] = [block.attn for block in blocks]
    heads = int(attentions[0].num_heads)  # type: ignore[arg-type]  # transformers: an int attribute
    if attention == "ulysses" and heads % size:
        log.warning(
            "vision tower: %d attention heads are not divisible by parallel.sp=%d, so each block's attention "
            "all-gathers the patch sequence on every rank (the heads cannot be split evenly)",
            heads,
            size,
        )
        attention = "gather"
    state = VisionSequenceParallel(group, rank, size, attention)
    blocks[0].register_forward_pre_hook(state.first_block, with_kwargs=True)
    if attention == "ulysses":
        _use_ulysses(state, attentions)
    else:
        for attn in attentions:
            attn.register_forward_pre_hook(state.before_attention, with_kwargs=True)
            attn.register_forward_hook(state.after_attention)
    mergers: list[nn.Module] = [tower.merger, *getattr(tower, "deepstack_merger_list", [])]  # type: ignore[list-item]
    for merger in mergers:
        merger.register_forward_pre_hook(state.before_merger)
    return state
