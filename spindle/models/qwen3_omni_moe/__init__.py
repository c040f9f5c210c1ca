"""Qwen3-Omni-MoE (transformers `model_type` "qwen3_omni_moe", `Qwen3OmniMoeForConditionalGeneration`): the
omni task with its experts part (conversion.py selects it) trains its thinker
(`Qwen3OmniMoeThinkerForConditionalGeneration`: audio encoder, Qwen3-VL vision tower, Qwen3-MoE decoder) on
audio/image/video conversations, with the router aux loss (patches.py), expert load and expert parallelism; the
talker and code2wav are carried through to the export unchanged. The thinker's experts load from per-expert
or fused checkpoints and are exported in the input's layout (conversion.py). Videos train as Qwen2.5-Omni's
(the same video processor and placeholder), with their audio track interleaved by time when
`data.use_audio_in_video` (video_audio.py)."""

from spindle.contracts.family import OmniFamily

FAMILY = OmniFamily(
    name="qwen3_omni_moe",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss (patches.py)
    model_class=(
        "spindle.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe:"
        "Qwen3OmniMoeThinkerForConditionalGeneration"
    ),
    full_model_class="transformers:Qwen3OmniMoeForConditionalGeneration",
    audio_tokens="spindle.models.qwen3_omni_moe.rope:audio_tokens",
    parts={
        "audio": ("model.audio_tower.",),
        "vision": ("model.visual.",),
        # what maps each tower's features into the decoder's width
        "aligner": (
            "model.visual.merger.",
            "model.visual.merger_list.",
            "model.audio_tower.proj1.",
            "model.audio_tower.proj2.",
        ),
        "language": ("model.language_model.", "lm_head."),
    },
    untrained=("talker.", "code2wav."),
    blocks=("Qwen3OmniMoeThinkerTextDecoderLayer", "Qwen3OmniMoeVisionBlock", "Qwen3OmniMoeAudioEncoderLayer"),
)
