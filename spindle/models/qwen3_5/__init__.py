"""Qwen3.5 natively multimodal models, dense (transformers `model_type` "qwen3_5",
`Qwen3_5ForConditionalGeneration`), trained by the VLM task on image and video conversations.

The decoder is hybrid: three of every four layers are Gated DeltaNet linear attention (a causal convolution and
a gated delta-rule recurrence carry state along the sequence), the fourth full attention. transformers' torch
path of those layers takes no document boundaries (its chunked recurrence ignores `cu_seqlens`), so a packed
row would carry one conversation's state into the next: `data.packing` is refused for such models before launch,
naming the reason (spindle.train.tasks.causal_lm `check_plan`).

Ulysses SP (`parallel.sp`): the full-attention layers run Spindle's Ulysses attention; the Gated DeltaNet layers
split their heads the same way (patches.py, spindle/distributed/ulysses_linear_attention.py): projections on
the rank's chunk of the sequence, then the causal convolution and the recurrence over the whole sequence of the
rank's heads (`linear_num_value_heads` divisible by `parallel.sp`), exact against one process.
"""

from spindle.contracts.family import VLMFamily

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
)
