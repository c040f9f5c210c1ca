"""spindle.cpu_allocator: freed host memory stays in the process, so re-allocating a buffer costs no page
faults; engines turn it on by default on CPU and leave glibc alone when told to. Each case runs in a
fresh interpreter: the setting is process-wide and once on stays on."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt"
)

# a step that allocates and frees activation-sized buffers (64 and 16 MiB, above glibc's largest
# dynamic mmap threshold of 32 MiB), as a denoising or training step does. One intra-op thread: with
# several, the order in which the threads' GEMM scratch and the step's buffers are taken and freed
# varies, and the heap reaches its peak at a varying early step (measured: one extra 64 MiB growth at
# step 11-12 in 1 run of 8, never again over 40 steps), so "after 10 warm-up steps" would not be the
# steady state this test measures; with one thread the allocation order, hence the peak, is fixed.
FAULTS = """
import json, resource, torch
from spindle import cpu_allocator
torch.set_num_threads(1)
kept = cpu_allocator.keep_freed_memory() if {keep} else cpu_allocator.is_kept()
torch.manual_seed(0)
x, w1, w2 = torch.randn(4096, 1024), torch.randn(1024, 4096), torch.randn(4096, 1024)
def step():
    return (torch.nn.functional.gelu(x @ w1) @ w2 + x).softmax(-1)
for _ in range(10):  # the heap settles (its first steps grow it)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps(dict(kept=kept, faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)))
"""


def run_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_memory_is_reused_without_page_faults():
    system = run_python(FAULTS.format(keep=False))
    kept = run_python(FAULTS.format(keep=True))
    pages = 5 * (64 + 16) * 2**20 // 4096  # the big buffers of 5 steps
    assert not system["kept"] and system["faults"] > pages // 2  # glibc's default: they fault in at every step
    assert kept["kept"] and kept["faults"] < pages // 100


def test_engine_keeps_freed_memory_on_cpu_unless_told_not_to(tiny_wan):
    result = run_python(
        f"""
        import json
        from spindle import cpu_allocator
        from spindle.api import load_generator
        load_generator({str(tiny_wan)!r}, device="cpu", keep_freed_memory=False)
        off = cpu_allocator.is_kept()
        load_generator({str(tiny_wan)!r}, device="cpu")
        print(json.dumps(dict(off=off, on=cpu_allocator.is_kept())))
        """
    )
    assert result == {"off": False, "on": True}


def test_cli_flag_turns_it_off():
    from spindle.cli import build_parser
    from spindle.commands.engine_args import engine_config

    parser = build_parser()
    base = ["generate", "--model", "m", "--prompt", "p", "--out", "o.png"]
    assert engine_config(parser.parse_args(base)).keep_freed_memory is True
    assert engine_config(parser.parse_args([*base, "--no-keep-freed-memory"])).keep_freed_memory is False


TRAINER_MEMORY = """
import json, torch
from spindle import cpu_allocator
from spindle.api import load_job_config, make_trainer
cpu_allocator.keep_freed_memory()  # as an engine loaded earlier in the same process leaves it
make_trainer(load_job_config(None, {overrides!r}))
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
t = torch.ones(64, 2**20)  # 256 MiB, freed below
del t
print(json.dumps(dict(kept=cpu_allocator.is_kept(), grown=rss() - before)))
"""


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep"])
def test_trainer_returns_freed_host_memory_unless_told_to_keep_it(keep, tiny_wan, shapes_videos, tmp_path):
    """Training RSS is what bounds the model size on a host: by default a freed buffer goes back to the
    OS at once (even after an engine in the same process kept memory); `train.keep_freed_memory` keeps it."""
    from tests.conftest import train_overrides

    overrides = train_overrides(tiny_wan, shapes_videos, tmp_path / "run", train__keep_freed_memory=keep)
    result = run_python(TRAINER_MEMORY.format(overrides=overrides))
    assert result["kept"] is keep
    if keep:
        assert result["grown"] > 200 * 2**20  # the heap holds the freed 256 MiB
    else:
        assert result["grown"] < 16 * 2**20
