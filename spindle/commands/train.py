"""Fine-tune a model from a standard checkpoint (diffusers pipeline folder or transformers folder).

  spindle train CONFIG.yaml [key.sub=value ...] [--nproc N]

Overrides use dotted keys and YAML values, e.g. `train.lr=1e-4 data.resolution=[64,64]`.
A folder holds one run: a rerun into it resumes that run (checkpoint.resume=auto, the default) and is
refused, naming each key, when a key that defines the run changed; checkpoint.resume=none (start over) is
refused in a folder holding checkpoints. checkpoint.resume=force resumes the newest checkpoint whatever
changed; a fresh train.output_dir starts over.
Outputs in train.output_dir: config.yaml (resolved), run.json (the keys that define the run), summary.json (the start- and end-of-run
summaries printed), metrics.jsonl (one line per step),
tensorboard/ (event files, when tensorboard is installed), samples/step-000N/ (train.validation, named like the checkpoints),
checkpoints/step-N/ (resumable, sharded), export/ (a diffusers pipeline / transformers model folder; with
train.lora: export/lora/ with diffusers' and the original layout's LoRA files).
With --nproc N the job re-launches itself under torchrun (gloo on CPU, NCCL on CUDA);
`torchrun --nproc_per_node N -m spindle train CONFIG.yaml` works the same. SIGTERM, SIGINT or SIGHUP
to `spindle` stop the whole job; a second run into an output folder a live run holds is refused.
"""

from __future__ import annotations

import argparse
import logging
import sys

HELP = "fine-tune a DiT or a language model (YAML config + dotted overrides)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 train.max_steps=50")
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (re-launches under torchrun)")


class OutsideProgressBar(logging.StreamHandler):
    """The run log on stderr through tqdm.write, so a line logged while the step bar is drawn (peak
    memory after step 1, a checkpoint saved) lands on its own line above the bar, not inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def show_run_log() -> None:
    """The trainer's INFO lines (data statistics, peak memory per rank, resume) on stderr; the trainer
    logs them from rank 0 only. Left alone when the caller configured logging already."""
    logger = logging.getLogger("spindle.train")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = OutsideProgressBar()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    from spindle.api import check_job_plan, job_family, load_job_config
    from spindle.distributed.launch import end_worker, launcher_world_size, maybe_relaunch, under_launcher
    from spindle.train.output_lock import OutputLock

    cfg = load_job_config(args.config, args.overrides)
    # Fail on an impossible parallel layout here, once, before any process is launched.
    world = launcher_world_size() or args.nproc
    check_job_plan(cfg, world)
    if args.nproc > 1 and not under_launcher():
        from spindle.distributed.checkpoint import list_checkpoints
        from spindle.train.run_record import check_before_launch

        # The launcher holds the output folder for its workers: it is the process that lives as
        # long as the job, and the one a second run can check (spindle.train.output_lock). Held
        # before the one-run checks, so a live run's refusal comes first, as in the trainer.
        with OutputLock(cfg.train.output_dir):
            check_before_launch(cfg, list_checkpoints(cfg.train.output_dir), job_family(cfg))
            return int(maybe_relaunch(args.nproc, args._argv) or 0)
    code = maybe_relaunch(args.nproc, args._argv)
    if code is not None:
        return code
    import torch.distributed as dist

    from spindle.api import train
    from spindle.distributed.mesh import is_main_process

    show_run_log()
    result = train(cfg)
    if is_main_process() and not result.already_complete and not result.stopped_by:  # those said so themselves
        print(f"trained {result.last_step} steps; outputs in {result.output_dir}")
        if result.export_dir:
            print(f"exported: {result.export_dir}")
    code = 128 + result.stopped_by if result.stopped_by else 0  # the shell's convention for a signalled stop
    if dist.is_initialized():
        # Tear the group down together: a rank that exits while its peer's gloo threads are still
        # live aborts with "terminate called without an active exception" (seen on a 2-rank run).
        dist.barrier()
        dist.destroy_process_group()
    if under_launcher():
        end_worker(code)  # and no interpreter teardown after it (spindle.distributed.launch.end_worker)
    return code
