"""Qwen3-MoE causal LMs (transformers `model_type` "qwen3_moe", `Qwen3MoeForCausalLM`), trained by the MoE
causal-LM task with its experts part (spindle/train/parts/experts.py): fused experts, expert parallelism, router aux loss."""

from spindle.contracts.family import CausalLMConformanceSpec, CausalLMFamily

FAMILY = CausalLMFamily(
    name="qwen3_moe",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss (patches.py)
    model_class="spindle.models.qwen3_moe.generated.patched_modeling_qwen3_moe:Qwen3MoeForCausalLM",
    conformance=CausalLMConformanceSpec(
        # 2 layers keep the suite fast; an aux coefficient of 0.1 makes a wrong aux loss show in the step loss
        tiny_overrides={"num_hidden_layers": 2, "router_aux_loss_coef": 0.1},
        # Spindle's MoE loss is stock's with output_router_logits: token loss + coef x router aux loss
        stock_loss_kwargs={"output_router_logits": True},
        stock_outputs=("aux_loss",),
    ),
)
