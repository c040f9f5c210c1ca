"""Encode a DiT training set once: the frozen condition model's latents and text embeddings to disk.

  spindle precompute CONFIG.yaml --out DIR [key.sub=value ...] [--nproc N]

Reads the training config (model, data, precision), runs the family's condition model (text
encoders + VAE posterior mode) over every sample of data.path (a Diffusion-DPO pairs file: every chosen and
rejected member), sharded over ranks with --nproc,
and writes DIR/samples/*.safetensors plus DIR/manifest.json keyed by sample, checkpoint and the
settings that shape the conditions. Train on it with `data.precomputed: DIR`: the text encoders and
the VAE are then never loaded. A stale or mismatched cache is refused, saying what differs.

Each file is written to a temporary and renamed, its size and SHA-256 recorded; one precompute at a
time holds DIR (a second is refused); the old manifest is removed first and the new one written last,
so an interrupted run leaves a cache training refuses (`spindle.data.precomputed`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HELP = "encode a DiT dataset's conditions (latents, text embeddings) once, for data.precomputed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the training YAML config (model:, data:, train:)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.resolution=[64,64]")
    p.add_argument("--out", required=True, help="cache folder to write (data.precomputed)")
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (re-launches under torchrun)")


def precompute(cfg: Any, out: str | Path) -> Path | None:
    """Collective over the launched ranks (1 process without a launcher); -> the manifest on rank 0."""
    import torch

    from spindle.data.datasets import collate
    from spindle.data.precomputed import (
        EMPTY,
        begin_cache,
        cache_settings,
        read_records,
        sample_file,
        variant_key,
        write_empty,
        write_manifest,
        write_records,
        write_sample,
    )
    from spindle.distributed.mesh import barrier, init_distributed
    from spindle.registry import dit_family_of
    from spindle.train.tasks.flow_matching import build_condition_model, condition_dtype, dit_data
    from spindle.train.trainer import local_device, resolve_precision

    rank, world = init_distributed()
    out = Path(out)
    family = dit_family_of(cfg.model.path, cfg.model.family)
    precision = resolve_precision(cfg.train.mixed_precision)
    # the training task's own dataset (sources, buckets: each sample at its bucket's shape), skipped
    # samples refused: the cache must hold every sample the run lists
    strict = cfg.model_copy(update={"data": cfg.data.model_copy(update={"skip_bad_samples": False})})
    if cfg.train.objective == "diffusion_dpo":  # a pairs file: every member, chosen then rejected, at its pair's shape
        from spindle.data.media_pairs import media_pairs
        from spindle.train.objectives.diffusion_dpo import is_edit_family

        grid = lambda: family.condition_model_cls().pixel_grid(cfg.model.path)  # noqa: E731
        dataset = media_pairs(strict.data, cfg.train.seed, grid=grid, edit=is_edit_family(family)).members()
    else:
        dataset = dit_data(strict, family, captions=False).dataset
    device = local_device()
    condition = build_condition_model(cfg, family, device, precision)
    if rank == 0:
        begin_cache(out)
    barrier()
    mine = range(rank, len(dataset), world)
    start = time.perf_counter()
    text_keys: list[str] = []
    records: dict[str, dict[str, Any]] = {}  # {file: {"size", "sha256"}} of what this rank wrote
    with torch.no_grad():
        for n, index in enumerate(mine, start=1):
            batch = collate([dataset.load(index)])  # the first caption (with the prefix)
            conditions = condition.encode(batch)
            if n == 1:  # the conditions a caption changes, and the empty caption's (data.caption_dropout)
                empty = condition.encode({**batch, "caption": [""]})
                text_keys = sorted(k for k in conditions if not torch.equal(conditions[k], empty[k]))
                if rank == 0:
                    records[EMPTY] = write_empty(out, {k: empty[k][0] for k in text_keys})
            record = {k: v[0] for k, v in conditions.items()}
            for j, caption in enumerate(dataset.samples[index].captions[1:], start=1):  # one drawn per epoch
                other = condition.encode({**batch, "caption": [dataset.captions.text(caption)]})
                record.update({variant_key(k, j): other[k][0] for k in text_keys})
            records[sample_file(index)] = write_sample(out, index, record)
            if rank == 0:
                print(f"\rencoded {n}/{len(mine)} samples on rank 0", end="", file=sys.stderr)
    if rank == 0:
        print(f" ({time.perf_counter() - start:.1f}s)", file=sys.stderr)
    write_records(out, rank, records)
    barrier()
    manifest = None
    if rank == 0:
        settings = cache_settings(
            cfg, family.name, condition_dtype(precision), family.condition_model_cls().encoding_version
        )
        manifest = write_manifest(out, settings, dataset.samples, text_keys, read_records(out))
    barrier()
    return manifest


def run(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from spindle.api import load_job_config
    from spindle.data.precomputed import cache_lock
    from spindle.distributed.launch import maybe_relaunch, under_launcher

    cfg = load_job_config(args.config, args.overrides)
    if not hasattr(cfg.data, "precomputed"):
        raise ValueError("spindle precompute encodes DiT (flow-matching) datasets; this config's model is not a DiT")
    # one precompute per cache folder, held by the launcher of a --nproc job for its workers
    with nullcontext() if under_launcher() else cache_lock(Path(args.out)):
        code = maybe_relaunch(args.nproc, args._argv)
        if code is not None:
            return code
        manifest = precompute(cfg, args.out)
    if manifest is not None:
        print(f"wrote {manifest}; train with data.precomputed={Path(args.out)}")
    return 0
