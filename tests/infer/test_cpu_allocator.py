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
# dynamic mmap threshold of 32 MiB), as a denoising or training step does. What is measured is the
# invariant, not a step count: with the memory kept, every page is faulted in once, when the heap grows
# to hold a step's peak, and reused after that, so the faults over all the steps are at most the heap's
# growth in pages. When the heap reaches that peak is not fixed: glibc's best fit lays the same
# allocations out differently as the heap fills (measured, one thread: the last 64 MiB growth came at
# step 4 or 5, and at step 11-12 with several threads), so counting faults "after N warm-up steps" was
# flaky. With glibc's defaults every step maps its big buffers afresh and faults them in again.
FAULTS = """
import ctypes, json, resource, torch
from spindle import cpu_allocator
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def heap():  # bytes the allocator holds from the OS: the main heap plus mmapped blocks
    info = libc.mallinfo2()
    return info.arena + info.hblkhd
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.set_num_threads(1)
kept = cpu_allocator.keep_freed_memory() if {keep} else cpu_allocator.is_kept()
torch.manual_seed(0)
a, b, x = torch.randn(4096, 64), torch.randn(64, 4096), torch.randn(4096, 1024)
def step():  # 64 MiB product, 64 MiB gelu, 16 MiB sum, 16 MiB softmax; little arithmetic
    return (torch.nn.functional.gelu(a @ b)[:, :1024] + x).softmax(-1)
step()  # torch's own first-call state
heap0, faults0 = heap(), faults()
for _ in range(20):
    step()
print(json.dumps(dict(kept=kept, faults=faults() - faults0, grown_pages=max(heap() - heap0, 0) // 4096)))
"""


def run_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_memory_is_reused_without_page_faults():
    system = run_python(FAULTS.format(keep=False))
    kept = run_python(FAULTS.format(keep=True))
    step_pages = (2 * 64 + 2 * 16) * 2**20 // 4096  # one step's big buffers
    # glibc's default: every step maps its two 64 MiB buffers afresh (above glibc's largest mmap
    # threshold) and faults them in again
    assert not system["kept"] and system["faults"] > 20 * (2 * 64 * 2**20 // 4096) * 9 // 10, system
    # kept: no page faulted twice; the heap grew at most to one step's peak over the 20 steps
    assert kept["kept"] and kept["faults"] <= kept["grown_pages"] + 1024, kept
    assert kept["grown_pages"] <= 2 * step_pages, kept


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
