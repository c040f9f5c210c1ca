"""Inference offload (`spindle.infer.offload`): block swap of the transformer, text encoders on the host,
VAE tiling. Outputs equal the plain run; on CPU host and device are the same memory, so the tests check
the mechanics: each streamed module gets a fresh device copy of its weights for its forward only, at most
two blocks are resident, and everything is back in host memory afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.distributed.blocks import find_blocks
from spindle.infer.offload import ModuleOffload

WAN_REQ = dict(
    prompt="a red circle moves left",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=3,
    guidance_scale=4.0,
    seed=7,
)
FLUX_REQ = dict(prompt="a windmill at sunset", height=32, width=48, num_inference_steps=3, guidance_scale=3.5, seed=21)


def _watch(offload: ModuleOffload, log: list[tuple[int, bool, bool]]) -> None:
    """Record, inside each streamed unit's forward (hooks run in registration order, so after the
    onload), whether its weights are device copies distinct from the host copies, and equal to them."""
    for index, unit in enumerate(offload.units):

        def spy(module, args, index=index):
            pairs = offload.host[index]
            fresh = all(t.data_ptr() != h.data_ptr() for t, h in pairs)
            same = all(torch.equal(t, h) for t, h in pairs)
            log.append((index, fresh, same))

        unit.register_forward_pre_hook(spy)


def _all_on_host(offload: ModuleOffload, allow: set[int]) -> bool:
    return all(
        all(t.data_ptr() == h.data_ptr() for t, h in pairs)
        for index, pairs in enumerate(offload.host)
        if index not in allow
    )


@pytest.mark.parametrize("family, req", [("wan", WAN_REQ), ("flux", FLUX_REQ)], ids=["wan", "flux"])
def test_block_swap_and_text_encoder_offload_equal_the_plain_run(family, req, tiny_checkpoint):
    """The last two blocks streamed (Wan: all; Flux: the two single-stream blocks); one batched
    transformer forward per step (Wan's CFG is batched, Flux's guidance is embedded)."""
    root = tiny_checkpoint(family)
    plain = load_generator(root, device="cpu").generate(**req).frames
    gen = load_generator(root, device="cpu", blocks_to_swap=2, text_encoder_offload=True)
    offloads = gen.pipeline.offloads
    blocks = offloads["transformer"]
    encoders = {k: v for k, v in offloads.items() if k.startswith("text_encoder")}
    assert len(blocks.units) == 2 and set(encoders) == {n for n in gen.pipeline.components if n.startswith("text_")}
    assert all(u is b for u, b in zip(blocks.units, find_blocks(gen.transformer)[-2:], strict=True))
    log: list[tuple[int, bool, bool]] = []
    _watch(blocks, log)
    enc_log: list[tuple[int, bool, bool]] = []
    for enc in encoders.values():
        _watch(enc, enc_log)

    out = gen.generate(**req).frames
    np.testing.assert_allclose(out, plain, atol=1e-5, rtol=0)

    steps = req["num_inference_steps"]
    assert [i for i, _, _ in log] == [0, 1] * steps
    assert all(fresh and same for _, fresh, same in log), "a block ran on its host copy or on other weights"
    assert blocks.onloads == 2 * steps + 1  # + the first block, prefetched for the next request
    assert blocks.max_resident_bytes <= 2 * max(blocks.unit_bytes)
    # after the run: the first streamed block is prefetched for the next request, the rest is on the host
    assert blocks.loaded == {0} and _all_on_host(blocks, allow={0})
    assert enc_log and all(fresh and same for _, fresh, same in enc_log)
    assert all(e.loaded == set() and _all_on_host(e, allow=set()) for e in encoders.values())


def test_block_swap_of_some_blocks_keeps_the_rest_resident(tiny_wan):
    gen = load_generator(tiny_wan, device="cpu", blocks_to_swap=1)
    blocks = find_blocks(gen.transformer)
    swap = gen.pipeline.offloads["transformer"]
    assert swap.units == [blocks[-1]]
    kept = list(blocks[0].parameters())
    ptrs = [p.data_ptr() for p in kept]
    gen.generate(**{**WAN_REQ, "num_inference_steps": 2})
    assert [p.data_ptr() for p in kept] == ptrs, "a resident block was moved"
    assert swap.onloads == 2 and swap.loaded == set()  # one unit: no prefetch, dropped after each forward


def test_module_offload_remove_puts_weights_back():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    want = net(x)
    swap = ModuleOffload(list(net), "cpu")
    torch.testing.assert_close(net(x), want, rtol=0, atol=0)
    swap.remove()
    torch.testing.assert_close(net(x), want, rtol=0, atol=0)
    net(x)
    assert swap.onloads == 3, "hooks still fire after remove()"  # 0, 1, then 0 prefetched again


def test_vae_tiling_equals_diffusers_tiled_decoding(tiny_flux):
    """`vae_tiling` is diffusers' own enable_tiling: the tiny Flux VAE's 32 px tile is smaller than a
    48 px image, so the decode is really tiled and equals FluxPipeline with `vae.enable_tiling()`."""
    from diffusers import FluxPipeline

    req = {**FLUX_REQ, "height": 48, "width": 48}
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    kw = {k: v for k, v in req.items() if k != "seed"}
    ref = pipe(**kw, generator=torch.Generator().manual_seed(req["seed"]), output_type="np").images
    gen = load_generator(tiny_flux, device="cpu", vae_tiling=True)
    assert gen.pipeline.components["vae"].use_tiling
    out = gen.generate(**req).frames
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    untiled = load_generator(tiny_flux, device="cpu").generate(**req).frames
    assert np.abs(untiled - out).max() > 1e-4, "the decode was not tiled"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(blocks_to_swap=-1), r"blocks_to_swap must be >= 0; got -1"),
        (dict(blocks_to_swap=9), r"blocks_to_swap=9: WanTransformer3DModel has 2 blocks; use 1\.\.2"),
        (dict(blocks_to_swap=1, compile=True), r"blocks_to_swap cannot be combined with compile"),
        (dict(vae_tiling="yes"), r"vae_tiling: input should be a valid boolean; got .yes."),
    ],
)
def test_bad_offload_options_name_the_option(options, message, tiny_wan):
    with pytest.raises(ValueError, match=message):
        load_generator(tiny_wan, device="cpu", **options)


@pytest.mark.parametrize("family", ["flux2", "z_image", "hunyuan_video_1_5", "ltx2"])
def test_the_wave_two_families_offload_to_the_plain_run(family, tiny_checkpoint):
    """Block swap (the last two blocks streamed) and text encoders on the host give the plain run's output on the
    newer families too (FLUX.2's Mistral encoder, Z-Image's Qwen3, HunyuanVideo-1.5's two encoders, LTX-2's Gemma 3
    with its audio track), on the family's first parity case."""
    from spindle.testing.specs import dit_spec

    spec = dit_spec(family)
    assert spec is not None
    req = dict(next(iter(spec.parity_cases.values())))
    root = tiny_checkpoint(family)
    plain = load_generator(root, device="cpu").generate(**req)
    gen = load_generator(root, device="cpu", blocks_to_swap=2, text_encoder_offload=True)
    assert len(gen.pipeline.offloads["transformer"].units) == 2
    out = gen.generate(**req)
    np.testing.assert_allclose(out.frames, plain.frames, atol=1e-5, rtol=0)
    if plain.audio is not None:
        np.testing.assert_allclose(out.audio, plain.audio, atol=1e-5, rtol=0)
