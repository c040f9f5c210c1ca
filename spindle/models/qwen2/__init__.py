"""Qwen2 / Qwen2.5 dense causal LMs (transformers `model_type` "qwen2", `Qwen2ForCausalLM`), trained by the
causal-LM task."""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="qwen2",
    # The class the task trains: the patchgen-generated modeling (patches.py), whose forward computes the
    # loss with the chunked linear cross-entropy; the folder's config.json stays stock transformers'.
    model_class="spindle.models.qwen2.generated.patched_modeling_qwen2:Qwen2ForCausalLM",
)
