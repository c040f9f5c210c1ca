"""`spindle patchgen --check` passes on the tree and catches hand edits and unregenerated config changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import spindle
from spindle.cli import main

FAMILY = Path(spindle.__file__).parent / "models" / "qwen3"
GENERATED = "spindle/models/qwen3/generated/patched_modeling_qwen3"


@pytest.fixture
def qwen3_copy(tmp_path) -> Path:
    """spindle/models/qwen3 (config + checked-in outputs) copied to tmp, in the same package layout."""
    family = tmp_path / "spindle" / "models" / "qwen3"
    shutil.copytree(FAMILY, family, ignore=shutil.ignore_patterns("__pycache__"))
    for pkg in (tmp_path / "spindle", tmp_path / "spindle" / "models"):
        (pkg / "__init__.py").touch()
    return family


def test_check_passes_on_the_tree(capsys):
    assert main(["patchgen", "--check"]) == 0
    configs = sorted((Path(spindle.__file__).parent / "models").glob("*/patches.py"))  # qwen3, llama, qwen3_moe
    assert len(configs) >= 3
    assert f"{len(configs)} config(s) up to date" in capsys.readouterr().out
    assert main(["patchgen", "--check", "spindle.models.llama.patches"]) == 0  # a config as a module name


def test_check_passes_on_an_untouched_copy(qwen3_copy, capsys):
    assert main(["patchgen", "--check", str(qwen3_copy / "patches.py")]) == 0


def test_hand_edit_fails_naming_the_file_and_fix_repairs_it(qwen3_copy, capsys):
    generated = qwen3_copy / "generated" / "patched_modeling_qwen3.py"
    original = generated.read_text()
    generated.write_text(original.replace("Hey, are you conscious?", "Hey, are you conscious (hand edit)?"))
    config = str(qwen3_copy / "patches.py")

    assert main(["patchgen", "--check", config]) == 1
    captured = capsys.readouterr()
    assert f"DRIFT {GENERATED}.py" in captured.out
    assert "Hey, are you conscious (hand edit)?" in captured.out  # the first differing lines are shown
    assert f"{GENERATED}.diff" not in captured.out  # the diff file was not touched
    assert "Never edit generated/ by hand" in captured.err

    assert main(["patchgen", "--check", "--fix", config]) == 0
    assert generated.read_text() == original
    assert main(["patchgen", "--check", config]) == 0


def test_config_change_without_regenerating_fails_and_fix_regenerates(qwen3_copy, capsys):
    patches = qwen3_copy / "patches.py"
    text = patches.read_text()
    assert 'description="loss from hidden states' in text
    patches.write_text(
        text.replace('description="loss from hidden states', 'description="CHANGED loss from hidden states')
    )
    config = str(patches)

    assert main(["patchgen", "--check", config]) == 1
    out = capsys.readouterr().out
    assert f"DRIFT {GENERATED}.py" in out and f"DRIFT {GENERATED}.diff" in out
    assert "CHANGED loss from hidden states" in out

    assert main(["patchgen", "--check", "--fix", config]) == 0
    assert "CHANGED loss from hidden states" in (qwen3_copy / "generated" / "patched_modeling_qwen3.py").read_text()
    assert main(["patchgen", "--check", config]) == 0


def test_missing_output_is_drift_and_plain_run_writes_it(qwen3_copy, capsys):
    (qwen3_copy / "generated" / "patched_modeling_qwen3.diff").unlink()
    config = str(qwen3_copy / "patches.py")
    assert main(["patchgen", "--check", config]) == 1
    assert "missing: never generated" in capsys.readouterr().out
    assert main(["patchgen", config]) == 0
    assert main(["patchgen", "--check", config]) == 0


def test_broken_config_is_one_clear_error(qwen3_copy, capsys):
    patches = qwen3_copy / "patches.py"
    patches.write_text(patches.read_text().replace('"Qwen3ForCausalLM.forward"', '"Qwen3ForCausalLm.forward"'))
    assert main(["patchgen", "--check", str(patches)]) == 2
    err = capsys.readouterr().err
    assert "patch delegate_method 'Qwen3ForCausalLm.forward'" in err and "spindle/models/qwen3/patches.py" in err
    assert "class 'Qwen3ForCausalLm' not found in transformers.models.qwen3.modeling_qwen3" in err
    assert "close names upstream: Qwen3ForCausalLM" in err


def test_bad_arguments(tmp_path, capsys):
    assert main(["patchgen", "--fix"]) == 2
    assert "--fix only goes with --check" in capsys.readouterr().err
    assert main(["patchgen", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty.py").write_text("x = 1\n")
    assert main(["patchgen", str(tmp_path / "empty.py")]) == 2
    assert "must define `config = PatchConfig" in capsys.readouterr().err
