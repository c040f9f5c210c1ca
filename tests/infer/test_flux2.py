"""FLUX.2 specifics beyond the conformance suite (which runs both `flux2` and `flux2_klein`): the checkpoint's
real `PixtralProcessor` naming, Klein's step-distilled checkpoints (no CFG whatever the guidance), and the
step caches diffusers can and cannot run on Flux2's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.contracts.request import RequestError
from spindle.testing import conformance as suite

CASE = dict(prompt="a red fox in the snow", height=32, width=32, num_inference_steps=2, max_sequence_length=32, seed=3)


@pytest.fixture(scope="module")
def pixtral_named(tmp_path_factory):
    """The tiny FLUX.2-dev with model_index.json naming the tokenizer `PixtralProcessor`, as FLUX.2-dev's does."""
    from spindle.models.flux2.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("flux2") / "pixtral", seed=0, processor=True)


@pytest.fixture(scope="module")
def distilled_klein(tmp_path_factory):
    """A step-distilled Klein (`is_distilled: true` in model_index.json)."""
    from spindle.models.flux2.tiny import build_tiny_klein

    return build_tiny_klein(tmp_path_factory.mktemp("klein") / "distilled", seed=0, distilled=True)


def test_the_real_pixtral_processor_layout_loads_and_equals_the_stock_pipeline(pixtral_named, tiny_checkpoint):
    """A folder naming `PixtralProcessor` (which transformers cannot build without torchvision) generates and
    trains: the engine on it equals the stock pipeline on the same weights (the tokenizer-named tiny folder),
    and the condition model encodes the prompts as that pipeline does."""
    from diffusers import DiffusionPipeline

    from spindle.model_index import read_model_index
    from spindle.models.flux2.condition import Flux2ConditionModel

    assert read_model_index(pixtral_named)["tokenizer"] == ["transformers", "PixtralProcessor"]
    stock_root = tiny_checkpoint("flux2")  # the same seed: the same weights
    kwargs = {**CASE, "max_sequence_length": 64, "guidance_scale": 2.5}
    reference = suite.stock_output(stock_root, kwargs)
    ours = load_generator(pixtral_named).generate(**kwargs).frames
    assert np.abs(ours - reference).max() <= suite.PARITY_ATOL
    condition = Flux2ConditionModel.from_pretrained(pixtral_named, max_text_length=64)
    stock = DiffusionPipeline.from_pretrained(stock_root)
    expected, _ = stock.encode_prompt(prompt=["a red circle"], max_sequence_length=64)
    torch.testing.assert_close(condition.encode_prompts(["a red circle"])["prompt_embeds"], expected, atol=0, rtol=0)


def test_a_distilled_klein_runs_no_cfg_and_equals_the_stock_pipeline(distilled_klein):
    """Flux2KleinPipeline ignores guidance_scale on a step-distilled checkpoint: one forward a step at the default
    guidance 4, equal to the stock pipeline; a negative prompt, which it would ignore, is refused naming why."""
    gen = load_generator(distilled_klein)
    assert gen.defaults.guidance_scale == 4.0
    calls = []
    hook = gen.transformer.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        ours = gen.generate(**CASE).frames
    finally:
        hook.remove()
    assert calls == [1, 1], calls  # no unconditional branch
    assert np.abs(ours - suite.stock_output(distilled_klein, CASE)).max() <= suite.PARITY_ATOL
    with pytest.raises(RequestError, match="step-distilled") as err:
        gen.generate(**CASE, negative_prompt="blurry")
    assert err.value.field == "negative_prompt"


def test_klein_negative_prompt_replaces_the_empty_one(tiny_checkpoint):
    """The base Klein's CFG runs against "" (Flux2KleinPipeline's); a given negative_prompt replaces it."""
    gen = load_generator(tiny_checkpoint("flux2_klein"))
    kwargs = {**CASE, "guidance_scale": 4.0}
    empty = gen.generate(**kwargs).frames
    assert np.array_equal(gen.generate(**kwargs, negative_prompt="").frames, empty)
    assert np.abs(gen.generate(**kwargs, negative_prompt="blurry dark").frames - empty).max() > 1e-3


