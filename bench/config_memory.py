"""Training-state memory per rank of each shipped real-size config (configs/*.yaml other than *_tiny.yaml).

The real checkpoints are not here, so each model is built on the meta device from its published
config.json, whose numbers (hidden size, layers, heads, experts, towers) are written in `REAL` below,
with the same code a run builds it with: diffusers' `from_config` through `transformer_from_config` for a
DiT, the family's transformers class (`family.model_cls()`) for a language, vision-language or omni model.
The config's `train.lora` is applied by the flow-matching task's `add_lora`, `train.freeze` by the family's
parts, and frozen weights are stored as `train.frozen_dtype: auto` stores them under bf16 (`store_frozen`).
The (trainable, frozen bytes) counts then go through `spindle.train.memory.state_memory_per_rank`, the
function the start-of-run summary prints ("training state: ..."), for the GPU count the config's header
comment states. The figure covers weights, gradients and AdamW state of the trained model (and an EMA when
configured), sharded by FSDP2; not activations, the transient all-gathered blocks, nor the text encoder,
VAE or image encoder a DiT task keeps beside it.

Each real-size config states the figure in a comment line, checked by tests/project/test_configs.py:

  # memory: 28.1 GB per rank on 8 GPUs (... what it covers ...)

  python bench/config_memory.py            # one line per config
  python bench/config_memory.py --check    # exit 1 when a config's comment differs from the estimate
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spindle.config import LoraConfig, load_raw
from spindle.contracts.family import DiTFamily
from spindle.distributed.mesh import ParallelDims
from spindle.registry import family_names, get_family
from spindle.train.memory import StateMemory, frozen_parameter_bytes, state_memory_per_rank
from spindle.train.precision import store_frozen

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# the line each real-size config carries; the test and --check compare its two numbers with the estimate
MEMORY_COMMENT = re.compile(r"^# memory: (?P<gb>\d+\.\d) GB per rank on (?P<gpus>\d+) GPUs\b", re.MULTILINE)


@dataclass(frozen=True)
class Real:
    """A published checkpoint: its Hugging Face id and its config.json (the trained component's, for a
    diffusers pipeline; the whole model's for transformers)."""

    repo: str
    config: dict[str, Any]


# --- diffusers transformers (transformer/config.json) -------------------------------------------------
WAN_14B = dict(
    _class_name="WanTransformer3DModel",
    patch_size=[1, 2, 2],
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
# HunyuanVideo-1.5 480p text-to-video (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v): 8.3B, 54 blocks
HUNYUAN_VIDEO_1_5_480P_T2V = dict(
    _class_name="HunyuanVideo15Transformer3DModel",
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_axes_dim=[16, 56, 56],
    target_size=640,
    task_type="t2v",
)
# LTX-2 (Lightricks/LTX-2): 19B, 48 audio-video blocks (video 32 x 128 heads, audio 32 x 64), Gemma 3 12B captions
LTX2_19B = dict(
    _class_name="LTX2VideoTransformer3DModel",
    in_channels=128,
    out_channels=128,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    num_layers=48,
    caption_channels=3840,
)
WAN_1_3B = dict(WAN_14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
# Wan2.1 I2V: 36 input channels (noise + mask + first-frame latents) and CLIP image tokens (image_dim 1280)
WAN_I2V_14B = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# Wan2.2 A14B: two experts of this shape (transformer, transformer_2); a run trains one (train.expert)
WAN22_I2V_A14B = dict(WAN_14B, in_channels=36)
WAN22_TI2V_5B = dict(WAN_14B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
FLUX_DEV = dict(
    _class_name="FluxTransformer2DModel",
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=[16, 56, 56],
)
# FLUX.2-dev (32B): diffusers' Flux2Transformer2DModel defaults are its config; text width 3 x Mistral Small's 5120
FLUX2_DEV = dict(
    _class_name="Flux2Transformer2DModel",
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[32, 32, 32, 32],
    rope_theta=2000,
    guidance_embeds=True,
)
# FLUX.2 [klein] 4B (base and distilled): no guidance embedding, text width 3 x Qwen3-4B's 2560
FLUX2_KLEIN_4B = dict(
    FLUX2_DEV,
    num_layers=5,
    num_single_layers=20,
    num_attention_heads=24,
    joint_attention_dim=7680,
    guidance_embeds=False,
)
QWEN_IMAGE = dict(
    _class_name="QwenImageTransformer2DModel",
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=[16, 56, 56],
)
# Tongyi-MAI/Z-Image-Turbo's transformer/config.json
Z_IMAGE = dict(
    _class_name="ZImageTransformer2DModel",
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    qk_norm=True,
    cap_feat_dim=2560,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)

# --- transformers (config.json) ----------------------------------------------------------------------
QWEN2_5_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN2_5_VL_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_chans=3,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)
QWEN3_VL_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
QWEN3_30B_A3B_TEXT = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    vocab_size=151936,
    tie_word_embeddings=False,
)
# Moonlight-16B-A3B's config.json: DeepSeek-V3's architecture (model_type deepseek_v3) at 16B, MLA without a
# query low-rank projection, one dense layer then 26 MoE layers of 64 routed experts (top-6) and 2 shared ones
MOONLIGHT_16B_A3B = dict(
    model_type="deepseek_v3",
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    vocab_size=163840,
    tie_word_embeddings=False,
)
# gpt-oss-20b's config.json (model_type gpt_oss): 24 layers alternating sliding-window (128) and full attention,
# 64 query / 8 key-value heads of 64 with a sink each, every layer a MoE of 32 biased experts (top-4); its experts
# are stored in MXFP4 and train dequantised (fp32 master weights like every other parameter)
GPT_OSS_20B = dict(
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    vocab_size=201088,
    tie_word_embeddings=False,
)
WHISPER_LIKE_AUDIO = dict(
    d_model=1280,
    encoder_layers=32,
    encoder_attention_heads=20,
    encoder_ffn_dim=5120,
    num_mel_bins=128,
)

REAL: dict[str, Real] = {
    "flux_dev.yaml": Real("black-forest-labs/FLUX.1-dev", FLUX_DEV),
    "flux_kontext_dev.yaml": Real("black-forest-labs/FLUX.1-Kontext-dev", FLUX_DEV),
    "flux2_dev.yaml": Real("black-forest-labs/FLUX.2-dev", FLUX2_DEV),
    "flux2_klein_4b.yaml": Real("black-forest-labs/FLUX.2-klein-base-4B", FLUX2_KLEIN_4B),
    "qwenimage_20b.yaml": Real("Qwen/Qwen-Image", QWEN_IMAGE),
    "qwenimage_edit_20b.yaml": Real("Qwen/Qwen-Image-Edit", QWEN_IMAGE),
    "qwenimage_edit_plus_20b.yaml": Real("Qwen/Qwen-Image-Edit-2509", QWEN_IMAGE),
    "z_image_turbo.yaml": Real("Tongyi-MAI/Z-Image-Turbo", Z_IMAGE),
    "hunyuan_video_1_5_480p_t2v.yaml": Real(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", HUNYUAN_VIDEO_1_5_480P_T2V
    ),
    "hunyuan_video_1_5_i2v_480p.yaml": Real(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v", dict(HUNYUAN_VIDEO_1_5_480P_T2V, task_type="i2v")
    ),
    "ltx2_19b.yaml": Real("Lightricks/LTX-2", LTX2_19B),
    "ltx2_i2v_19b.yaml": Real("Lightricks/LTX-2", LTX2_19B),
    "wan_1.3b.yaml": Real("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", WAN_1_3B),
    "wan_i2v_14b.yaml": Real("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", WAN_I2V_14B),
    "wan22_a14b.yaml": Real("Wan-AI/Wan2.2-T2V-A14B-Diffusers", WAN_14B),
    "wan22_i2v_a14b.yaml": Real("Wan-AI/Wan2.2-I2V-A14B-Diffusers", WAN22_I2V_A14B),
    "wan22_ti2v_5b.yaml": Real("Wan-AI/Wan2.2-TI2V-5B-Diffusers", WAN22_TI2V_5B),
    "llama_3.2_1b.yaml": Real(
        "meta-llama/Llama-3.2-1B-Instruct",
        dict(
            model_type="llama",
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_0.6b.yaml": Real(
        "Qwen/Qwen3-0.6B",
        dict(
            model_type="qwen3",
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_1b.yaml": Real(
        "google/gemma-3-1b-it",
        dict(
            model_type="gemma3_text",
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            query_pre_attn_scalar=256,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_5_7b.yaml": Real(
        "Qwen/Qwen2.5-7B-Instruct", dict(QWEN2_5_7B_TEXT, model_type="qwen2", max_position_embeddings=32768)
    ),
    "qwen3_moe_30b_a3b.yaml": Real("Qwen/Qwen3-30B-A3B", dict(QWEN3_30B_A3B_TEXT, model_type="qwen3_moe")),
    "deepseek_v3_moonlight_16b_a3b.yaml": Real("moonshotai/Moonlight-16B-A3B", MOONLIGHT_16B_A3B),
    "gpt_oss_20b.yaml": Real("openai/gpt-oss-20b", GPT_OSS_20B),
    # gemma-3-4b-it's config.json: a SigLIP tower (896 pixels in 14-pixel patches, pooled to 256 soft tokens) and
    # a 34-layer decoder of five sliding-window (1024) layers per global one
    "gemma3_vl_4b.yaml": Real(
        "google/gemma-3-4b-it",
        dict(
            model_type="gemma3",
            text_config=dict(
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=34,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=1024,
                vocab_size=262208,
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=256,
            boi_token_index=255999,
            eoi_token_index=256000,
            image_token_index=262144,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_5_vl_7b.yaml": Real(
        "Qwen/Qwen2.5-VL-7B-Instruct",
        dict(model_type="qwen2_5_vl", text_config=QWEN2_5_7B_TEXT, vision_config=QWEN2_5_VL_VISION),
    ),
    "qwen3_vl_8b.yaml": Real(
        "Qwen/Qwen3-VL-8B-Instruct",
        dict(
            model_type="qwen3_vl",
            text_config=dict(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
            ),
            vision_config=dict(QWEN3_VL_VISION, out_hidden_size=4096),
            tie_word_embeddings=False,
        ),
    ),
    # transformers' own Qwen3_5Config defaults ("a Qwen3.5-9B style configuration"): 3 of every 4 layers Gated
    # DeltaNet (16 key / 32 value heads of 128), the 4th full attention (16 heads, 4 KV, head_dim 256)
    "qwen3_5_9b.yaml": Real(
        "Qwen/Qwen3.5-9B",
        dict(
            model_type="qwen3_5",
            text_config=dict(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=32,
                num_attention_heads=16,
                num_key_value_heads=4,
                head_dim=256,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                vocab_size=248320,
            ),
            vision_config=dict(
                {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}, out_hidden_size=4096
            ),
            tie_word_embeddings=False,
        ),
    ),
    # transformers' own Qwen3_5MoeConfig defaults (its docstring's checkpoint, Qwen/Qwen3.5-35B-A3B): 40 hybrid
    # layers, each with 256 routed experts (top 8) and a gated shared expert
    "qwen3_5_moe_35b_a3b.yaml": Real(
        "Qwen/Qwen3.5-35B-A3B",
        dict(
            model_type="qwen3_5_moe",
            text_config=dict(
                hidden_size=2048,
                num_hidden_layers=40,
                num_attention_heads=16,
                num_key_value_heads=2,
                head_dim=256,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
                num_experts_per_tok=8,
                num_experts=256,
                vocab_size=248320,
            ),
            vision_config=dict(
                {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}, out_hidden_size=2048
            ),
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_vl_moe_30b_a3b.yaml": Real(
        "Qwen/Qwen3-VL-30B-A3B-Instruct",
        dict(
            model_type="qwen3_vl_moe",
            text_config=QWEN3_30B_A3B_TEXT,
            vision_config=dict(QWEN3_VL_VISION, out_hidden_size=2048),
            tie_word_embeddings=False,
        ),
    ),
    # omni: only the thinker trains (and is counted); the talker and code2wav are copied to the export
    "qwen2_5_omni_7b.yaml": Real(
        "Qwen/Qwen2.5-Omni-7B",
        dict(
            model_type="qwen2_5_omni",
            thinker_config=dict(
                text_config=QWEN2_5_7B_TEXT,
                vision_config=dict({k: v for k, v in QWEN2_5_VL_VISION.items() if k != "in_chans"}, in_channels=3),
                audio_config=dict(WHISPER_LIKE_AUDIO, output_dim=3584),
            ),
        ),
    ),
    "qwen3_omni_moe_30b_a3b.yaml": Real(
        "Qwen/Qwen3-Omni-30B-A3B-Instruct",
        dict(
            model_type="qwen3_omni_moe",
            thinker_config=dict(
                text_config=dict(QWEN3_30B_A3B_TEXT, vocab_size=152064),
                vision_config=dict(QWEN3_VL_VISION, out_hidden_size=2048),
                audio_config=dict(WHISPER_LIKE_AUDIO, output_dim=2048, downsample_hidden_size=480),
            ),
        ),
    ),
}


def is_real_size(path: Path) -> bool:
    return not path.stem.endswith("_tiny")


def family_of_config(path: Path) -> str:
    """The longest registered family name the file name starts with (qwen3_moe_tiny -> qwen3_moe)."""
    names = [n for n in family_names() if path.stem.startswith(n + "_")]
    if not names:
        raise ValueError(f"{path.name}: name it <family>_<what>.yaml with a family of {family_names()}")
    return max(names, key=len)


def build_model(family: Any, real: Real, train: dict[str, Any]) -> torch.nn.Module:
    """The model a run of `family` with this `train:` section trains, on the meta device, from `real`'s
    config.json written into a scratch checkpoint folder: LoRA applied, frozen parts frozen, frozen
    weights stored as bf16 runs store them."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if isinstance(family, DiTFamily):
            from spindle.export.diffusers import transformer_from_config
            from spindle.train.tasks.flow_matching import add_lora

            (root / "transformer").mkdir()
            (root / "transformer" / "config.json").write_text(json.dumps(real.config))
            model = transformer_from_config(root, "transformer")
            if train.get("lora") is not None:
                with torch.device("meta"):  # the adapters' shapes are all the count needs (no values drawn)
                    add_lora(model, LoraConfig(**train["lora"]))
        else:
            from transformers import AutoConfig
            from transformers.utils import logging as hf_logging

            from spindle.distributed.sharded_load import empty_weights

            # written by the config class, as the published config.json was (every field of every part); the
            # defaults of the parts a run never builds (an omni talker) draw warnings that mean nothing here
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                AutoConfig.for_model(**real.config).save_pretrained(root)
                cls: Any = family.model_cls()
                config = cls.config_class.from_pretrained(root)
            finally:
                hf_logging.set_verbosity(verbosity)
            with empty_weights():
                model = cls._from_config(config, dtype=torch.float32)
            model.tie_weights()
            if train.get("lora") is not None:
                raise NotImplementedError("bench/config_memory.py counts no language-model LoRA; add it here")
            frozen = set(train.get("freeze") or ())
            for name, param in model.named_parameters():
                if frozen and family.part_of(name) in frozen:  # VLM / omni parts
                    param.requires_grad_(False)
    store_frozen(model, torch.bfloat16)  # train.frozen_dtype auto under mixed_precision bf16
    return model


def stated_gpus(path: Path) -> int:
    m = MEMORY_COMMENT.search(path.read_text())
    if m is None:
        raise ValueError(f"{path.name}: no '# memory: X GB per rank on N GPUs' line")
    return int(m.group("gpus"))


def estimate(path: Path, gpus: int | None = None) -> StateMemory:
    """The training-state memory per rank of the real-size config at `path` on `gpus` GPUs (default: the
    count its memory comment states)."""
    raw = load_raw(path)
    family = get_family(family_of_config(path))
    if path.name not in REAL:
        raise KeyError(f"{path.name}: add its checkpoint's config.json numbers to REAL in bench/config_memory.py")
    train = raw.get("train", {})
    if train.get("mixed_precision", "auto") not in ("bf16", "auto") or train.get("frozen_dtype", "auto") != "auto":
        raise ValueError(f"{path.name}: the estimate assumes bf16 compute and frozen_dtype auto")
    model = build_model(family, REAL[path.name], train)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dims = ParallelDims(**raw.get("parallel", {})).resolve(gpus if gpus is not None else stated_gpus(path))
    return state_memory_per_rank(
        trainable, frozen_parameter_bytes(model), dims.fsdp_size, ema=train.get("ema") is not None
    )


def real_size_configs() -> list[Path]:
    return sorted(p for p in CONFIGS.glob("*.yaml") if is_real_size(p))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a config's memory comment differs")
    args = parser.parse_args(argv)
    wrong = []
    for path in real_size_configs():
        gpus = stated_gpus(path)
        memory = estimate(path, gpus)
        stated = float(MEMORY_COMMENT.search(path.read_text()).group("gb"))  # type: ignore[union-attr]
        flag = "" if f"{memory.total_gb:.1f}" == f"{stated:.1f}" else f"  (comment says {stated})"
        print(f"{path.name}: {REAL[path.name].repo}, {gpus} GPUs: {memory.describe()}{flag}")
        if flag:
            wrong.append(path.name)
    return 1 if args.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
