"""GPT-OSS causal LMs (transformers `model_type` "gpt_oss", `GptOssForCausalLM`: openai/gpt-oss-20b and
-120b): every layer a MoE of fused experts with biases (gate and up columns interleaved, a clamped SwiGLU),
layers alternating sliding-window and full attention, and a learned sink logit per attention head. Trained by
the MoE causal-LM task with its experts part (spindle/train/parts/experts.py): fused experts, expert
parallelism, the router aux loss as the model defines it (`router_aux_loss_coef`).

Attention: transformers implements the sinks in its eager, flash (hub kernels) and flex attention only and
refuses sdpa for the model (`_supports_sdpa = False`), so `model.attn_implementation: auto` is eager
(spindle.ops.attention_backend). Packed rows are masked per document (patches.py: the position ids reach
transformers' mask functions), windowed on the sliding layers: exact. Under Ulysses SP (`parallel.sp`) every
layer runs spindle.ops.windowed_attention over the whole sequence of the rank's heads with those heads' slice
of the sinks, windowed on the sliding layers, per packed document: eager's computation in query blocks (no
[S, S] mask).
"""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="gpt_oss",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss, per-document masks
    # of packed rows (patches.py)
    model_class="spindle.models.gpt_oss.generated.patched_modeling_gpt_oss:GptOssForCausalLM",
)
