"""Vision-tower sequence parallelism (spindle/distributed/vision_sequence_parallel.py) on 2 real processes
(gloo): each rank's blocks see half the patches, and the tower's merged output and every parameter's
gradient (summed over the SP ranks) equal the one-process tower's, for each VLM family's vision tower
(Qwen2.5-VL's windows and full-attention blocks, Qwen3-VL's deepstack mergers). The whole training path is
tests/conformance/test_vlm_conformance.py (sp2: loss, grad norm and weights equal one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.distributed.vision_sequence_parallel import VisionSequenceParallel
from spindle.registry import all_families
from spindle.testing.multiprocess import spawn

FAMILIES = sorted(f.name for f in all_families() if f.kind == "vlm")


def tower_outputs(model_path: str, sp: bool) -> dict[str, torch.Tensor]:
    """The vision tower's merged (and deepstack) outputs on a 2-image batch, and its parameter gradients
    for a fixed random projection of them; with `sp`, the hooks on and the block inputs' lengths recorded."""
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText

    from spindle.distributed.vision_sequence_parallel import enable_vision_sequence_parallel

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    tower = model.model.visual
    config = tower.config
    merge = config.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 3 * merge], [1, merge, 2 * merge]])
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(0))
    lengths: list[int] = []
    if sp:
        enable_vision_sequence_parallel(tower, dist.group.WORLD, dist.get_rank(), dist.get_world_size())
        tower.blocks[-1].register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[0]))
    out = tower(pixels, grid_thw=grid)
    features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    g = torch.Generator().manual_seed(1)
    loss = sum((f * torch.randn(f.shape, generator=g)).sum() for f in features)
    if sp:
        # every rank holds the whole output and the same loss: each back-propagates its share, as in training
        # (where each rank's language model takes its own chunk of the vision embeddings), so the ranks'
        # gradients sum to the sample's
        loss = loss / dist.get_world_size()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}
    if sp:
        for grad in grads.values():
            dist.all_reduce(grad)  # each rank holds its patches' part: the sample's gradient is the sum
    result = {f"out{i}": f.detach() for i, f in enumerate(features)}
    result.update({f"grad:{n}": v for n, v in grads.items()})
    result["block_rows"] = torch.tensor(lengths or [pixels.shape[0]])
    return result


def _worker(rank: int, world: int, models: dict[str, str], out: str) -> None:
    results = {name: tower_outputs(path, sp=True) for name, path in models.items()}
    if rank == 0:
        torch.save(results, Path(out) / "sp.pt")


@pytest.fixture(scope="module")
def results(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision_sp")
    models = {name: str(tiny_checkpoint(name)) for name in FAMILIES}
    spawn(_worker, 2, models, str(out))
    sp = torch.load(out / "sp.pt")
    return {name: (tower_outputs(path, sp=False), sp[name]) for name, path in models.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_each_run_half_the_patches_and_equal_one_process(results, name):
    one, two = results[name]
    assert int(two["block_rows"][0]) * 2 == int(one["block_rows"][0])  # each rank's blocks: half the patches
    assert one.keys() == two.keys()
    for key in one:
        if key != "block_rows":
            torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_split_pads_the_last_chunks():
    """A sequence the SP size does not divide: equal chunks, zero rows after the end (dropped on gather)."""
    rows = torch.arange(6.0).unsqueeze(1)
    chunks = []
    for rank in range(4):
        state = VisionSequenceParallel(None, rank, 4)  # type: ignore[arg-type]  # split needs no group
        state.length = 6
        chunks.append(state.split(rows))
    assert [c.flatten().tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5], [0, 0]]
