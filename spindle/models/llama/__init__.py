"""Llama dense causal LMs (transformers `model_type` "llama", `LlamaForCausalLM`), trained by the causal-LM task."""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="llama",
    # The class the task trains: the patchgen-generated modeling (patches.py), whose forward computes the
    # loss with the chunked linear cross-entropy; the folder's config.json stays stock transformers'.
    model_class="spindle.models.llama.generated.patched_modeling_llama:LlamaForCausalLM",
)
