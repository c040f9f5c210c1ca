"""The VLM task for mixture-of-experts language models (Qwen3-VL-MoE): the VLM task (image conversations,
3-D positions, the vision hook, freezing, the processor in the export) with the MoE task's experts
(checkpoint layouts through the family's adapter, router aux loss and expert load, expert parallelism).
Both are `CausalLMTask`s that extend it cooperatively; this class only combines them (MRO: MoE, then
VLM, then the causal LM), so each part is written once:

- load: the MoE task's validated expert layout and conversion (per-expert or fused checkpoints) on top of
  the VLM task's checkpoint names;
- plan: the VLM plan (Ulysses SP in the language model only) plus the experts sharded over `parallel.ep`;
- step: the VLM forward, with the MoE task's model kwargs (padding mask and SP group of the router
  statistics, cut to the rank's chunk under SP) and metrics (`aux_loss`, expert load);
- export: the MoE folder writer (the input's expert layout) under the VLM checkpoint names, with the
  image processor's files.
"""

from __future__ import annotations

from spindle.config import VLMJobConfig
from spindle.train.tasks.moe_causal_lm import MoECausalLMTask
from spindle.train.tasks.vlm import VLMTask


class VLMMoETask(MoECausalLMTask, VLMTask):
    name = "vlm_moe"
    config_class = VLMJobConfig
