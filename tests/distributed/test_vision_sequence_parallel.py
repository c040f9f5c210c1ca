"""Vision-tower sequence parallelism (spindle/distributed/vision_sequence_parallel.py) on real processes
(gloo): the tower's merged (and deepstack) outputs and every parameter's gradient (summed over the SP ranks)
equal the one-process tower's, for each VLM family's vision tower (Qwen2.5-VL's windows and full-attention
blocks, Qwen3-VL's deepstack mergers), on both attention paths:
- Ulysses (the default): each rank's blocks, qkv projections included, see only its chunk of the patches;
- gather (the fallback): the attention's projections run on the whole sequence on every rank.
On 3 ranks the 32 patches are not divisible by sp (the last chunk padded): a 3-headed tower runs Ulysses,
the families' 2-headed ones fall back to gather. The whole training path is
tests/conformance/test_vlm_conformance.py (sp2: loss, grad norm and weights equal one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.distributed.vision_sequence_parallel import VisionSequenceParallel
from spindle.registry import all_families
from spindle.testing.multiprocess import spawn

# the patch-grid towers (Qwen-VL's), whose patches SP splits; Gemma 3's fixed-size SigLIP images (its own `images`
# layout) are never split: Ulysses SP is refused for it (its bidirectional image blocks)
FAMILIES = sorted(f.name for f in all_families() if f.kind == "vlm" and f.images is None)
PATCHES = 32  # the two images of `tower_outputs`
# (family, vision config overrides, sp, requested attention path, the path it must take)
CASES = [
    *((name, {}, 2, path, path) for name in FAMILIES for path in ("ulysses", "gather")),
    *((name, {"hidden_size": 48, "num_heads": 3}, 3, "ulysses", "ulysses") for name in ("qwen2_5_vl", "qwen3_vl")),
    *((name, {}, 3, "ulysses", "gather") for name in ("qwen2_5_vl", "qwen3_vl")),  # 2 heads over 3 ranks
]


def case_id(case: tuple) -> str:
    name, vision, sp, asked, _ = case
    return f"{name}-sp{sp}-{asked}" + ("-3heads" if vision else "")


def tower_outputs(model_path: str, vision: dict, sp: int, attention: str | None) -> dict[str, torch.Tensor]:
    """The vision tower's merged (and deepstack) outputs on a 2-image batch, and its parameter gradients
    for a fixed random projection of them; with `attention`, SP on over the world and the rows each block
    and each qkv projection saw recorded, and the path taken."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForImageTextToText

    from spindle.distributed.vision_sequence_parallel import enable_vision_sequence_parallel

    if vision:  # a seeded tower of another shape, built the same in every process
        config = AutoConfig.from_pretrained(model_path)
        for key, value in vision.items():
            setattr(config.vision_config, key, value)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    tower = model.model.visual
    config = tower.config
    merge = config.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 3 * merge], [1, merge, 2 * merge]])
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(0))
    assert pixels.shape[0] == PATCHES
    block_rows: list[int] = []
    qkv_rows: list[int] = []
    path = "none"
    if attention:
        state = enable_vision_sequence_parallel(tower, dist.group.WORLD, dist.get_rank(), sp, attention=attention)
        path = state.attention
        tower.blocks[-1].register_forward_pre_hook(lambda m, args: block_rows.append(args[0].shape[0]))
        for block in tower.blocks:
            block.attn.qkv.register_forward_pre_hook(lambda m, args: qkv_rows.append(args[0].shape[0]))
    out = tower(pixels, grid_thw=grid)
    features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    g = torch.Generator().manual_seed(1)
    loss = sum((f * torch.randn(f.shape, generator=g)).sum() for f in features)
    if attention:
        # every rank holds the whole output and the same loss: each back-propagates its share, as in training
        # (where each rank's language model takes its own chunk of the vision embeddings), so the ranks'
        # gradients sum to the sample's
        loss = loss / sp
    loss.backward()
    grads = {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}
    if attention:
        for grad in grads.values():
            dist.all_reduce(grad)  # each rank holds its patches' part: the sample's gradient is the sum
    result: dict[str, object] = {f"out{i}": f.detach() for i, f in enumerate(features)}
    result.update({f"grad:{n}": v for n, v in grads.items()})
    result["rows"] = (block_rows, qkv_rows, path)
    return result  # type: ignore[return-value]  # rows: plain values next to the tensors


