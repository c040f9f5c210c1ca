"""DeepSeek-V3 expert tensors in, expert tensors out: the family's checkpoint adapter
(spindle/models/shared/moe_checkpoints.py). DeepSeek-V3's released checkpoints and its stock `save_pretrained`
hold the routed experts per expert (`mlp.experts.{j}.gate_proj.weight [I, H]` ...), which transformers fuses on
load (its conversion mapping is qwen2_moe's); the fused layout is the model's own (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`). The shared experts (`mlp.shared_experts.*`) and the first `first_k_dense_replace`
layers' MLPs are dense tensors, passed through as they are."""

from __future__ import annotations

from spindle.models.shared.moe_checkpoints import PER_EXPERT, ExpertCheckpoints

ADAPTER = ExpertCheckpoints(model_type="deepseek_v3", default_layout=PER_EXPERT)
