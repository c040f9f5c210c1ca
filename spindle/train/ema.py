"""An exponential moving average (EMA) of the trained weights (`train.ema`), kept like the weights are.

After optimizer step `s` (1-based), for every trainable parameter `w` and its average `e`:

    s <= start_step                      e = w                  (the average starts from the weights)
    (s - start_step) % every == 0        e = decay * e + (1 - decay) * w
    otherwise                            e unchanged

As diffusers' `EMAModel(update_after_step=start_step)` (decay 0 until then, no warm-up ramp) and
SimpleTuner's `ema_update_interval`: `decay` applies per update, so the average spans about
`every / (1 - decay)` steps. The rule depends on the step alone, so a resumed run updates exactly as
the uninterrupted one did, and the EMA itself is saved in every checkpoint (`state_dict`, DCP) to be
restored bit for bit.

Sharded like the weights: the average of a parameter is a tensor of the parameter's own placement
(an FSDP2 parameter's average is a DTensor with its mesh and placements, on its device: on the host
under `train.cpu_offload`), updated from the local shard, so no rank ever gathers the model for it
and DCP saves and reshards it like the weights (resume at another world size). Only the trainable
parameters are averaged: a LoRA run keeps the EMA of its adapters, the frozen base being constant.

What reads the average swaps it into the model for the time it runs (`swapped_in`): validation
samples (`train.validation.use_ema`) and the exports (`export.weights`, `spindle export --weights`),
so every task's export writes the EMA with no code of its own. The trainer (`spindle.train.trainer`)
calls `update` after each step and passes `state_dict` to the checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.tensor import DTensor

from spindle.config import EmaConfig
from spindle.distributed.mesh import barrier, is_main_process

log = logging.getLogger("spindle.train")

# The checkpoint's namespace for the average (next to DCP's "model" and "optim").
EMA_STATE = "ema"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage itself, so in-place ops update the DTensor), else the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def ema_active(ema: EmaConfig, step: int) -> tuple[bool, float]:
    """-> (whether the average changes after optimizer step `step`, the decay of that change: 0 copies)."""
    if step <= ema.start_step:
        return True, 0.0
    return (step - ema.start_step) % ema.every == 0, ema.decay


class WeightsEMA:
    """The EMA of `model`'s trainable parameters, keyed by their state-dict names (what
    `get_model_state_dict` calls them: the names the export and the checkpoint's "model" use)."""

    def __init__(self, model: torch.nn.Module, config: EmaConfig):
        self.config = config
        names: list[str] = []
        self.params: list[torch.Tensor] = []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (fqn,) = _get_fqns(model, name)  # without activation-checkpoint / compile wrappers
                names.append(fqn)
                self.params.append(param)
        # fp32 whatever the parameters' dtype: at decay 0.999 an update moves the average by 0.1% of its
        # distance to the weights, less than half a bf16 unit in the last place (2^-8 relative) once the
        # two are close, so a bf16 average would round every update away and stop moving.
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                fqn: param.detach().to(torch.float32, copy=True) for fqn, param in zip(names, self.params, strict=True)
            }

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based): the rule of the module docstring, on every rank's shards."""
        changes, decay = ema_active(self.config, step)
        if not changes:
            return
        weights = [_local(p).to(torch.float32) for p in self.params]
        if decay == 0.0:
            torch._foreach_copy_(self._shards(), weights)
        else:
            # e + (1 - decay) * (w - e): diffusers' and torch's AveragedModel's form of the same update
            torch._foreach_lerp_(self._shards(), weights, 1.0 - decay)

    def _shards(self) -> list[torch.Tensor]:
        """This rank's pieces of the averages (taken each time: a checkpoint load may hand new tensors)."""
        return [_local(t) for t in self.shadow.values()]

    def describe(self, export: str) -> str:
        """One line for the run's start summary."""
        c = self.config
        every = "every step" if c.every == 1 else f"every {c.every} steps"
        return f"decay {c.decay} {every} after step {c.start_step} (fp32); export: {export} weights"

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages (DTensors where the weights are): what the checkpoint saves and loads in place."""
        return self.shadow

    @contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[None]:
        """The model holds the averages (in its parameters' dtype) inside the block, its own weights again
        after it, bit for bit. FSDP2 modules are resharded on both sides, so no unsharded copy gathered
        from the other set of weights is reused by a forward."""
        reshard(model)
        with torch.no_grad():
            local = [_local(p) for p in self.params]
            saved = [t.clone() for t in local]
            torch._foreach_copy_(local, self._shards())
        try:
            yield
        finally:
            reshard(model)
            with torch.no_grad():
                torch._foreach_copy_(local, saved)


def few_updates_warning(config: EmaConfig, step: int) -> str | None:
    """A warning when the EMA exported at optimizer step `step` has seen too few updates to have moved
    far from where it started: more than half of it is still the weights of step `start_step`
    (decay ** updates > 0.5), so the export is close to those, not to the trained weights."""
    updates = max(step - config.start_step, 0) // config.every
    if step <= config.start_step or config.decay**updates <= 0.5:
        return None
    return (
        f"the exported EMA has seen {updates} update(s) (train.ema.decay={config.decay}): {config.decay**updates:.0%} "
        f"of it is still the weights of step {config.start_step}, so the export is close to those; train longer, "
        "lower train.ema.decay, or export the trained weights (export.weights: trained, or --weights trained)"
    )


def reshard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_ema(model: torch.nn.Module, config: EmaConfig | None) -> WeightsEMA | None:
    """`train.ema` -> the average of `model`'s trainable parameters, starting from them (None: off)."""
    return None if config is None else WeightsEMA(model, config)


def ema_checkpoint_state(ema: WeightsEMA | None, path: Path | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's `extra` state (`spindle.distributed.checkpoint`): the EMA's namespace, to save, or
    to load from `path` when it holds one. A checkpoint without one (`checkpoint.resume=force` of a run
    that had no `train.ema`: `run.json` refuses it otherwise) gives {} and a warning: the caller starts
    the average from the loaded weights."""
    from spindle.distributed.checkpoint import saved_namespaces

    if ema is None:
        return {}
    if path is not None and EMA_STATE not in saved_namespaces(path):
        if is_main_process():
            log.warning("checkpoint %s holds no EMA: train.ema starts from its weights", path)
        return {}
    return {EMA_STATE: ema.state_dict()}


def export_weights(
    weights: str,
    out: Path,
    export: Callable[[Path], Path | None],
    ema_in_place: Callable[[], AbstractContextManager[Any]],
    beside: dict[str, str],
) -> Path | None:
    """Collective: `export(folder)` writes the trained weights' export (every task's own); `ema_in_place()`
    makes it write the EMA instead (the model holds it, or the checkpoint is read from its EMA).

    `weights`: trained | ema (the export holds the EMA) | both (the trained export, and the EMA's written
    beside it: `beside` maps each path of an export that holds weights to its EMA twin's name, e.g.
    `transformer` -> `transformer_ema`, which stock diffusers loads with `subfolder="transformer_ema"`;
    `""` stands for the whole folder).
    """
    if weights == "trained":
        return export(out)
    if weights == "ema":
        with ema_in_place():
            return export(out)
    result = export(out)
    side = out.with_name(out.name + ".ema.tmp")
    with ema_in_place():
        export(side)
    if is_main_process():
        place_beside(out, side, beside)
    barrier()
    return result


def place_beside(out: Path, side: Path, beside: dict[str, str]) -> None:
    """Move each weight-holding path of the EMA export `side` into `out` under its EMA name; drop the rest
    (the components both exports share)."""
    for source, target in beside.items():
        moved = side / source if source else side
        if moved.exists():
            destination = out / target
            shutil.rmtree(destination, ignore_errors=True)
            destination.parent.mkdir(parents=True, exist_ok=True)
            moved.rename(destination)
            repoint_cards(destination, moved.resolve(), destination.resolve())
    shutil.rmtree(side, ignore_errors=True)


def repoint_cards(folder: Path, old: Path, new: Path) -> None:
    """A model card (README.md) the EMA's export wrote names the folder it was written to, with the lines
    that load it; name the folder it now lies in."""
    for card in folder.rglob("README.md"):
        text = card.read_text()
        if str(old) in text:
            card.write_text(text.replace(str(old), str(new)))
