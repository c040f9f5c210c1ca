"""A tiny random LTX-2 pipeline in the diffusers layout (`spindle tiny-model ltx2`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.models.gemma3.tiny import TOKENIZER as GEMMA3_TOKENIZER
from spindle.models.shared.tiny import Overrides, component_overrides, save_seeded_pipeline, seeded
from spindle.models.shared.tiny_llm import save_llm_tokenizer

# the audio-video transformer: a video stream (4 latent channels) and an audio stream (the audio VAE's 2 channels
# x 2 latent mel bins), each attending to its own text connector and to the other stream
LTX2_TRANSFORMER = dict(
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=2,
    qk_norm="rms_norm_across_heads",
    rope_double_precision=False,
    rope_type="split",
)
# x8 spatial (a 4x4 pixel patch, then one spatial+temporal downsampling) and x2 temporal: 64x64x9 -> 8x8x5 latents
LTX2_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(8,),
    decoder_block_out_channels=(8,),
    layers_per_block=(1,),
    decoder_layers_per_block=(1, 1),
    spatio_temporal_scaling=(True,),
    decoder_spatio_temporal_scaling=(True,),
    decoder_inject_noise=(False, False),
    downsample_type=("spatiotemporal",),  # (the encoder compresses time as the decoder expands it)
    upsample_residual=(False,),
    upsample_factor=(1,),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    encoder_causal=True,
    decoder_causal=False,
)
# the mel-spectrogram VAE (16 kHz, hop 160: 25 latent frames a second) and the vocoder (mel -> stereo waveform)
LTX2_AUDIO_VAE = dict(
    base_channels=4,  # = latent channels x latent mel bins: the pipeline normalises the packed latents by it
    output_channels=2,
    # three levels, two 2x downsamplings: the 4x time and mel compression the pipeline assumes (the real VAE's),
    # so that the encoder's latents of a clip's mel spectrogram are the transformer's audio tokens (data.audio)
    ch_mult=(1, 1, 1),
    num_res_blocks=1,
    attn_resolutions=None,
    in_channels=2,
    resolution=32,
    latent_channels=2,
    norm_type="pixel",
    causality_axis="height",
    dropout=0.0,
    mid_block_add_attention=False,
    sample_rate=16000,
    mel_hop_length=160,
    is_causal=True,
    mel_bins=8,
)
LTX2_VOCODER = dict(
    hidden_channels=32,
    out_channels=2,
    # x160 (the mel hop): a waveform of the clip's duration at 16 kHz, as the real vocoder makes
    upsample_kernel_sizes=[16, 10, 8],
    upsample_factors=[8, 5, 4],
    resnet_kernel_sizes=[3],
    resnet_dilations=[[1, 3, 5]],
    leaky_relu_negative_slope=0.1,
    output_sampling_rate=16000,
)
# Gemma 3 (the pipeline stacks every hidden state of the text model: the connectors read layers + 1 of them)
LTX2_TEXT = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=2048,
    sliding_window=8,
)
# its SigLIP tower (Gemma3ForConditionalGeneration has one; LTX-2 never feeds it an image): 8x8 pixels, 2x2 patches
LTX2_VISION = dict(
    hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
)
LTX2_CONNECTORS = dict(
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=8,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=None,
    connector_rope_base_seq_len=32,
    rope_theta=10000.0,
    rope_double_precision=False,
    causal_temporal_positioning=False,
    rope_type="split",
)
# LTX-2's scheduler: the resolution-dependent shift (mu from the video token count)
LTX2_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    base_shift=0.95,
    max_shift=2.05,
    shift_terminal=0.1,
    time_shift_type="exponential",
)


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random LTX-2 text-to-video pipeline (`LTX2Pipeline` layout) to `out`; return its path.

    A Gemma 3 text encoder (`Gemma3ForConditionalGeneration`, with a tiny SigLIP tower as the real one has) and a
    Gemma tokenizer built locally, the text connectors, `AutoencoderKLLTX2Video`, the mel-spectrogram
    `AutoencoderKLLTX2Audio`, the `LTX2Vocoder`, `LTX2VideoTransformer3DModel` and the dynamic-shift scheduler.
    Overrides merge into the defaults (`transformer`, `vae`, `text_encoder`: the Gemma 3 text config).
    """
    from diffusers import LTX2Pipeline

    return save_ltx2_pipeline(LTX2Pipeline, Path(out), seed, overrides)


def save_ltx2_pipeline(pipeline_cls: Any, out: Path, seed: int, overrides: dict[str, Overrides]) -> Path:
    """`pipeline_cls` (LTX2Pipeline, LTX2ImageToVideoPipeline) of the tiny components, saved to `out`."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizerFast

    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    text = {**LTX2_TEXT, **text_encoder}
    save_llm_tokenizer(out / "tokenizer", GEMMA3_TOKENIZER, model_max_length=text["max_position_embeddings"])
    tokenizer = GemmaTokenizerFast.from_pretrained(out / "tokenizer")
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, **ids, **text),
        vision_config=LTX2_VISION,
        mm_tokens_per_image=4,  # (8 / 4)^2 patches
        boi_token_index=0,
        eoi_token_index=0,
        image_token_index=0,
    )
    audio_vae = AutoencoderKLLTX2Audio(**LTX2_AUDIO_VAE)
    layers = text["num_hidden_layers"] + 1  # hidden states: the embeddings and each layer's output
    tcfg = {
        **LTX2_TRANSFORMER,
        "in_channels": {**LTX2_VAE, **vae}["latent_channels"],
        "out_channels": {**LTX2_VAE, **vae}["latent_channels"],
        "audio_in_channels": 4,  # audio latent channels x latent mel bins (2 x 8 / 4)
        "audio_out_channels": 4,
        "caption_channels": text["hidden_size"],
        **transformer,
    }

    def build_vae() -> Any:
        model = AutoencoderKLLTX2Video(**{**LTX2_VAE, **vae}).eval()
        return model

    return save_seeded_pipeline(
        pipeline_cls,
        out,
        seed,
        tokenizer=tokenizer,
        text_encoder=lambda: Gemma3ForConditionalGeneration(config).eval(),
        vae=build_vae,
        transformer=lambda: LTX2VideoTransformer3DModel(**tcfg).eval(),
        audio_vae=seeded(seed + 3, lambda: audio_vae.eval()),
        vocoder=seeded(
            seed + 4,
            lambda: LTX2Vocoder(
                in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, **LTX2_VOCODER
            ),
        ),
        connectors=seeded(
            seed + 5,
            lambda: LTX2TextConnectors(
                caption_channels=text["hidden_size"], text_proj_in_factor=layers, **LTX2_CONNECTORS
            ),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER),
    )
