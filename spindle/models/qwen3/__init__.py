"""Qwen3 dense causal LMs (transformers `model_type` "qwen3", `Qwen3ForCausalLM`), trained by the causal-LM task."""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="qwen3",
    # The class the task trains: the patchgen-generated modeling (patches.py), whose forward computes the
    # loss with the chunked linear cross-entropy; the folder's config.json stays stock transformers'.
    model_class="spindle.models.qwen3.generated.patched_modeling_qwen3:Qwen3ForCausalLM",
)
