"""Export a training checkpoint in the base model's standard layout.

  spindle export OUTPUT_DIR/checkpoints/step-000100 --out DIR [--model PATH] [--merge]

The export is the training task's: for a DiT, a diffusers pipeline folder (the base checkpoint's
components plus the trained transformer) that stock diffusers loads (`WanPipeline.from_pretrained(DIR)`);
for a language model, a transformers folder. A LoRA run's export is `lora/` (the adapters, loaded with
`--model BASE --lora DIR/lora`); `--merge` adds `merged/`, the full folder with the LoRA fused. The weights are written in the base checkpoint's precision
(`--dtype` overrides). No Spindle code is needed to load either. Works on one
process whatever world size the checkpoint was saved with. A run with `train.ema` exports what its
`export.weights` chose unless `--weights` says otherwise (`spindle.train.ema.export_weights`).

`--out` is replaced by the export, so it must be a new or empty folder, or an earlier export (`--force`);
never the run, the checkpoint or the base model (`spindle.export.target`). The export is written to a
temporary sibling and renamed; a full disk removes it and says how much space the export needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "export a training checkpoint as a standard diffusers / transformers folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) or a run's OUTPUT_DIR")
    p.add_argument("--out", required=True, help="destination folder: new, empty, or an earlier export (--force)")
    p.add_argument("--force", action="store_true", help="replace --out when it holds an earlier Spindle export")
    p.add_argument("--model", default=None, help="base model folder (default: the one the run trained from)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="dtype of the written weights (default auto: as the base checkpoint stores them; bf16 in -> bf16 out)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: also write OUT/merged/, the full diffusers pipeline / transformers folder with the LoRA "
        "fused (stock from_pretrained loads it), beside OUT/lora/",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=("trained", "ema", "both"),
        help="the trained weights, their EMA (a run with train.ema), or both (the EMA beside them, e.g. "
        "transformer_ema/); default: the run's export.weights",
    )


def run(args: argparse.Namespace) -> int:
    from spindle.distributed import checkpoint as ckpt
    from spindle.export.target import check_export_target, export_failed, folder_bytes, record_export
    from spindle.registry import family_of
    from spindle.train.ema import EMA_STATE, export_weights
    from spindle.train.tasks import get_task

    path = ckpt.resolve_checkpoint_arg(args.checkpoint)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    model_path = Path(args.model or state["model_path"])
    family = family_of(model_path, state.get("family"))
    task = get_task(state.get("task") or family.task)
    weights = args.weights or state.get("export_weights") or "trained"
    if weights != "trained" and EMA_STATE not in ckpt.saved_namespaces(path):
        raise ValueError(
            f"--weights {weights}: checkpoint {path} holds no EMA (its run had no train.ema); use --weights trained"
        )
    if args.merge and state.get("lora") is None:
        raise ValueError(
            f"--merge: checkpoint {path} is a full fine-tune (no train.lora): its export is already the full "
            "folder; drop --merge"
        )
    if weights != "trained" and state.get("ema") is not None:
        from spindle.config import EmaConfig
        from spindle.train.ema import few_updates_warning

        if (warning := few_updates_warning(EmaConfig(**state["ema"]), state["step"])) is not None:
            print(f"warning: {warning}", file=sys.stderr)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    target = check_export_target(
        args.out,
        {"run folder": run_dir, "checkpoint": path, "base model": model_path},
        force=args.force,
        managed={"run's checkpoints folder": path.parent if run_dir is not None else path},
    )
    try:
        out = export_weights(
            weights,
            target,
            lambda folder: task.export_checkpoint(family, path, model_path, folder, dtype=args.dtype, merge=args.merge),
            lambda: ckpt.reading_weights(EMA_STATE),
            task.ema_paths(state),
        )
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        needed = folder_bytes(model_path) * (2 if weights == "both" else 1)  # the export is about the base's size
        failure = export_failed(e, target, needed)
        if failure is e:
            raise
        raise failure from e
    record_export(target, family=family.name, base_model=str(model_path.resolve()), step=state["step"])
    print(f"exported step {state['step']} of {path} to {out}")
    return 0
