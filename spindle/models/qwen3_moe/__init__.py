"""Qwen3-MoE causal LMs (transformers `model_type` "qwen3_moe", `Qwen3MoeForCausalLM`), trained by the MoE
causal-LM task with its experts part (spindle/train/parts/experts.py): fused experts, expert parallelism, router aux loss."""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="qwen3_moe",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss (patches.py)
    model_class="spindle.models.qwen3_moe.generated.patched_modeling_qwen3_moe:Qwen3MoeForCausalLM",
)
