"""transformers' checkpoint conversions for the classes of a patchgen-generated module.

transformers renames checkpoint keys on load and back on save (`conversion_mapping`: e.g. Qwen2.5-VL's
`model.layers.*` -> `model.language_model.layers.*`, `visual.*` -> `model.visual.*`), looked up by class
name, then model type. It skips that lookup for any class defined outside its own package ("custom code",
`PreTrainedModel.is_custom_code`), which a generated class is, unless the name or model type was
registered by the user: a generated Qwen2.5-VL class would then load a Hub checkpoint with every
language-model weight missing, and save under names stock transformers does not read.

`keep_conversions(upstream_module)` re-registers transformers' *own* mapping under each class name of the
upstream module that has one: the same rules, now applying to the generated classes of the same names
too. Stock loads are unchanged (their mapping is the one registered). Called by the generated module at
import (its patches.py's `add_post_import_block`), so every use of a generated class has it.
"""

from __future__ import annotations

import importlib
from typing import Any


def keep_conversions(upstream_module: str) -> list[str]:
    """Register transformers' conversion mapping of every class of `upstream_module` that has one, under
    its class name (idempotent); -> the names registered."""
    from transformers import PreTrainedModel
    from transformers import conversion_mapping as cm

    module = importlib.import_module(upstream_module)
    names = []
    for name, obj in sorted(vars(module).items()):
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == upstream_module:
            mapping = cm.get_checkpoint_conversion_mapping(name)
            if mapping is not None:
                cm.register_checkpoint_conversion_mapping(name, mapping, overwrite=True)
                names.append(name)
    return names


def keep_model_type_conversions(model_types: tuple[str, ...]) -> list[str]:
    """Register transformers' own conversion mapping of each of `model_types` under that model type again, as the
    user's (idempotent): transformers then applies it to the generated classes of those model types too, by the
    same lookup as to its own (class name, then model type, sub-model by sub-model). For modules whose mapping
    transformers keys by model type only (Gemma 3's); -> the model types registered (those with a mapping)."""
    from transformers import conversion_mapping as cm

    registered = []
    for model_type in model_types:
        mapping = cm.get_checkpoint_conversion_mapping(model_type)
        if mapping is not None:
            cm.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
            registered.append(model_type)
    return registered


def chunked_loss_head_patch(source_module: str, head: str) -> Any:
    """The patchgen config of a multimodal family whose only patch is the chunked loss: `head`.forward (the
    ForConditionalGeneration class of `source_module`) delegates to the shared causal-LM forward, and the
    generated module keeps transformers' checkpoint key conversions (`keep_conversions`) at import."""
    from spindle.models.shared.causal_lm_patch import causal_lm_forward
    from spindle.patchgen import PatchConfig

    config = PatchConfig(source_module=source_module)
    config.delegate_method(
        f"{head}.forward",
        to=causal_lm_forward,
        description="loss from hidden states with the chunked linear cross-entropy",
    )
    config.add_import("spindle.models.shared.patched_conversions", names=["keep_conversions"])
    config.add_post_import_block(
        f'keep_conversions("{source_module}")',
        description="transformers' checkpoint key conversions apply to the generated classes too",
    )
    return config
