"""The omni task for mixture-of-experts thinkers (Qwen3-Omni-MoE): the omni task (`OmniTask`: the thinker
only, audio/image conversations, the audio tower's dummy forward, the untrained talker and code2wav carried
through the export) with the MoE task's experts (`MoECausalLMTask`: the thinker's expert layout validated
and converted both ways, router aux loss and expert load, expert parallelism). Both extend `CausalLMTask`
cooperatively; this class only combines them, as `VLMMoETask` does (MRO: MoE, then omni, then VLM, then the
causal LM):

- load: the MoE task's validated expert layout and conversion (of the thinker's experts only: the family's
  adapter checks `thinker.` keys) on top of the omni task's thinker-only sources;
- plan: the omni plan (FSDP2 units per encoder layer, vision block and decoder layer; SP in the decoder)
  plus the experts sharded over `parallel.ep`;
- step: the VLM forward with the audio tower, with the MoE task's model kwargs and metrics;
- export: the MoE folder writer (the input's expert layout, under the checkpoint's `thinker.` names),
  completed by the omni task's `finish_export` (talker and code2wav tensors as stored, the whole config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spindle.train.tasks.moe_causal_lm import MoECausalLMTask, checkpoint_adapter
from spindle.train.tasks.omni import OmniTask

if TYPE_CHECKING:
    import torch

    from spindle.contracts.family import CausalLMFamily


class OmniMoETask(MoECausalLMTask, OmniTask):
    name = "omni_moe"
    export_files = OmniTask.export_files

    @classmethod
    def checkpoint_names(cls, family: CausalLMFamily, model: torch.nn.Module) -> dict[str, str]:
        """The omni names (`thinker.model.*` <-> `model.language_model.*` ...), found with the family's
        conversion registered: transformers applies no mapping, forward or reverse, to a class defined outside
        its package (the patchgen-generated thinker) unless one is registered for its model type."""
        adapter = checkpoint_adapter(family)
        with adapter.loading(adapter.default_layout):
            return super().checkpoint_names(family, model)