def _worker(rank: int, world: int, cases: list[tuple], out: str) -> None:
    results = {case_id(c): tower_outputs(path, vision, sp, asked) for c, path, vision, sp, asked in cases}
    if rank == 0:
        torch.save(results, Path(out) / f"sp{world}.pt")


@pytest.fixture(scope="module")
def results(tiny_checkpoint, tmp_path_factory):
    """{case id: (one process, SP)}: one 2-process and one 3-process launch run every case of their size."""
    out = tmp_path_factory.mktemp("vision_sp")
    paths = {name: str(tiny_checkpoint(name)) for name in FAMILIES}
    runs = {}
    for world in (2, 3):
        cases = [(c, paths[c[0]], c[1], c[2], c[3]) for c in CASES if c[2] == world]
        spawn(_worker, world, cases, str(out))
        runs.update(torch.load(out / f"sp{world}.pt"))
    one = {}
    for case in CASES:
        key = (case[0], tuple(case[1].items()))
        if key not in one:
            one[key] = tower_outputs(paths[case[0]], case[1], 1, None)
    return {case_id(c): (one[(c[0], tuple(c[1].items()))], runs[case_id(c)]) for c in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_sp_ranks_split_the_patches_and_equal_one_process(results, case):
    _, _, sp, _, path = case
    one, split = results[case_id(case)]
    block_rows, qkv_rows, taken = split["rows"]
    chunk = -(-PATCHES // sp)
    assert taken == path
    assert block_rows == [chunk]  # each rank's blocks: its chunk of the patches (the last one padded)
    # the attention's projections: the chunk under Ulysses, every patch when the attention gathers them
    assert set(qkv_rows) == {chunk if path == "ulysses" else PATCHES}
    assert one.keys() == split.keys()
    for key in one.keys() - {"rows"}:
        torch.testing.assert_close(split[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_split_pads_the_last_chunks():
    """A sequence the SP size does not divide: equal chunks, zero rows after the end (dropped on gather)."""
    rows = torch.arange(6.0).unsqueeze(1)
    chunks = []
    for rank in range(4):
        state = VisionSequenceParallel(None, rank, 4)  # type: ignore[arg-type]  # split needs no group
        state.length = 6
        chunks.append(state.split(rows))
    assert [c.flatten().tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5], [0, 0]]


def test_heads_that_sp_does_not_divide_fall_back_to_the_gather_path_with_one_warning(tiny_checkpoint, caplog):
    """The families' 2-headed towers at sp=3: gathered attention (what the 3-rank cases check for equality), said
    in one warning line naming the heads and parallel.sp; no all-to-all implementation set on the attention."""
    from transformers import AutoModelForImageTextToText

    from spindle.distributed.vision_sequence_parallel import VISION_ATTN_IMPLEMENTATION, enable_vision_sequence_parallel

    tower = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint("qwen2_5_vl")).model.visual
    with caplog.at_level("WARNING", logger="spindle.train"):
        state = enable_vision_sequence_parallel(tower, None, 0, 3)  # type: ignore[arg-type]  # hooks need no group yet
    assert state.attention == "gather"
    assert [r.getMessage() for r in caplog.records] == [
        "vision tower: 2 attention heads are not divisible by parallel.sp=3, so each block's attention all-gathers "
        "the patch sequence on every rank (the heads cannot be split evenly)"
    ]
    assert all(block.attn.config._attn_implementation != VISION_ATTN_IMPLEMENTATION for block in tower.blocks)
