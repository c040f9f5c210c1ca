"""DeepSeek-V3 causal LMs (transformers `model_type` "deepseek_v3", `DeepseekV3ForCausalLM`): multi-head latent
attention (low-rank query and key/value projections, a decoupled RoPE part of each head) and MoE layers from
`first_k_dense_replace` on, each with routed experts chosen by group-limited sigmoid routing and shared experts
every token passes through. Trained by the MoE causal-LM task with its experts part
(spindle/train/parts/experts.py): the routed experts are fused, expert-parallel and LoRA-adaptable; the shared
experts are an ordinary dense MLP (replicated under EP, sharded by FSDP like any other layer)."""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="deepseek_v3",
    # patchgen-generated: chunked loss from hidden states (patches.py)
    model_class="spindle.models.deepseek_v3.generated.patched_modeling_deepseek_v3:DeepseekV3ForCausalLM",
)
