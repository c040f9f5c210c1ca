"""Qwen3.5 natively multimodal models, dense (transformers `model_type` "qwen3_5",
`Qwen3_5ForConditionalGeneration`), trained by the VLM task on image and video conversations.

The decoder is hybrid: three of every four layers are Gated DeltaNet linear attention (a causal convolution and
a gated delta-rule recurrence carry state along the sequence), the fourth full attention. transformers' torch
path of those layers takes no document boundaries (its chunked recurrence ignores `cu_seqlens`), so a packed
row would carry one conversation's state into the next: `data.packing` is refused for such models, and so is
Ulysses SP (its heads-split all-to-all is written for softmax attention; the recurrence would need each head's
whole sequence), both before launch naming the reason (spindle.train.tasks.causal_lm `check_plan`).
"""

from spindle.contracts.family import CausalLMConformanceSpec, VLMFamily

FAMILY = VLMFamily(
    name="qwen3_5",
    model_types=("qwen3_5",),
    # patchgen-generated: the chunked loss from hidden states (patches.py)
    model_class="spindle.models.qwen3_5.generated.patched_modeling_qwen3_5:Qwen3_5ForConditionalGeneration",
    parts={
        "vision": ("model.visual.",),
        "aligner": ("model.visual.merger.",),
        "language": ("model.language_model.", "lm_head."),
    },
    video_timestamps=True,
    sequence_parallel_refused="qwen3_5 models have linear-attention (Gated DeltaNet) layers, whose recurrence runs "
    "over each head's whole sequence; Spindle's Ulysses SP splits softmax attention only (FSDP2 / HSDP layouts work)",
    # no Ulysses SP for the linear-attention layers (module doc): FSDP2 / HSDP only
    conformance=CausalLMConformanceSpec(parallel=("dp_shard2",)),
)
