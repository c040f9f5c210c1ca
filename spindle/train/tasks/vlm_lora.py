"""LoRA on a vision-language (or omni) model's parts: where `train.lora.parts` puts adapters, and how it
composes with `train.freeze`.

`train.lora.parts` names the family's parts (`VLMFamily.parts`, the names `train.freeze` takes); default
`[language]`, the decoder layers, as before. A part's adapters go on the linear layers of its repeated blocks
(the FSDP2 units: decoder layers, vision blocks, audio encoder layers), so a tower's patch embedding and the
language model's head stay as they are; a part with no block of its own (the aligner: the vision merger,
Qwen3-VL's deepstack mergers, an omni audio projection) is adapted whole. `train.lora.targets` then selects
among those linear layers by suffix (spindle.train.lora), over all the parts at once: `[qkv]` with
`parts: [language, vision]` would leave the language model without adapters, which is refused, naming the
part and its layer names, rather than trained silently.

`train.freeze` with LoRA: LoRA keeps every base weight frozen and trains only adapters. A `train.freeze` list
given beside it must therefore account for every part, frozen or adapted (e.g. freeze everything, adapters
on language and vision); a part in neither would read as "trained" in the config yet stay frozen. The frozen
parts' base weights are frozen either way; their adapters, if `parts` names them, train.

Vision-tower SP (spindle/distributed/vision_sequence_parallel.py) hooks the blocks' attention modules and
the mergers, not their linear layers, so PEFT's wrapping of `attn.qkv` / `attn.proj` / the merger's layers
keeps it working unchanged; the dummy tower forward of a text-only micro-batch runs the adapters too (their
gradient there is zero), so data-parallel ranks stay in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from spindle.config import ConfigError

if TYPE_CHECKING:
    from spindle.config import VLMLoraConfig
    from spindle.contracts.family import VLMFamily


def check_lora_parts(family: VLMFamily, lora: VLMLoraConfig, freeze: Sequence[str]) -> None:
    """Before launch: `train.lora.parts` names parts of the family, and `train.freeze` beside LoRA leaves no
    part neither frozen nor adapted (module docstring)."""
    if unknown := sorted(set(lora.parts) - set(family.parts)):
        raise ConfigError(
            f"train.lora.parts names {unknown}, which {family.name} models do not have; "
            f"their parts: {sorted(family.parts)}"
        )
    if freeze and (loose := sorted(set(family.parts) - set(freeze) - set(lora.parts))):
        raise ConfigError(
            f"train.freeze={list(freeze)} with train.lora: LoRA trains adapters only (on train.lora.parts="
            f"{list(lora.parts)}) and keeps every base weight frozen, so {loose} would stay frozen although "
            f"train.freeze leaves them out; add them to train.freeze, or to train.lora.parts to adapt them"
        )


def lora_regions(
    family: VLMFamily, model: nn.Module, blocks: Sequence[nn.Module], parts: Sequence[str]
) -> list[nn.Module]:
    """The modules in which `train.lora.targets` resolves, for the parts `parts`: each part's blocks among
    `blocks` (the model's repeated blocks), or, for a part holding none, the modules its prefixes name."""
    names = {id(m): name for name, m in model.named_modules()}
    regions: list[nn.Module] = []
    for part in parts:
        inside = [b for b in blocks if family.part_of(names[id(b)] + ".") == part]
        if not inside:
            prefixes = family.parts[part]
            inside = [m for name, m in model.named_modules() if name + "." in prefixes]
        regions.extend(inside)
    return regions


def check_adapted_parts(family: VLMFamily, model: nn.Module, parts: Sequence[str]) -> None:
    """After injection: every part in `parts` got adapters (`train.lora.targets` may match none of a part's
    layers); else a ConfigError naming the part and its linear layers' names."""
    from spindle.train.lora import is_lora_name

    adapted = {family.part_of(name) for name, _ in model.named_parameters() if is_lora_name(name)}
    for part in parts:
        if part in adapted:
            continue
        # the part holds no adapter, so its linear layers are unwrapped: their names, as the blocks hold them
        linears = sorted(
            {
                ".".join(name.split(".")[-2:])
                for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and family.part_of(name + ".") == part
            }
        )
        raise ConfigError(
            f"train.lora.parts: {part!r} gets no adapter: train.lora.targets matches none of its linear layers "
            f"({', '.join(linears[:8]) or 'none'}); add one of them to train.lora.targets or drop {part!r}"
        )
