"""DeepSeek-V3 causal LMs (transformers `model_type` "deepseek_v3", `DeepseekV3ForCausalLM`): multi-head latent
attention (low-rank query and key/value projections, a decoupled RoPE part of each head) and MoE layers from
`first_k_dense_replace` on, each with routed experts chosen by group-limited sigmoid routing and shared experts
every token passes through. Trained by the MoE causal-LM task with its experts part
(spindle/train/parts/experts.py): the routed experts are fused, expert-parallel and LoRA-adaptable; the shared
experts are an ordinary dense MLP (replicated under EP, sharded by FSDP like any other layer)."""

from spindle.contracts.family import CausalLMConformanceSpec, CausalLMFamily

FAMILY = CausalLMFamily(
    name="deepseek_v3",
    # patchgen-generated: chunked loss from hidden states (patches.py)
    model_class="spindle.models.deepseek_v3.generated.patched_modeling_deepseek_v3:DeepseekV3ForCausalLM",
    conformance=CausalLMConformanceSpec(
        # 1 dense layer then 2 MoE layers keep the suite fast while covering both MLP kinds. DeepSeek-V3 has no
        # router aux loss (its config has no router_aux_loss_coef): stock's loss is the token loss, Spindle's too.
        tiny_overrides={"num_hidden_layers": 3},
        # MLA projects one key/value per query head (DeepSeek-V3: num_key_value_heads == num_attention_heads)
        pair_overrides={"num_key_value_heads": 4},
    ),
)
