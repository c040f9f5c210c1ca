"""Ring attention with a key mask (Qwen-Image's text padding) on real processes (spawned, gloo) equals
single-process SDPA with the same mask: the output and the gradients of q, k and v.

The masks leave every KV chunk of some batch element fully masked for every query (the first chunk a
rank visits included: diffusers' own ring merge turns that into NaN), with bool and additive masks.
One spawn per world size runs every case; rank 0 saves what it gathered, the tests compare.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.testing.multiprocess import spawn

B, S, H, D = 2, 16, 4, 8  # 16 keys: chunks of 8 (2 ranks) or 4 (4 ranks)
SCALE = 0.3


def bool_mask(world: int) -> torch.Tensor:
    """[B, 1, 1, S]: sample 0 has its first rank's keys all masked, sample 1 its last rank's; a few
    more keys masked here and there."""
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    chunk = S // world
    mask[0, ..., :chunk] = False
    mask[1, ..., S - chunk :] = False
    mask[0, ..., S - 1] = False
    mask[1, ..., 1] = False
    return mask


def cases(world: int) -> dict[str, torch.Tensor]:
    mask = bool_mask(world)
    additive = torch.zeros(B, 1, 1, S).masked_fill(~mask, float("-inf"))
    additive[:, ..., 2] = -1.5  # a finite bias too
    return {"bool": mask, "additive": additive, "bool_2d": mask[:, 0, 0]}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(B, S, H, D, generator=g) for n in ("q", "k", "v", "w")}  # [B, S, H, D]


def reference(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    x = inputs()
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    m = mask[:, None, None, :] if mask.ndim == 2 else mask
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), m, scale=SCALE)
    out = out.transpose(1, 2)
    (out * x["w"]).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def stock_ring(x: dict[str, torch.Tensor], mask: torch.Tensor, lo: int, hi: int, config) -> torch.Tensor:
    """Canary: diffusers' own ring (forward), with a forward op that does take masks, still gives every KV
    chunk the local mask (and NaN after a fully masked first chunk); when it does not, ours may go."""
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    from spindle.ops.ring_attention import block_forward

    def masked_op(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  return_lse=False, _save_ctx=True, _parallel_config=None):  # fmt: skip
        return block_forward(q, k, v, attn_mask, scale)

    stock = _templated_context_parallel_attention(
        *(x[n][:, lo:hi] for n in "qkv"), mask[..., lo:hi], scale=SCALE, forward_op=masked_op, backward_op=None,
        _parallel_config=config,
    )  # fmt: skip
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stock)
    return torch.cat(gathered, dim=1)


def _worker(rank: int, world: int, ring: int, out_dir: str) -> None:
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from spindle.distributed.context_parallel import install_sequence_parallel_backend, sequence_parallel_config
    from spindle.distributed.mesh import ParallelDims, build_mesh

    install_sequence_parallel_backend()
    mesh = build_mesh(ParallelDims(dp_shard=1, sp=world // ring, ring=ring))
    config = sequence_parallel_config(mesh.cp)
    x = inputs()
    lo, hi = rank * S // world, (rank + 1) * S // world  # the _cp_plan's split: flat rank order
    results = {}
    for name, mask in cases(world).items():
        q, k, v = (x[n][:, lo:hi].clone().requires_grad_() for n in "qkv")
        out = dispatch_attention_fn(q, k, v, attn_mask=mask[..., lo:hi], scale=SCALE, parallel_config=config)
        (out * x["w"][:, lo:hi]).sum().backward()
        local = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        results[name] = {n: torch.cat([g[n] for g in gathered], dim=1) for n in local}
    if world == ring:
        results["stock_ring_out"] = stock_ring(x, cases(world)["bool"], lo, hi, config)
    try:  # a per-query mask cannot be split over the ring: a clear error
        q = x["q"][:, lo:hi]
        dispatch_attention_fn(q, q, q, attn_mask=torch.ones(B, 1, hi - lo, hi - lo, dtype=torch.bool),
                              parallel_config=config)  # fmt: skip
        results["per_query_error"] = ""
    except ValueError as e:
        results["per_query_error"] = str(e)
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def run(world: int, ring: int, tmp_path: Path) -> dict:
    spawn(_worker, world, ring, str(tmp_path))
    return torch.load(tmp_path / "results.pt", weights_only=False)


def assert_equals_sdpa(results: dict, world: int) -> None:
    for name, mask in cases(world).items():
        ref = reference(mask)
        for what in ("out", "q", "k", "v"):
            got = results[name][what]
            assert torch.isfinite(got).all(), f"{name}: {what} has NaN/inf"
            torch.testing.assert_close(got, ref[what], rtol=1e-5, atol=1e-5, msg=f"{name} mask: {what}")
    assert "key mask of shape [batch, 1, 1, local keys]" in results["per_query_error"]
    assert "parallel.ring: 1" in results["per_query_error"]


@pytest.mark.slow
def test_masked_ring_on_two_processes_equals_sdpa(tmp_path):
    """ring=2: each rank's queries against both KV chunks, each chunk with its own slice of the mask."""
    results = run(2, 2, tmp_path)
    assert_equals_sdpa(results, 2)
    stock, expected = results["stock_ring_out"], reference(cases(2)["bool"])["out"]
    assert not torch.allclose(stock, expected, rtol=1e-3, atol=1e-3), (
        "diffusers' TemplatedRingAttention now handles key masks: consider dropping Spindle's masked ring"
    )


