"""Default-on CPU speed-ups of the engine (spindle.infer.speedups): the fused feed-forward Linear + GELU
keeps the transformer's output within float32 rounding, leaves training (grad) and other devices on
the unfused path, and the engine applies it by default but never under `exact` or `compile`."""

from __future__ import annotations

import copy

import pytest
import torch

from spindle.api import load_pipeline
from spindle.infer.speedups import onednn_linear_gelu

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is a CPU build feature")


@pytest.fixture(scope="module")
def flux_transformer(tiny_flux):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer").eval()


def flux_inputs(transformer, batch: int = 2, image_tokens: int = 64, text_tokens: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(batch, image_tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 3.5) if cfg.guidance_embeds else None,
        img_ids=torch.rand(image_tokens, 3, generator=g) * 8,
        txt_ids=torch.zeros(text_tokens, 3),
        return_dict=False,
    )


def test_fused_feed_forward_matches_unfused(flux_transformer):
    from spindle.models.flux.inference import INFERENCE as FLUX_INFERENCE

    fused = copy.deepcopy(flux_transformer)
    count = onednn_linear_gelu(fused, FLUX_INFERENCE.linear_gelu_pairs(fused))
    cfg = flux_transformer.config
    # every double-stream block has two feed-forwards (image, text), every single-stream block one
    assert count == 2 * cfg.num_layers + cfg.num_single_layers
    assert onednn_linear_gelu(fused, FLUX_INFERENCE.linear_gelu_pairs(fused)) == 0  # once only
    inputs = flux_inputs(flux_transformer)
    with torch.no_grad():
        ref = flux_transformer(**inputs)[0]
        out = fused(**inputs)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, ref)  # the fused kernel ran (it rounds differently)


def test_fused_feed_forward_keeps_the_unfused_path_for_training(flux_transformer):
    from spindle.models.flux.inference import INFERENCE as FLUX_INFERENCE

    fused = copy.deepcopy(flux_transformer)
    onednn_linear_gelu(fused, FLUX_INFERENCE.linear_gelu_pairs(fused))
    inputs = flux_inputs(flux_transformer)
    ref = flux_transformer(**inputs)[0]
    out = fused(**inputs)[0]
    assert torch.equal(out, ref)  # with grad: the very ops of the unfused modules
    out.square().mean().backward()
    assert fused.single_transformer_blocks[0].proj_mlp.weight.grad is not None


@pytest.mark.parametrize(
    ("options", "fused"),
    [({}, True), ({"exact": True}, False), ({"fast_mlp": False}, False), ({"compile": True}, False)],
)
def test_engine_fuses_by_default_on_cpu(tiny_flux, options, fused):
    from spindle.engine_config import EngineConfig

    pipeline = load_pipeline(tiny_flux, EngineConfig(device="cpu", **options))
    marked = [m for m in pipeline.transformer.modules() if getattr(m, "_spindle_fused", False)]
    assert bool(marked) is fused
