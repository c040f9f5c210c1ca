"""Sequence parallelism inside a VLM's vision tower (Qwen2.5-VL, Qwen3-VL), with module hooks: no patch.

Under `parallel.sp` every rank of an SP group holds the same sample, so without this each runs the whole
vision tower. Here the patch sequence (after the tower's own preparation: patch embedding, position
embeddings, Qwen2.5-VL's window reordering) is padded to a multiple of sp and each rank keeps one chunk
through the blocks: norms and MLPs (about two thirds of a block's FLOPs) run on the chunk. Attention needs
every patch of an image: a pre-hook on each block's attention all-gathers the normed chunks (the padding
dropped), the attention runs unchanged on the whole sequence with the tower's own `cu_seqlens` (windows or
images) and rotary tables, and a hook keeps this rank's chunk of its output. Before the merger (and each
Qwen3-VL deepstack merger) the chunks are all-gathered again, so the merged vision embeddings are whole on
every rank, as the language model's hook expects (spindle/train/tasks/vlm.py).

Gradients: the gather's backward sums the gradient over the SP group and keeps this rank's chunk (each
rank back-propagates only through its own query chunk and its language-model chunk), so every rank's
vision parameters get the gradient of its own patches: the SP ranks' gradients sum to the sample's, as
FSDP's divide factor (the data-parallel size) expects (spindle/distributed/fsdp.py). Equal to one process:
tests/conformance/test_vlm_conformance.py (sp2).

What it leaves duplicated: the attention's projections and kernel run on the whole sequence on every rank
(a Ulysses all-to-all over heads would split them too); measured shares: docs/training.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


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

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.length = 0  # patches of the current tower forward (set by the first block's hook)

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


def enable_vision_sequence_parallel(
    tower: nn.Module, group: dist.ProcessGroup, rank: int, size: int
) -> VisionSequenceParallel:
    """Install the hooks on a Qwen-VL vision tower (`blocks[i].attn`, `merger`, optional
    `deepstack_merger_list`); -> their state. Before FSDP wrapping (hooks sit on the modules themselves)."""
    state = VisionSequenceParallel(group, rank, size)
    blocks: Any = tower.blocks
    blocks[0].register_forward_pre_hook(state.first_block, with_kwargs=True)
    for block in blocks:
        block.attn.register_forward_pre_hook(state.before_attention, with_kwargs=True)
        block.attn.register_forward_hook(state.after_attention)
    mergers: list[nn.Module] = [tower.merger, *getattr(tower, "deepstack_merger_list", [])]  # type: ignore[list-item]
    for merger in mergers:
        merger.register_forward_pre_hook(state.before_merger)
    return state
