"""Faults one layer out (issue 24), injected as an operator, a scheduler or a failing disk would:

- checkpoint integrity: bytes flipped in the newest checkpoint's largest shard are detected, that
  checkpoint is named and moved aside, the previous one is resumed, and the losses still equal the
  uninterrupted run exactly; each other kind of damage (truncated or missing shard, truncated
  .metadata or trainer_state.json) is named too; an explicit damaged checkpoint.resume is an error.
- disk full while saving: "No space left on device" with the path, the partial folder removed, the
  previous checkpoint intact and resumed exactly. Simulated in-process: files opened for writing
  inside the checkpoint's .tmp folder raise ENOSPC once a byte budget is spent (a real tmpfs needs
  root; the same run on a 2 MB tmpfs is described in docs/training.md).
- run records: a torn last metrics line does not block resume; a crash before the first checkpoint
  leaves no stale lines; a damaged line in the middle is named file:line.
- errors naming the file: damaged safetensors headers, non-UTF-8 JSONL lines (skippable), chat roles
  the template does not render.
- one run per output folder: a live holder is refused, a dead one's lock is taken over.
- signals (slow, one pair of launches): SIGTERM to `spindle train --nproc 2` stops the whole job,
  SIGKILL to it too (the workers notice), and a second run on the held folder is refused meanwhile.
  Without torchrun (small stand-in processes): the grace-period kill, a worker's launcher watchdog,
  and SIGHUP under `nohup`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from spindle.api import train
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.integrity import CheckpointError, DiskFullError
from spindle.train.metrics import read_metrics
from spindle.train.output_lock import LOCK_FILE, OutputLock, OutputLockedError
from spindle.train.trainer import Trainer
from tests.conftest import RESUME_RUN, stepped_linear, train_overrides

# 8 steps, a checkpoint every 3 (steps 3 and 6), keep_last 2: the run every test here compares with.
COMMON = RESUME_RUN


@pytest.fixture(scope="module")
def straight_losses(tiny_wan, shapes_videos, tmp_path_factory) -> list[float]:
    from spindle.api import load_job_config

    out = tmp_path_factory.mktemp("straight")
    train(load_job_config(None, train_overrides(tiny_wan, shapes_videos, out, **COMMON)))
    return [m["loss"] for m in read_metrics(out)]


def crashed_run(make_config, out: Path, monkeypatch, at_step: int = 7) -> None:
    """The run of COMMON into `out`, killed (KeyboardInterrupt) at the start of step `at_step`."""
    original = Trainer.train_step

    def crash(self):
        if self.step + 1 == at_step:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        train(make_config(out, **COMMON))
    monkeypatch.setattr(Trainer, "train_step", original)


def largest_file(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Invert `count` bytes in the middle of `path` (same size: only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    for i in range(start, min(len(data), start + count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- checkpoint integrity


def test_flipped_bytes_in_the_newest_checkpoint_fall_back_and_resume_exactly(
    make_config, tmp_path, monkeypatch, caplog, straight_losses
):
    out = tmp_path / "run"
    crashed_run(make_config, out, monkeypatch)
    newest = ckpt.checkpoint_root(out) / "step-000006"
    shard = largest_file(newest)
    size = shard.stat().st_size
    flip_bytes(shard)
    assert shard.stat().st_size == size

    with caplog.at_level(logging.WARNING, logger="spindle.train"):
        result = train(make_config(out, checkpoint__resume="auto", **COMMON))
    warned = caplog.text
    assert "step-000006 is damaged" in warned and str(shard) in warned and "CRC-32" in warned
    assert "resuming from" in warned and "step-000003" in warned
    assert result.last_step == 8
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 9))
    assert [m["loss"] for m in read_metrics(out)] == straight_losses  # exact on CPU fp32
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # steps 4-6 ran twice: the first run's events of them are purged
    logged = events.Scalars("train/loss")
    assert [e.step for e in logged] == list(range(1, 9))
    assert [e.value for e in logged] == pytest.approx(straight_losses, rel=1e-6)  # stored as float32
    # the damaged one is kept aside for inspection; keep_last counts only the good ones
    assert (ckpt.checkpoint_root(out) / "step-000006.damaged").is_dir()
    kept = ckpt.list_checkpoints(out)
    assert [p.name for p in kept] == ["step-000006", "step-000008"]
    assert all(ckpt.verify_checkpoint(p) == [] for p in kept)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped_shard": (lambda c: c / "__0_0.distcp", flip_bytes, "CRC-32"),
    "truncated_shard": (lambda c: c / "__0_0.distcp", _truncate, "bytes, the manifest records"),
    "missing_shard": (lambda c: c / "__0_0.distcp", Path.unlink, "is missing"),
    "truncated_metadata": (lambda c: c / ".metadata", _truncate, "bytes, the manifest records"),
    "truncated_trainer_state": (lambda c: c / ckpt.TRAINER_STATE, _truncate, "bytes, the manifest records"),
    "missing_rng_state": (lambda c: c / "rng-rank0.pt", Path.unlink, "is missing"),
    "garbled_manifest": (lambda c: c / "manifest.json", _truncate, "unreadable manifest"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_kind_of_damage_is_named_and_the_previous_checkpoint_used(tmp_path, damage, caplog):
    model, optimizer = stepped_linear()
    good = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {})
    bad = ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {})
    where, damage_it, says = DAMAGE[damage]
    file = where(bad)
    damage_it(file)

    # named explicitly: an error naming the file and the fix, nothing moved
    with pytest.raises(CheckpointError, match="is damaged") as err:
        ckpt.resolve_resume(str(bad), tmp_path)
    assert str(file) in str(err.value) and says in str(err.value) and "resume=auto" in str(err.value)
    assert bad.is_dir()
    with pytest.raises(CheckpointError, match="use an earlier checkpoint"):  # `spindle export` of it
        ckpt.resolve_checkpoint_arg(bad)

    with caplog.at_level(logging.WARNING, logger="spindle.train"):
        assert ckpt.resolve_resume("auto", tmp_path) == good
    assert str(file) in caplog.text and "skipping it" in caplog.text
    assert ckpt.list_checkpoints(tmp_path) == [good]
    ckpt.load_checkpoint(good, model, optimizer)


def test_only_damaged_checkpoints_is_an_error(tmp_path):
    model, optimizer = stepped_linear()
    only = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {})
    flip_bytes(only / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged .*checkpoint.resume=none"):
        ckpt.resolve_resume("auto", tmp_path)


def test_a_checkpoint_without_manifest_still_resumes_and_a_bad_trainer_state_is_named(tmp_path, caplog):
    """Checkpoints written before manifests existed load with a warning; their JSON is still checked."""
    model, optimizer = stepped_linear()
    old = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {})
    (old / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="spindle.train"):
        assert ckpt.resolve_resume("auto", tmp_path) == old
    assert "not verified" in caplog.text
    (old / ckpt.TRAINER_STATE).write_text('{"step": 1,')
    with pytest.raises(CheckpointError, match=rf"{ckpt.TRAINER_STATE} is not valid JSON"):
        ckpt.resolve_resume(str(old), tmp_path)


def test_explicit_damaged_resume_is_a_cli_error_before_any_work(tmp_path, tiny_wan, shapes_videos, spindle_cli):
    model, optimizer = stepped_linear()
    bad = ckpt.save_checkpoint(tmp_path / "run", 4, model, optimizer, {})
    _truncate(bad / ".metadata")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    overrides = train_overrides(tiny_wan, shapes_videos, tmp_path / "run", **COMMON)
    proc = spindle_cli("train", cfg, *overrides, f"checkpoint.resume={bad}")
    assert proc.returncode == 2
    assert f"{bad / '.metadata'} has" in proc.stderr and "damaged" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- disk full


def fill_disk(where, budget: int, monkeypatch) -> None:
    """Files opened for writing whose path satisfies `where` raise ENOSPC (as a full disk's write
    does) once `budget` bytes have been written into them."""
    real_open = pathlib.Path.open
    spent = [0]

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            n = memoryview(b).nbytes if not isinstance(b, str) else len(b.encode())
            if spent[0] + n > budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            spent[0] += n
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def open_(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return FullDisk(f) if ("w" in mode or "a" in mode) and where(self) else f

    monkeypatch.setattr(pathlib.Path, "open", open_)


def test_disk_full_while_saving_names_the_path_and_resumes_exactly(
    tmp_path, tiny_wan, shapes_videos, spindle_cli, monkeypatch, straight_losses, make_config
):
    out = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    fill_disk(lambda path: path.parent.name == "step-000006.tmp", budget=20_000, monkeypatch=monkeypatch)
    proc = spindle_cli("train", cfg, *train_overrides(tiny_wan, shapes_videos, out, **COMMON))
    monkeypatch.undo()
    assert proc.returncode == 1
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("spindle train: error:")]
    assert "No space left on device" in line and str(ckpt.checkpoint_root(out) / "step-000006.tmp") in line
    assert "step-000003 is intact" in line
    assert not (ckpt.checkpoint_root(out) / "step-000006.tmp").exists(), "the partial folder frees its space"
    assert ckpt.list_checkpoints(out) == [ckpt.checkpoint_root(out) / "step-000003"]
    assert ckpt.verify_checkpoint(ckpt.checkpoint_root(out) / "step-000003") == []

    train(make_config(out, checkpoint__resume="auto", **COMMON))
    assert [m["loss"] for m in read_metrics(out)] == straight_losses


def test_disk_full_while_appending_metrics_is_named(make_config, tmp_path, monkeypatch):
    out = tmp_path / "run"
    fill_disk(lambda path: path.name == "metrics.jsonl", budget=300, monkeypatch=monkeypatch)  # about one line
    with pytest.raises(DiskFullError, match="No space left on device while appending step 2") as err:
        train(make_config(out, **{**COMMON, "train__max_steps": 3}))
    assert str(out / "metrics.jsonl") in str(err.value)


# ---------------------------------------------------------------- run records


def test_a_torn_last_metrics_line_does_not_block_resume(make_config, tmp_path, monkeypatch, caplog, straight_losses):
    out = tmp_path / "run"
    crashed_run(make_config, out, monkeypatch)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 0.9')  # what an append cut short by a full disk leaves
    with caplog.at_level(logging.WARNING, logger="spindle.train"):
        train(make_config(out, checkpoint__resume="auto", **COMMON))
    assert "torn last line" in caplog.text and "metrics.jsonl:7" in caplog.text
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 9))
    assert [m["loss"] for m in read_metrics(out)] == straight_losses


def test_a_crash_before_the_first_checkpoint_leaves_no_stale_lines(make_config, tmp_path, monkeypatch):
    out = tmp_path / "run"
    crashed_run(make_config, out, monkeypatch, at_step=3)  # steps 1, 2 logged; no checkpoint yet
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    train(make_config(out, checkpoint__resume="auto", **{**COMMON, "train__max_steps": 3}))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]  # the first run's purged


def test_a_damaged_metrics_line_before_the_last_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        read_metrics(tmp_path)


# ---------------------------------------------------------------- errors that name the file


def test_damaged_safetensors_headers_are_named(tmp_path, tiny_wan, shapes_videos, spindle_cli):
    import shutil

    from spindle.weight_files import WeightFileError, check_weight_files

    model = tmp_path / "wan"
    shutil.copytree(tiny_wan, model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"\x00garbage" + data[16:])  # header JSON garbled
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    proc = spindle_cli("train", cfg, *train_overrides(model, shapes_videos, tmp_path / "run", **COMMON))
    assert proc.returncode == 2
    assert f"{weights} has an unreadable header" in proc.stderr and "download or export it again" in proc.stderr

    weights.write_bytes(data[: len(data) - 100])  # a download cut short
    with pytest.raises(WeightFileError, match="is truncated"):
        check_weight_files(model)
    weights.write_bytes(b"\xff" * 8 + data[8:])  # a length field nobody could allocate
    with pytest.raises(WeightFileError, match="declares a header longer than the file"):
        check_weight_files(model)


def _with_header(data: bytes, edit) -> bytes:
    """A safetensors file's bytes with its JSON header changed by `edit(header)` (the tensor data kept)."""
    import struct

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda h: _first_tensor(h).pop("data_offsets"), "no data_offsets"),
        (lambda h: _first_tensor(h).update(data_offsets="0-16"), "is not two byte offsets"),
        (lambda h: _first_tensor(h).update(shape=[3, -1]), "is not a list of sizes"),
        (lambda h: _first_tensor(h).update(shape=[9999]), "bytes, data_offsets"),
        (lambda h: h.update({"extra.weight": [1, 2]}), "for tensor 'extra.weight': not an object"),
    ],
    ids=["no_offsets", "offsets_text", "negative_shape", "shape_size", "not_object"],
)
def test_damaged_safetensors_header_entries_are_named(tmp_path, tiny_wan, shapes_videos, spindle_cli, edit, problem):
    """A header that parses as JSON but whose tensor entries are wrong (once a KeyError traceback)."""
    import shutil

    model = tmp_path / "wan"
    shutil.copytree(tiny_wan, model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(_with_header(weights.read_bytes(), edit))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    proc = spindle_cli("train", cfg, *train_overrides(model, shapes_videos, tmp_path / "run", **COMMON))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{weights} has a damaged header entry for tensor" in proc.stderr and problem in proc.stderr, proc.stderr


def test_a_text_file_named_safetensors_does_not_show_its_bytes(tmp_path):
    from spindle.weight_files import WeightFileError, check_weight_files

    (tmp_path / "model.safetensors").write_text("password=hunter2\n")
    with pytest.raises(WeightFileError) as e:
        check_weight_files(tmp_path)
    length = int.from_bytes(b"password", "little")  # what the first 8 bytes read as a header length
    assert "not a safetensors file" in str(e.value) and str(length) not in str(e.value)


def test_non_utf8_jsonl_line_is_named_and_skippable(tmp_path, tiny_qwen3):
    from transformers import AutoTokenizer

    from spindle.data.text import TextDataError, read_documents

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    data = tmp_path / "docs.jsonl"
    data.write_bytes(b'{"text": "red circle"}\n{"text": "blue \xff square"}\n{"text": "green"}\n')
    with pytest.raises(TextDataError, match=rf"{data}:2: not UTF-8 \(byte 0xff at byte 16\)"):
        read_documents(data, tok)
    docs, skipped = read_documents(data, tok, skip_bad_samples=True)
    assert skipped == 1 and [d.source for d in docs] == [f"{data}:1", f"{data}:3"]


# Qwen's template renders a fixed set of roles; any other role's content is silently dropped.
ANY_ROLE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_LIKE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'user' or message.role == 'system' %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_role_the_template_does_not_render_is_named(tmp_path, tiny_qwen3):
    from transformers import AutoTokenizer

    from spindle.data.text import TextDataError, read_documents

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    good = [{"role": "user", "content": "what shape"}, {"role": "assistant", "content": "a square"}]
    narrated = [{"role": "narrator", "content": "the square moves"}, *good]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, narrated)))
    # the tiny Qwen3 template, like Qwen3's own, renders system/user/assistant/tool only
    with pytest.raises(TextDataError, match=rf"{data}:2: messages\[0\] has role 'narrator'") as err:
        read_documents(data, tok)
    assert "assistant, system, tool, user" in str(err.value)

    tok.chat_template = QWEN_LIKE_TEMPLATE
    with pytest.raises(TextDataError, match=rf"{data}:2: messages\[0\] has role 'narrator'") as err:
        read_documents(data, tok)
    assert "assistant, system, user" in str(err.value)

    tok.chat_template = ANY_ROLE_TEMPLATE
    assert len(read_documents(data, tok)[0]) == 2  # a template that prints any role accepts any


