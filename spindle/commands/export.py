"""Export a training checkpoint in the base model's standard layout.

  spindle export OUTPUT_DIR/checkpoints/step-000100 --out DIR [--model PATH]

The export is the training task's: for a DiT, a diffusers pipeline folder (the base checkpoint's
components plus the trained transformer) that stock diffusers loads (`WanPipeline.from_pretrained(DIR)`);
for a language model, a transformers folder. The weights are written in the base checkpoint's precision
(`--dtype` overrides). No Spindle code is needed to load either. Works on one
process whatever world size the checkpoint was saved with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "export a training checkpoint as a standard diffusers / transformers folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) or a run's OUTPUT_DIR")
    p.add_argument("--out", required=True, help="destination folder")
    p.add_argument("--model", default=None, help="base model folder (default: the one the run trained from)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="dtype of the written weights (default auto: as the base checkpoint stores them; bf16 in -> bf16 out)",
    )


def run(args: argparse.Namespace) -> int:
    from spindle.distributed import checkpoint as ckpt
    from spindle.registry import family_of
    from spindle.train.tasks import get_task

    path = ckpt.resolve_checkpoint_arg(args.checkpoint)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    model_path = Path(args.model or state["model_path"])
    family = family_of(model_path, state.get("family"))
    task = get_task(state.get("task") or family.task)
    out = task.export_checkpoint(family, path, model_path, Path(args.out), dtype=args.dtype)
    print(f"exported step {state['step']} of {path} to {out}")
    return 0
