"""Export a training checkpoint as a diffusers pipeline folder.

  spindle export OUTPUT_DIR/checkpoints/step-000100 --out DIR [--model PATH]

The folder holds the original components of the base checkpoint plus the trained transformer,
and loads in stock diffusers (e.g. `WanPipeline.from_pretrained(DIR)`) with no Spindle code.
Works on one process whatever world size the checkpoint was saved with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "export a checkpoint to a diffusers pipeline folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) or a run's OUTPUT_DIR")
    p.add_argument("--out", required=True, help="destination folder")
    p.add_argument("--model", default=None, help="base pipeline folder (default: the one the run trained from)")


def run(args: argparse.Namespace) -> int:
    from spindle.distributed import checkpoint as ckpt

    path = ckpt.resolve_checkpoint_arg(args.checkpoint)
    state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    model_path = Path(args.model or state["model_path"])
    out = ckpt.export_checkpoint(path, model_path, Path(args.out))
    print(f"exported step {state['step']} of {path} to {out}")
    return 0
