"""The shared stages check what a family's stage and callbacks hand them: a deliberately broken
family fails with a StageContractError naming the family, the stage and the Req field, before the
broken value reaches diffusers (where it would fail obscurely or, worse, run)."""

from __future__ import annotations

import pytest

from spindle.contracts.request import Req
from spindle.contracts.stage import StageContractError
from spindle.engine_config import EngineConfig
from spindle.infer.pipeline import InferencePipeline, load_components
from spindle.models.flux.inference import FluxBeforeDenoisingStage, FluxInference

KW = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=8, seed=0)


@pytest.fixture(scope="module")
def components(tiny_flux):
    return load_components(tiny_flux, FluxInference(), EngineConfig())


def run(spec, components, **kw):
    from spindle.infer.generator import DiffusionGenerator

    gen = DiffusionGenerator(InferencePipeline.build(spec, components, EngineConfig()))
    return gen.generate(**{**KW, **kw})


def broken_spec(before_forward=None, **callbacks):
    """Flux with one piece broken: `before_forward(req)` edits what its BeforeDenoisingStage leaves."""

    class BrokenStage(FluxBeforeDenoisingStage):
        def forward(self, req: Req) -> Req:
            req = super().forward(req)
            if before_forward is not None:
                before_forward(req)
            return req

    spec_cls = type("BrokenFlux", (FluxInference,), {"before_denoising_cls": BrokenStage, **callbacks})
    return spec_cls()


def test_the_unbroken_family_passes(components):
    assert run(FluxInference(), components).frames.shape == (1, 32, 32, 3)


def drop_negative(req):
    req.negative_prompt_embeds = None


def halve_prompt_batch(req):
    req.prompt_embeds = req.prompt_embeds[:1]


@pytest.mark.parametrize(
    "edit, kw, message",
    [
        (drop_negative, dict(negative_prompt="x", true_cfg_scale=2.0), r"Req\.negative_prompt_embeds as NoneType"),
        (halve_prompt_batch, dict(num_outputs_per_prompt=2), r"Req\.prompt_embeds with shape \(1, 8, 32\); .*batch=2"),
        (lambda req: setattr(req, "timesteps", None), {}, r"Req\.timesteps as None; .*non-empty 1-D tensor"),
        (lambda req: setattr(req, "latents", req.latents.long()), {}, r"Req\.latents as torch\.int64"),
        (
            lambda req: setattr(req, "raw_latent_shape", [1, 4, 16, 16]),
            {},
            r"Req\.raw_latent_shape as \[1, 4, 16, 16\]",
        ),
    ],
    ids=["no_negative_under_cfg", "prompt_batch", "no_timesteps", "int_latents", "raw_shape_list"],
)
def test_broken_before_denoising_names_family_and_field(components, edit, kw, message):
    with pytest.raises(StageContractError, match=r"family 'flux': BrokenStage.* " + message):
        run(broken_spec(edit), components, **kw)


def test_broken_callbacks_name_family_and_field(components):
    def no_unpack(self, latents, req):
        return latents  # forgot to unpack: still [B, tokens, C]

    with pytest.raises(StageContractError, match=r"family 'flux': post_denoising left Req\.latents with shape "
                       r"\(1, 64, 16\); DecodingStage needs the VAE layout Req\.raw_latent_shape=\(1, 4, 16, 16\)"):  # fmt: skip
        run(broken_spec(post_denoising=no_unpack), components)

    def half_image(self, req, latents, t, branch):
        kw = FluxInference.denoiser_kwargs(self, req, latents, t, branch)
        kw["hidden_states"], kw["img_ids"] = kw["hidden_states"][:, :32], kw["img_ids"][:32]
        return kw

    with pytest.raises(StageContractError, match=r"family 'flux': denoiser_kwargs / model_output left Req\.latents "
                       r"predicted with shape \(1, 32, 16\) for latents \(1, 64, 16\)"):  # fmt: skip
        run(broken_spec(denoiser_kwargs=half_image), components)

    def first_only(self, decoded, req):
        return FluxInference.postprocess(self, decoded, req)[:1]

    with pytest.raises(StageContractError, match=r"family 'flux': postprocess left Req\.output with 1 items for a "
                       r"batch of 2"):  # fmt: skip
        run(broken_spec(postprocess=first_only), components, num_outputs_per_prompt=2)
