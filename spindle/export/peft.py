"""LoRA for the language-model tasks (causal LM, VLM): adapters on the decoder layers' linear layers
(`spindle.train.lora`, the same injection as for DiTs), exported as a PEFT adapter folder that stock
`peft.PeftModel.from_pretrained(base, folder)` loads, and, with `export.merge_lora`, a merged
transformers folder that stock transformers loads on its own.

Export layout (`<out>/`): `lora/` = `adapter_model.safetensors` (PEFT's key names,
`base_model.model.<module>.lora_A.weight`) + `adapter_config.json` (alpha / rank folded into lora_B,
so the config says alpha = rank) + the tokenizer and processor files; `merged/` = the base model with
`W + B @ A` in every adapted module.

Fused experts (`target_parameters`, spindle.train.lora): the adapters of a wrapped parameter sit on its
module's PEFT wrapper (`experts.lora_A`, `experts.base_layer.lora_A` for a second parameter of the
same module); `parameters` maps those adapter modules to the parameter names the config lists, and the
merge adds PEFT's per-expert delta (`ParamWrapper.get_delta_weight`) to the stacked weight.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LORA_DIR, MERGED_DIR = "lora", "merged"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class TrainedHead:
    """A module trained whole beside the adapters (a reward model's new `score` head): PEFT's `modules_to_save`.
    `tensors` under the model's names; `config`: the model config the merged folder is built from (num_labels,
    pad_token_id); `task_type`: PEFT's, so that `PeftModel.from_pretrained` wraps the right model class."""

    module: str
    tensors: dict[str, torch.Tensor]
    config: Any
    task_type: str


def peft_adapter_config(
    base: str | Path,
    adapters: dict[str, torch.Tensor],
    rank: int,
    parameters: dict[str, str] | None = None,
    head: TrainedHead | None = None,
) -> Any:
    """PEFT's LoraConfig for `adapters` (scale folded: alpha = rank), targeting exactly their modules and
    the fused parameters `parameters` ({adapter module: parameter name}) names; a trained `head` as one of its
    modules to save."""
    from peft import LoraConfig

    parameters = parameters or {}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in adapters} - parameters.keys())
    return LoraConfig(
        r=rank,
        lora_alpha=rank,
        # None, not []: PEFT accepts no target_modules only when target_parameters are given
        target_modules=modules or None,
        target_parameters=sorted(set(parameters.values())) or None,
        base_model_name_or_path=str(Path(base).resolve()),
        modules_to_save=None if head is None else [head.module],
        task_type=None if head is None else head.task_type,
    )


def expert_delta(a: torch.Tensor, b: torch.Tensor, num_experts: int, transposed: bool) -> torch.Tensor:
    """PEFT's delta of a 3-D fused parameter (`ParamWrapper.get_delta_weight`): `a [r*E, in]` holds expert
    e's A in rows e*r..(e+1)*r, `b [out, r*E]` its B in the columns r_i*E + e; -> `[E, out, in]`, or
    `[E, in, out]` where the module stores its experts transposed (`is_transposed`)."""
    a3 = a.float().reshape(num_experts, -1, a.shape[-1])  # e r i
    b3 = b.float().reshape(b.shape[0], -1, num_experts)  # o r e
    return torch.einsum("ore,eri->eio" if transposed else "ore,eri->eoi", b3, a3)


def merged_state(
    base_state: dict[str, torch.Tensor],
    adapters: dict[str, torch.Tensor],
    parameters: dict[str, str] | None = None,
    transposed: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The base weights with every adapter folded in (`W + B @ A`; the scale is already in B); a fused
    parameter (`parameters`: {adapter module: parameter name}; `transposed`: those stored [E, in, out])
    gets each expert's delta."""
    parameters = parameters or {}
    out = dict(base_state)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        module = key.rsplit(".lora_A.", 1)[0]
        b = adapters[f"{module}.lora_B.weight"]
        if module in parameters:
            weight = parameters[module]
            delta = expert_delta(a, b, base_state[weight].shape[0], weight in transposed)
        else:
            weight = f"{module}.weight"
            delta = b.float() @ a.float()
        out[weight] = (base_state[weight].float() + delta).to(base_state[weight].dtype)
    return out


def transposed_parameters(model: torch.nn.Module, parameters: dict[str, str]) -> frozenset[str]:
    """The fused parameters among `parameters` whose module stores them [E, in, out] (PEFT reads the
    module's `is_transposed`)."""
    return frozenset(
        p for p in parameters.values() if getattr(model.get_submodule(p.rpartition(".")[0]), "is_transposed", False)
    )


def export_lm_lora(
    model_cls: Any,
    base: str | Path,
    adapters: dict[str, torch.Tensor],
    out: str | Path,
    merge: bool,
    rank: int,
    extra_files: tuple[str, ...] = (),
    parameters: dict[str, str] | None = None,
    head: TrainedHead | None = None,
) -> Path:
    """One process: write `out/lora/` (PEFT folder) and, with `merge`, `out/merged/` (module docstring).

    `adapters`: `<module>.lora_A.weight` / `<module>.lora_B.weight` with alpha / rank folded into lora_B
    (`spindle.train.lora.adapter_state_dict`); `rank`: the run's `train.lora.rank`; `parameters`: the
    adapter modules on fused parameters (`spindle.train.lora.wrapped_parameters`); `head`: a module trained
    whole (PEFT's modules_to_save: its tensors saved under their own names, as PEFT saves them), which the merged
    folder holds too, built from `head.config` (a reward model's: `AutoModelForSequenceClassification` loads it)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    base, out = Path(base), Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lora = tmp / LORA_DIR
    lora.mkdir(parents=True)
    saved = {**adapters, **(head.tensors if head is not None else {})}
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in saved.items()}, lora / "adapter_model.safetensors")
    peft_adapter_config(base, adapters, rank, parameters, head).save_pretrained(lora)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.save_pretrained(lora)
    for name in extra_files:
        if (base / name).is_file():
            shutil.copy2(base / name, lora / name)
    if merge:
        # a trained head's model is built from its own config (the base folder's says ForCausalLM)
        model = model_cls.from_pretrained(base, dtype="auto", **({} if head is None else {"config": head.config}))
        transposed = transposed_parameters(model, parameters or {})
        state = merged_state(model.state_dict(), adapters, parameters, transposed)
        if head is not None:
            state.update({k: v.to(state[k].dtype) for k, v in head.tensors.items()})
        model.load_state_dict(state)
        model.save_pretrained(tmp / MERGED_DIR)
        tokenizer.save_pretrained(tmp / MERGED_DIR)
        for name in extra_files:
            if (base / name).is_file():
                shutil.copy2(base / name, tmp / MERGED_DIR / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
