"""The trainer/task split: the generic loop knows no model library; a family names its task."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spindle.contracts.task import TrainTask
from spindle.registry import all_families
from spindle.train.tasks import TASKS, get_task


def test_trainer_and_distributed_import_no_model_library():
    code = (
        "import sys\n"
        "import spindle.train.trainer, spindle.train.tasks, spindle.distributed.fsdp, spindle.distributed.checkpoint\n"
        "import spindle.distributed.context_parallel, spindle.distributed.mesh, spindle.config, spindle.registry\n"
        "import spindle.distributed.parallelize, spindle.distributed.sharded_load, spindle.distributed.blocks\n"
        "import spindle.distributed.expert_parallel, spindle.contracts.parallel\n"
        "bad = sorted(m for m in ('diffusers', 'transformers') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_family_names_a_known_task():
    for family in all_families():
        assert family.task in TASKS, family.name
        assert issubclass(get_task(family.task), TrainTask)


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="flow_matching"):
        get_task("nope")
