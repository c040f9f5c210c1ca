"""The shipped configs (configs/*.yaml): each is a valid job for the family its file name names
(`<family>_*.yaml`, validated against that family's task schema), every key says what it does, every
registered family ships a tiny (`<family>_tiny.yaml`) and a real-size config, and each real-size config's
memory comment is what the estimator the start-of-run summary uses computes (bench/config_memory.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from spindle.config import load_raw, validate_config
from spindle.registry import family_names, get_family

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
REAL_SIZE = [p for p in CONFIGS if not p.stem.endswith("_tiny")]


def _config_memory():
    """bench/config_memory.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("config_memory", ROOT / "bench" / "config_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_memory"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


config_memory = _config_memory()


def family_of_config(path: Path) -> str:
    """The longest registered family name the file name starts with (qwen3_moe_tiny -> qwen3_moe)."""
    name: str = config_memory.family_of_config(path)
    return name


def test_every_registered_family_ships_a_tiny_and_a_real_size_config():
    """A new family without its two configs fails here (the README promises both for every family)."""
    tiny = {family_of_config(p) for p in CONFIGS if p.stem.endswith("_tiny")}
    real = {family_of_config(p) for p in REAL_SIZE}
    names = set(family_names())
    assert {"tiny missing": sorted(names - tiny), "real-size missing": sorted(names - real)} == {
        "tiny missing": [],
        "real-size missing": [],
    }
    for name in names:
        assert (ROOT / "configs" / f"{name}_tiny.yaml").is_file(), f"configs/{name}_tiny.yaml"


def test_the_docs_list_every_shipped_config():
    """docs/training.md's table of shipped configs (and the README's list) name every file in configs/."""
    docs = (ROOT / "docs" / "training.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in CONFIGS if f"`{p.name}`" not in docs] == []
    assert [p.stem for p in REAL_SIZE if f"`{p.stem}`" not in readme] == []


@pytest.mark.parametrize("path", REAL_SIZE, ids=[p.name for p in REAL_SIZE])
def test_real_size_config_names_its_checkpoint_and_states_the_estimated_memory(path):
    """The header names the Hugging Face checkpoint, and `# memory: X GB per rank on N GPUs` is what
    `state_memory_per_rank` (the summary's estimator) gives for the real model's shapes on N GPUs, so the
    comment cannot drift from the code, the layout or the model."""
    text = path.read_text()
    real = config_memory.REAL[path.name]
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert real.repo in header
    stated = config_memory.MEMORY_COMMENT.search(text)
    assert stated is not None, f"{path.name}: no '# memory: X GB per rank on N GPUs' line"
    gpus = int(stated.group("gpus"))
    assert f"--nproc {gpus}" in header  # the launch line runs the layout the figure is for
    memory = config_memory.estimate(path, gpus)
    assert stated.group("gb") == f"{memory.total_gb:.1f}"


def test_the_estimator_counts_fp32_master_weights_gradients_and_adamw_state_per_shard():
    from spindle.train.memory import state_memory_per_rank

    full = state_memory_per_rank(1_000_000_000, 0, 8)  # 1B trainable over 8 ranks: 16 bytes each / 8
    assert (full.weights_gb, full.gradients_gb, full.optimizer_gb, full.ema_gb) == (0.5, 0.5, 1.0, 0.0)
    assert full.total_gb == 2.0
    lora = state_memory_per_rank(10_000_000, 2 * 12_000_000_000, 8, ema=True)  # 12B bf16 base + 10M adapters
    assert lora.weights_gb == pytest.approx((24e9 + 40e6) / 8 / 1e9)
    assert lora.ema_gb == pytest.approx(40e6 / 8 / 1e9)
    assert lora.describe().startswith("3.0 GB per rank over 8 FSDP2 shards (weights 3.0, ")
    assert "activations not included" in lora.describe()
    assert state_memory_per_rank(1_000_000, 0, 1).describe().startswith("16.0 MB per rank over 1 FSDP2 shards")
    with pytest.raises(ValueError, match="shards"):
        state_memory_per_rank(1, 0, 0)


def test_the_start_summary_prints_the_training_state_estimate():
    from spindle.train.memory import state_memory_per_rank
    from spindle.train.run_summary import format_start

    estimate = state_memory_per_rank(1_000_000_000, 0, 8)
    start = dict(
        family="wan",
        task="flow_matching",
        max_steps=3,
        global_batch_size=8,
        precision="bf16",
        data={"rows": 4},
        epochs=6.0,
        parameters={"trainable": 10, "frozen": 5},
        state_memory=asdict(estimate),
        mesh={"world": 1, "dims": {}, "roles": {}},
        resume={"step": 0, "checkpoint": None},
        outputs={"folder": "out"},
        extra={},
    )
    assert f"training state: {estimate.describe()}" in format_start(start).splitlines()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_is_a_valid_job_for_its_family(path, tiny_checkpoint):
    from spindle.api import job_task

    family = get_family(family_of_config(path))
    raw = load_raw(path)
    raw["model"]["path"] = str(tiny_checkpoint(family.name))  # the real checkpoint is not here: same family
    cfg = validate_config(raw, job_task(family).config_class)
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


KEY = re.compile(r"^\s*[A-Za-z_][\w.]*:\s*(?P<value>[^#]*?)\s*(?P<comment>#.*)?$")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_key_of_a_shipped_config_is_commented(path):
    """Sections (`train:`) need no comment; every key with a value says what it does on its line."""
    bare = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        m = KEY.match(line)
        if m and m.group("value") and not m.group("comment"):
            bare.append(f"{path.name}:{number}: {line.strip()}")
    assert bare == []


def test_a_config_for_another_kind_of_model_says_what_the_checkpoint_was_detected_as(tiny_qwen3):
    """A DiT config pointed at a language model: the schema follows the detected family, and the error
    says so instead of only calling data.resolution unknown."""
    from spindle.api import load_job_config
    from spindle.config import ConfigError

    wan = next(p for p in CONFIGS if p.name == "wan_tiny.yaml")
    with pytest.raises(ConfigError) as err:
        load_job_config(wan, [f"model.path={tiny_qwen3}"])
    message = str(err.value)
    assert "is a qwen3 causal_lm checkpoint" in message and "causal_lm task's schema" in message
    assert "unknown key 'data.resolution'" in message