def test_first_block_cache_is_refused_and_the_other_step_caches_run(tiny_checkpoint):
    """diffusers' first-block cache cannot take Flux2's single-stream tail block: refused naming the caches
    that run; MagCache and TaylorSeer run (TaylorSeer approximates, close to exact)."""
    from spindle.infer import psnr

    root = tiny_checkpoint("flux2_klein")
    with pytest.raises(ValueError, match=r"cache 'fbc' .* use mag, taylorseer or pab"):
        load_generator(root, cache="fbc")
    kwargs = {**CASE, "num_inference_steps": 6}
    exact = load_generator(root).generate(**kwargs).frames
    assert np.array_equal(load_generator(root, cache="mag").generate(**kwargs).frames, exact)  # calibration run
    approx = load_generator(root, cache="taylorseer").generate(**kwargs).frames
    assert 20.0 < psnr(approx, exact) < float("inf")


def test_openai_images_edit_serves_reference_images(tiny_checkpoint):
    """`/v1/images/edits` through the official openai client: FLUX.2 takes the uploads as reference images and
    answers exactly the engine's edit, at the first image's size when the request gives none."""
    import base64
    import io

    from PIL import Image

    from tests.serve.test_serve import live_servers
    from tests.serve.test_serve_i2v import png_bytes
    from tests.serve.test_serve_images import to_uint8

    root = tiny_checkpoint("flux2_klein")
    gen = load_generator(root, device="cpu")
    first, second = png_bytes(0, (64, 80)), png_bytes(1, (72, 64))
    extra = {"num_inference_steps": 2, "seed": 3, "guidance_scale": 2.5}
    with live_servers(gen, root, "tiny-flux2-klein") as start:
        result = (
            start()
            .openai_client()
            .images.edit(
                image=[("a.png", first, "image/png"), ("b.png", second, "image/png")],
                prompt="the red circle to blue",
                response_format="b64_json",
                extra_body=extra,
            )
        )
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))
    assert served.shape == (64, 80, 3)  # the first image's size
    images = [Image.open(io.BytesIO(b)) for b in (first, second)]
    expected = gen.generate(prompt="the red circle to blue", image=images, **extra).frames
    assert np.array_equal(served, to_uint8(expected)[0])


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"sp": 2}, {"ring": 2}, {"cfg_parallel": True}], ids=["sp2", "ring2", "cfg_par"])
def test_klein_edit_on_two_processes_equals_one(options, tiny_checkpoint, tmp_path):
    """Klein's CFG edit with a reference image on 2 torchrun processes (Ulysses SP, ring attention over the
    latents' and the reference's tokens, or the two CFG branches on two ranks) equals one process."""
    from spindle.models.shared.conformance import noise_image
    from spindle.testing.multiprocess import generate_on_ranks

    root = tiny_checkpoint("flux2_klein")
    reference = tmp_path / "reference.png"
    noise_image(64, 80).save(reference)
    kw = dict(prompt="the red circle to blue", image=[str(reference)], num_inference_steps=2, guidance_scale=4.0)
    kw |= dict(seed=2, max_sequence_length=32)
    single = load_generator(root).generate(**kw).frames
    frames, _ = generate_on_ranks(root, options, kw, tmp_path, nproc=2)
    for rank_frames in frames:
        np.testing.assert_allclose(rank_frames, single, atol=suite.PARITY_ATOL, rtol=0)


def test_offload_options_equal_the_plain_run_and_vae_tiling_the_tiled_pipeline(tiny_checkpoint):
    """Block swap and text-encoder offload change nothing; VAE tiling decodes as the stock pipeline with
    `vae.enable_tiling()` (the tiny VAE's 32-pixel tiles: tiled, so not the untiled decode)."""
    from diffusers import DiffusionPipeline

    root = tiny_checkpoint("flux2_klein")
    kw = {**CASE, "height": 64, "width": 80, "guidance_scale": 4.0}
    plain = load_generator(root).generate(**kw).frames
    for options in ({"blocks_to_swap": 1}, {"text_encoder_offload": True}):
        assert np.array_equal(load_generator(root, **options).generate(**kw).frames, plain), options
    tiled = load_generator(root, vae_tiling=True).generate(**kw).frames
    pipe = DiffusionPipeline.from_pretrained(root)
    pipe.vae.enable_tiling()
    stock = {k: v for k, v in kw.items() if k != "seed"}
    reference = pipe(**stock, generator=torch.Generator().manual_seed(kw["seed"]), output_type="np").images
    assert np.abs(tiled - reference).max() <= suite.PARITY_ATOL
    assert np.abs(tiled - plain).max() > 1e-3
