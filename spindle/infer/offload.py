"""Inference offload: weights kept in host memory and streamed to the device when a module runs.

`ModuleOffload(units, device)` registers forward hooks on each unit (a transformer block, a whole
text encoder): before a unit runs its weights are copied host -> device, after it has run the device
copy is dropped (inference weights never change, so nothing is copied back). With several units the
next one is prefetched while the current one computes, cyclically (the last block prefetches the
first for the next denoising step), on a side CUDA stream from pinned memory, as musubi-tuner's
`blocks_to_swap` and SGLang's layerwise offload do. At most two units are resident at a time.

- `blocks_to_swap: N` (EngineConfig): the last N transformer blocks are streamed, the others and
  the non-block weights (embeddings, norms, output projection) stay on the device.
- `text_encoder_offload`: each text encoder lives on the host and visits the device for its forward.
- `expert_offload`: a two-expert model's experts (Wan2.2 A14B) live on the host; the one that denoises
  the current steps is on the device until the other one starts (`sticky` units: one resident at a time).

The arithmetic is untouched (the same kernels read the same values), so outputs equal the
non-offloaded run exactly. On a CPU-only machine host and device are the same memory: the units
are still copied in and dropped (a fresh tensor per onload, the loaded weights serve as the host
copies), which exercises the mechanics but saves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class ModuleOffload:
    """Stream `units` (modules) between host memory and `device` around their forwards."""

    def __init__(self, units: Sequence[nn.Module], device: torch.device | str, sticky: bool = False) -> None:
        self.units = list(units)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # sticky: a unit stays on the device after its forward until another unit runs (units that run many
        # times in a row, e.g. the experts of a two-expert model: one resident at a time, no prefetch)
        self.sticky = sticky
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda and len(self.units) > 1 and not sticky else None
        self.events: dict[int, Any] = {}
        # per unit: (tensor object whose .data is swapped, its host copy)
        self.host: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.loaded: set[int] = set()
        self.resident_bytes = 0  # bytes of streamed units on the device now
        self.max_resident_bytes = 0
        self.onloads = 0
        self.handles: list[Any] = []
        for unit in self.units:
            pairs = []
            for tensor in [*unit.parameters(), *unit.buffers()]:
                host = tensor.detach().to("cpu")  # already in host memory (CPU engine): no second copy
                if self.cuda:
                    host = host.pin_memory()  # page-locked: the copy to the device can run asynchronously
                tensor.data = host  # the device copy (if any) is released here
                pairs.append((tensor, host))
            self.host.append(pairs)
        for index, unit in enumerate(self.units):
            self.handles.append(unit.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(unit.register_forward_hook(self._post_hook(index)))

    @property
    def unit_bytes(self) -> list[int]:
        return [sum(h.numel() * h.element_size() for _, h in pairs) for pairs in self.host]

    def _onload(self, index: int) -> None:
        if index in self.loaded:
            return
        self.loaded.add(index)
        self.onloads += 1
        self.resident_bytes += self.unit_bytes[index]
        self.max_resident_bytes = max(self.max_resident_bytes, self.resident_bytes)
        if self.stream is None:
            for tensor, host in self.host[index]:
                tensor.data = host.to(self.device, copy=True)
            return
        with torch.cuda.stream(self.stream):
            for tensor, host in self.host[index]:
                tensor.data = host.to(self.device, non_blocking=True, copy=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[index] = event

    def _offload(self, index: int) -> None:
        if index not in self.loaded:
            return
        self.loaded.discard(index)
        self.resident_bytes -= self.unit_bytes[index]
        self.events.pop(index, None)
        for tensor, host in self.host[index]:
            tensor.data = host

    def _wait(self, index: int) -> None:
        """Make the compute stream wait for a prefetched copy, and tell the allocator the tensors are
        used there (they were allocated on the side stream)."""
        event = self.events.pop(index, None)
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor, _ in self.host[index]:
            tensor.data.record_stream(current)

    def _pre_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            nxt = index if self.sticky else (index + 1) % len(self.units)
            for other in list(self.loaded):  # e.g. a prefetched block a step cache skipped
                if other not in (index, nxt):
                    self._offload(other)
            self._onload(index)
            self._wait(index)
            if nxt != index:
                self._onload(nxt)  # overlaps this unit's compute on CUDA

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sticky:
                self._offload(index)

        return hook

    def remove(self) -> None:
        """Take the hooks off and put every unit back on the device."""
        for handle in self.handles:
            handle.remove()
        for pairs in self.host:
            for tensor, host in pairs:
                tensor.data = host.to(self.device)
        self.loaded.clear()
        self.resident_bytes = 0


def swap_blocks(transformer: nn.Module, blocks_to_swap: int, device: torch.device | str) -> ModuleOffload:
    """Stream the last `blocks_to_swap` repeated blocks of `transformer` from host memory."""
    from spindle.distributed.blocks import find_blocks

    blocks = find_blocks(transformer)
    if not 1 <= blocks_to_swap <= len(blocks):
        raise ValueError(
            f"blocks_to_swap={blocks_to_swap}: {type(transformer).__name__} has {len(blocks)} blocks; "
            f"use 1..{len(blocks)} (0 turns block swap off)"
        )
    return ModuleOffload(blocks[len(blocks) - blocks_to_swap :], device)


def offload_experts(
    components: dict[str, Any], names: Sequence[str], device: torch.device | str
) -> dict[str, ModuleOffload]:
    """`expert_offload`: the denoising experts (`names`, e.g. Wan2.2 A14B's transformer and transformer_2)
    in host memory, each moved to the device when it starts its steps and back when the other starts."""
    if len(names) < 2:
        raise ValueError(
            "expert_offload: this model denoises with one transformer (no experts to take turns); use blocks_to_swap"
        )
    offload = ModuleOffload([components[name] for name in names], device, sticky=True)
    return {"experts": offload}


def offload_text_encoders(components: dict[str, Any], device: torch.device | str) -> dict[str, ModuleOffload]:
    """Each `text_encoder*` component on the host, visiting `device` only for its forward."""
    return {
        name: ModuleOffload([module], device)
        for name, module in sorted(components.items())
        if name.startswith("text_encoder") and isinstance(module, nn.Module)
    }


def enable_vae_tiling(vae: Any) -> None:
    """diffusers' own tiled (and, where the VAE has it, batch-sliced) decoding: memory bounded by the
    tile, not the frame size. Tiles overlap and are blended, so a frame larger than one tile decodes
    as diffusers' `enable_tiling()` decodes it, not as the untiled VAE does."""
    if not callable(getattr(vae, "enable_tiling", None)):
        raise ValueError(f"vae_tiling: {type(vae).__name__} has no enable_tiling(); set vae_tiling: false")
    vae.enable_tiling()
    if callable(getattr(vae, "enable_slicing", None)):
        vae.enable_slicing()