@pytest.mark.slow
def test_masked_ring_times_ulysses_on_four_processes_equals_sdpa(tmp_path):
    """sp=2 x ring=2 (USP): Ulysses all-to-all, then the masked ring over the gathered sequences."""
    assert_equals_sdpa(run(4, 2, tmp_path), 4)


def test_block_math_of_a_fully_masked_block_is_zero_not_nan():
    """One KV block whose keys are all masked for a query: out 0, lse -inf, gradients 0 (no NaN);
    merged with another block it leaves that block's result unchanged."""
    from spindle.ops.ring_attention import block_backward, block_forward, merge_blocks

    x = inputs()
    q, k, v = (x[n][:, :4] for n in "qkv")
    mask = torch.zeros(B, 1, 1, 4, dtype=torch.bool)
    out, lse = block_forward(q, k, v, mask, SCALE)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == float("-inf")).all()
    other = block_forward(q, k, v, None, SCALE)
    for merged, expected in zip(merge_blocks(out, lse, *other), other, strict=True):
        torch.testing.assert_close(merged, expected, rtol=0, atol=0)
    for merged, expected in zip(merge_blocks(*other, out, lse), other, strict=True):
        torch.testing.assert_close(merged, expected, rtol=0, atol=0)
    grads = block_backward(q, k, v, other[0], x["w"][:, :4], other[1], mask, SCALE)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_ring_block_ops_per_device():
    """Which per-block ops the ring runs: diffusers' cuDNN ring ops for CUDA half precision (its own
    ring-capable backend), Spindle's elsewhere; and the fp32 block math Spindle's forward op uses off
    CPU equals the CPU flash kernel it uses on CPU (out and log-sum-exp)."""
    from types import SimpleNamespace

    from diffusers.models import attention_dispatch as ad

    from spindle.distributed import context_parallel as cp

    cuda_bf16 = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)  # no GPU here: only the choice
    assert cp._ring_ops(cuda_bf16) == (ad._cudnn_attention_forward_op, ad._cudnn_attention_backward_op)
    for device, dtype in (("cuda", torch.float32), ("cpu", torch.float32), ("cpu", torch.bfloat16)):
        query = SimpleNamespace(device=torch.device(device), dtype=dtype)
        assert cp._ring_ops(query) == (cp._ring_forward_op, cp._ring_backward_op)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, 3, 8, generator=g) for _ in range(3))  # [B, S, H, D]
    out, lse = cp._ring_forward_op(SimpleNamespace(save_for_backward=lambda *t: None), q, k, v, scale=0.3,
                                   return_lse=True)  # fmt: skip
    block_out, block_lse = cp.block_forward(q, k, v, None, 0.3)
    torch.testing.assert_close(block_out, out, atol=1e-5, rtol=0)
    torch.testing.assert_close(block_lse, lse, atol=1e-5, rtol=0)