# ---------------------------------------------------------------- one run per output folder


def test_a_held_output_folder_is_refused_and_a_dead_holders_lock_taken_over(
    tmp_path, caplog, tiny_wan, shapes_videos, spindle_cli
):
    from spindle.distributed.launch import process_start_time

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"host": os.uname().nodename, "pid": holder.pid, "start_time": process_start_time(holder.pid)}
        (out / LOCK_FILE).write_text(json.dumps({**lock, "since": "earlier"}))
        with pytest.raises(OutputLockedError, match=rf"in use by a live run \(pid {holder.pid}"):
            OutputLock(out).acquire()
        cfg = tmp_path / "c.yaml"
        cfg.write_text("{}\n")
        proc = spindle_cli("train", cfg, *train_overrides(tiny_wan, shapes_videos, out, **COMMON))
        assert proc.returncode == 2 and f"pid {holder.pid}" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="spindle.train"), OutputLock(out):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over {out / LOCK_FILE}" in caplog.text and f"pid {holder.pid}" in caplog.text
    assert not (out / LOCK_FILE).exists()  # released

    (out / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "earlier"}))
    with pytest.raises(OutputLockedError, match=rf"host elsewhere .* delete {out / LOCK_FILE}"):
        OutputLock(out).acquire()


# ---------------------------------------------------------------- signals (real processes)


