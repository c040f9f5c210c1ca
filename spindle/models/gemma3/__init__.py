"""Gemma 3 text causal LMs (transformers `model_type` "gemma3_text", `Gemma3ForCausalLM`: gemma-3-1b and
the text stacks of the larger ones), trained by the causal-LM task.

Attention alternates sliding-window (local) and global layers, so packed rows run transformers' sdpa with
its per-document mask, windowed on the local layers (`model.attn_implementation: auto` picks it; Spindle's
varlen and flash kernels implement no window and refuse such a model). Under Ulysses SP (`parallel.sp`) each
rank attends over the whole sequence of its heads: the local layers through spindle.ops.windowed_attention
(the window per packed document, in query blocks: no [S, S] mask), the global ones through the run's attention.
"""

from spindle.contracts.family import CausalLMFamily

FAMILY = CausalLMFamily(
    name="gemma3",
    # The class the task trains: the patchgen-generated modeling (patches.py), whose forward computes the
    # loss with the chunked linear cross-entropy; the folder's config.json stays stock transformers'.
    model_class="spindle.models.gemma3.generated.patched_modeling_gemma3:Gemma3ForCausalLM",
    model_types=("gemma3_text",),
    # The image-text checkpoints (gemma-3-4b/12b/27b, model_type "gemma3", `Gemma3ForConditionalGeneration`) are
    # the gemma3_vl family's (../gemma3_vl).
)
