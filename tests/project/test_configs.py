"""The shipped configs (configs/*.yaml): each is a valid job for the family its file name names
(`<family>_*.yaml`, validated against that family's task schema), and every key says what it does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spindle.config import load_raw, validate_config
from spindle.registry import family_names, get_family

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def family_of_config(path: Path) -> str:
    """The longest registered family name the file name starts with (qwen3_moe_tiny -> qwen3_moe)."""
    names = [n for n in family_names() if path.stem.startswith(n + "_")]
    assert names, f"{path.name}: name it <family>_<what>.yaml with a family of {family_names()}"
    return max(names, key=len)


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