def _launch(tmp_path: Path, model: Path, data: Path, out: Path, name: str, **overrides) -> subprocess.Popen:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    args = train_overrides(model, data, out, **{**COMMON, **overrides})
    log = (tmp_path / f"{name}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "spindle", "train", str(cfg), *args, "--nproc", "2"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _steps(out: Path) -> int:
    try:
        return len(read_metrics(out))
    except (FileNotFoundError, ValueError):
        return 0


def _alive(pids: dict[int, int]) -> list[int]:
    from spindle.distributed.launch import process_start_time

    return [pid for pid, t in pids.items() if process_start_time(pid) == t]


def _stopped_within(pids: dict[int, int], seconds: float) -> list[int]:
    """The processes of `pids` ({pid: start time}) still alive after `seconds`."""
    start = time.monotonic()
    while (left := _alive(pids)) and time.monotonic() - start < seconds:
        time.sleep(0.2)
    print(f"stopped in {time.monotonic() - start:.1f} s" if not left else f"{left} still alive")
    return left


def _kill_all(pids: dict[int, int]) -> None:
    """Test cleanup: whatever of a job is left (after a failed assertion) must not outlive the test."""
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_signals_to_the_launcher_stop_the_whole_job(tmp_path, tiny_wan, shapes_videos, spindle_cli):
    """SIGTERM to `spindle train --nproc 2` mid-training: every process of the job is gone within
    20 s, the newest checkpoint verifies and is resumed; while it runs, a second run on its output
    folder is refused. Then SIGKILL to the resumed run's launcher: its workers notice and go too."""
    from spindle.distributed.launch import descendants, process_start_time

    out = tmp_path / "run"
    long_run = dict(train__max_steps=10_000, checkpoint__every_steps=2, train__micro_batch_size=1)
    first = _launch(tmp_path, tiny_wan, shapes_videos, out, "first", **long_run)
    job = {first.pid: process_start_time(first.pid)}
    try:
        _wait_for(lambda: ckpt.list_checkpoints(out) and _steps(out) >= 3, first, tmp_path / "first.log")
        cfg = tmp_path / "c.yaml"
        second = spindle_cli("train", cfg, *train_overrides(tiny_wan, shapes_videos, out, **long_run), "--nproc", 2)
        assert second.returncode == 2 and f"in use by a live run (pid {first.pid}" in second.stderr

        job.update(descendants(first.pid))
        assert len(job) >= 4, job  # launcher, torchrun, two workers
        first.send_signal(signal.SIGTERM)
        assert _stopped_within(job, 20) == [], (tmp_path / "first.log").read_text()[-3000:]
        assert first.wait() == 128 + signal.SIGTERM
        assert not (out / LOCK_FILE).exists()
        newest = ckpt.list_checkpoints(out)[-1]
        assert ckpt.verify_checkpoint(newest) == []
    finally:
        _kill_all(job)

    resumed_at = ckpt.checkpoint_step(newest)
    again = _launch(tmp_path, tiny_wan, shapes_videos, out, "again", checkpoint__resume="auto", **long_run)
    job = {again.pid: process_start_time(again.pid)}
    try:
        log = tmp_path / "again.log"
        # a checkpoint newer than the one resumed from can only come from the resumed run
        _wait_for(lambda: ckpt.checkpoint_step(ckpt.list_checkpoints(out)[-1]) > resumed_at, again, log)
        assert [m["step"] for m in read_metrics(out)][: resumed_at + 2] == list(range(1, resumed_at + 3))
        job.update(descendants(again.pid))
        assert len(job) >= 4, job
        again.kill()
        assert _stopped_within(job, 20) == [], log.read_text()[-3000:]
    finally:
        _kill_all(job)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == again.pid  # stale: its holder is gone
    with OutputLock(out):
        pass


STUBBORN_JOB = """
import signal, subprocess, sys, time
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# like torchrun's workers: a session of its own, out of reach of the launcher's process group
child = subprocess.Popen([sys.executable, "-c", ignore], start_new_session=True, stdout=subprocess.PIPE)
child.stdout.readline()
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def test_a_job_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path):
    """The launcher's bound: a job (and a worker in its own session) that ignores SIGTERM is killed
    `grace_s` after the signal, and the launcher exits 128 + SIGTERM."""
    import threading

    from spindle.distributed.launch import process_start_time, run_job

    pid_file = tmp_path / "child.pid"

    def signal_once_started():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process: the launcher's handler forwards it

    threading.Thread(target=signal_once_started, daemon=True).start()
    start = time.monotonic()
    code = run_job([sys.executable, "-c", STUBBORN_JOB, str(pid_file)], grace_s=1.0)
    child = int(pid_file.read_text())
    assert code == 128 + signal.SIGTERM
    assert process_start_time(child) is None, "the worker outlived the grace period"
    assert time.monotonic() - start < 30
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the launcher's handlers are gone again


def test_a_worker_exits_when_its_launcher_is_gone(tmp_path):
    """The worker side alone (no torchrun between, so no parent-death signal helps): a process
    that watches a launcher PID exits, saying why, once that process is SIGKILLed."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker_code = (
        "import time; from spindle.distributed.launch import watch_launcher; watch_launcher(); "
        "print('watching', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "SPINDLE_LAUNCHER_PID": str(launcher.pid)}
    worker = subprocess.Popen(
        [sys.executable, "-c", worker_code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout.readline() == "watching\n"
        launcher.kill()
        launcher.wait()
        _, err = worker.communicate(timeout=20)
        assert worker.returncode == 1
        assert f"the launcher (pid {launcher.pid}) is gone; stopping this worker" in err
    finally:
        launcher.kill()
        worker.kill()


# The job prints "started", then ends only when told to on its stdin (the launcher's, inherited): whether it
# was stopped by the forwarded signal or finished on its own never depends on how fast a loaded machine is.
LAUNCHER = """
import signal, sys
from spindle.distributed.launch import run_job
# a launcher from a terminal takes SIGHUP's default; under nohup it is ignored (set here either way: an ignored
# SIGHUP is inherited, and a test session itself run under nohup would make "plain" a nohup run)
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == "nohup" else signal.SIG_DFL)
job = "import sys; print('started', flush=True); sys.stdin.readline(); print('finished', flush=True)"
sys.exit(run_job([sys.executable, "-c", job], grace_s=1))
"""


@pytest.mark.parametrize("mode", ["plain", "nohup"])
def test_sighup_stops_the_job_unless_the_launcher_ignores_it(mode):
    """SIGHUP (a closed terminal) stops the job; under `nohup` (SIGHUP ignored) it keeps running."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout.readline() == "started\n"
        launcher.send_signal(signal.SIGHUP)
        if mode == "nohup":  # ignored: the job is still there to be told to finish
            launcher.stdin.write("go\n")
            launcher.stdin.flush()
            assert launcher.stdout.readline() == "finished\n"
        assert launcher.wait(timeout=60) == (0 if mode == "nohup" else 128 + signal.SIGHUP)
    finally:
        launcher.kill()


def test_a_language_model_without_its_tokenizer_is_refused_before_work(spindle_cli, tiny_qwen3, lm_corpus, tmp_path):
    """transformers would fail late and obliquely (a missing sentencepiece, every label masked)."""
    import shutil

    from tests.conftest import lm_overrides

    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_qwen3, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    cfg_args = lm_overrides(bare, lm_corpus, tmp_path / "run")
    config = tmp_path / "job.yaml"
    config.write_text("model:\n  path: " + str(bare) + "\n")
    result = spindle_cli("train", config, *cfg_args)
    assert result.returncode == 2, result.stderr
    assert f"{bare} has no tokenizer (tokenizer.json" in result.stderr and "Traceback" not in result.stderr
