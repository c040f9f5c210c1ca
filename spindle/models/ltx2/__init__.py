"""LTX-2 text-to-video with its audio track (diffusers `LTX2Pipeline` / `LTX2VideoTransformer3DModel`)."""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions, Option
from spindle.models.shared import declarations as decl

# LTX2Pipeline's default text length (`max_sequence_length`); Gemma 3 reads far more, Spindle bounds it here
MAX_SEQUENCE_LENGTH = 1024
# LTX2Pipeline's default frame_rate: the video's fps and the clock of the audio track's length and positions
FRAME_RATE = 24


def _looks_like_ltx2(root: Path) -> bool:
    """Renamed local folders: LTX-2's audio VAE class."""
    return decl.config_mentions(root, "audio_vae", '"AutoencoderKLLTX2Audio"')


def _scale(name: str, default: float, what: str, maximum: float = 100.0) -> Option:
    return Option(name, float, default=default, minimum=0.0, maximum=maximum, help=what)


# the guidance terms of LTX2Pipeline.__call__, with its defaults: video and audio each combine, in x0 space, CFG
# (guidance_scale / audio_guidance_scale), spatio-temporal guidance (a forward with the self-attention of
# `spatio_temporal_guidance_blocks` skipped) and modality-isolation guidance (a forward with the audio<->video cross
# attention off), then rescale the result toward the conditional prediction's spread
GUIDANCE_OPTIONS = (
    _scale("audio_guidance_scale", 7.0, "classifier-free guidance scale of the audio track"),
    _scale("stg_scale", 1.0, "spatio-temporal guidance scale of the video (0 disables it)"),
    _scale("audio_stg_scale", 1.0, "spatio-temporal guidance scale of the audio (0 disables it)"),
    _scale("modality_scale", 3.0, "modality-isolation guidance scale of the video (1 disables it)"),
    _scale("audio_modality_scale", 3.0, "modality-isolation guidance scale of the audio (1 disables it)"),
    _scale("guidance_rescale", 0.7, "guidance rescale of the video (0 disables it)", maximum=1.0),
    _scale("audio_guidance_rescale", 0.7, "guidance rescale of the audio (0 disables it)", maximum=1.0),
)
# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object. 24 fps video
# (the pipeline's frame_rate); the VAE compresses time 8x (the tiny: 2x), so num_frames = 8k + 1
OPTIONS = FamilyOptions(
    extra=GUIDANCE_OPTIONS,
    guidance="classifier-free guidance scale of the video (CFG runs when it or audio_guidance_scale is > 1)",
    fps=FRAME_RATE,
)
# every guidance term but CFG off: the suite's "cfg" case (one batched forward a step) and the demo's samples
PLAIN_CFG = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)

# Ulysses SP runs LTX-2 with the family's own plan (spindle/models/ltx2/parallel.py: both streams split); ring not
RING_REFUSED = (
    "its attention processor repeats the text mask per head ([batch, heads, 1, keys]), and Spindle's masked ring "
    "attention takes one key mask for all heads ([batch, 1, 1, keys]); Ulysses SP (parallel.sp / --sp) runs it"
)

FAMILY = DiTFamily(
    name="ltx2",
    checkpoint=DiffusersCheckpoint(
        "LTX2Pipeline", "LTX2VideoTransformer3DModel", detect=_looks_like_ltx2, lora_loader="LTX2LoraLoaderMixin"
    ),
    options=OPTIONS,
    ring_attention_refused=RING_REFUSED,
    demo=decl.demo(
        decl.VIDEO_DEMO,
        size=(64, 64),  # the pipeline takes multiples of 32
        sample_kwargs={**decl.VIDEO_DEMO.sample_kwargs, "audio_guidance_scale": 1.0, **PLAIN_CFG},
    ),
)
