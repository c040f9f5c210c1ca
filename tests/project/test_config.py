"""Config errors name the bad key (with a did-you-mean) before any work starts."""

import re

import pytest

from spindle.api import load_job_config
from spindle.config import ConfigError, apply_override
from tests.conftest import run_spindle, train_overrides


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """The schema depends on the checkpoint's kind: a folder that declares a WanPipeline is enough."""
    root = tmp_path_factory.mktemp("wan")
    (root / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return root


@pytest.fixture
def BASE(wan_folder):
    return [f"model.path={wan_folder}", "data.path=/d"]


def test_unknown_key_names_path_and_suggestion(BASE):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, [*BASE, "train.lrr=1e-4"])
    assert "unknown key 'train.lrr'" in str(e.value)
    assert "did you mean 'train.lr'" in str(e.value)


@pytest.mark.parametrize(
    "given,expected",
    [
        ("train.learning_rate=1e-4", "train.lr"),
        ("train.batch_size=4", "train.global_batch_size"),
        ("data.max_seq_len=64", None),
    ],
)
def test_names_from_other_tools_suggest_spindles_key(BASE, given, expected):
    """Spelling alone does not lead from learning_rate to lr: the names other trainers use are known."""
    with pytest.raises(ConfigError) as e:
        load_job_config(None, [*BASE, given])
    key = given.partition("=")[0]
    assert f"unknown key '{key}'" in str(e.value)
    if expected:
        assert f"did you mean '{expected}'" in str(e.value)


def test_a_check_across_keys_names_them_without_dumping_the_config(BASE):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, [*BASE, "train.global_batch_size=3", "train.micro_batch_size=2"])
    message = str(e.value)
    assert "train.global_batch_size (3) must be a multiple of train.micro_batch_size (2)" in message
    assert "<root>" not in message and "'model'" not in message and len(message) < 200


def test_unknown_section_suggests_section(BASE):
    with pytest.raises(ConfigError, match="did you mean 'checkpoint'"):
        load_job_config(None, [*BASE, "checkpoints.every_steps=5"])


def test_wrong_type_names_key_and_value(BASE):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, [*BASE, "train.max_steps=lots"])
    assert "'train.max_steps'" in str(e.value) and "'lots'" in str(e.value)


def test_missing_required_key():
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        load_job_config(None, ["data.path=/d"])


def test_overrides_parse_yaml_values(BASE):
    cfg = load_job_config(
        None, [*BASE, "train.lr=3e-4", "data.resolution=[48, 64]", "train.gradient_checkpointing=true"]
    )
    assert cfg.train.lr == 3e-4
    assert cfg.data.resolution == (48, 64)
    assert cfg.train.gradient_checkpointing is True


def test_batch_sizes_must_divide(BASE):
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_job_config(None, [*BASE, "train.global_batch_size=5", "train.micro_batch_size=2"])


def test_malformed_override():
    with pytest.raises(ConfigError, match=re.escape("key.sub=value")):
        apply_override({}, "train.lr")


def test_yaml_file_and_cli_error_exit(tmp_path, wan_folder):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {wan_folder}}}\ndata: {{path: /d, resolutoin: [64, 64]}}\n")
    proc = run_spindle("train", cfg)
    assert proc.returncode == 2
    assert "unknown key 'data.resolutoin'; did you mean 'data.resolution'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_duplicate_section_or_key_names_it_and_its_lines(tmp_path, wan_folder, spindle_cli):
    # PyYAML alone keeps the second `train:` and drops lr=1e-4 without a word
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {wan_folder}\ntrain:\n  lr: 1.0e-4\ndata:\n  path: /d\ntrain:\n  max_steps: 5\n")
    r = spindle_cli("train", cfg)
    assert r.returncode == 2
    assert f"{cfg}:7: 'train' is given twice (also on line 3)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # a key inside a section, named by its dotted path
    cfg.write_text(f"model: {{path: {wan_folder}}}\ndata: {{path: /d}}\ntrain:\n  lr: 1.0e-4\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{cfg}:5: 'train.lr' is given twice (also on line 4)")):
        load_job_config(cfg)
    # anchors and merges are still YAML: a merged key is no duplicate, and the file still loads
    cfg.write_text(
        f"model: {{path: {wan_folder}}}\ndata: {{path: /d}}\nbase: &b {{lr: 1.0e-4}}\n"
        "train:\n  <<: *b\n  max_steps: 5\n"
    )
    from spindle.config import load_raw

    assert load_raw(cfg)["train"] == {"lr": 1.0e-4, "max_steps": 5}


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("nope.yaml")):
        load_job_config(tmp_path / "nope.yaml")


def test_missing_model_folder_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_job_config(None, [f"model.path={tmp_path / 'nowhere'}", "data.path=/d"])


def test_unknown_model_type_lists_known_ones(tmp_path):
    from spindle.registry import UnknownModelError

    (tmp_path / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(UnknownModelError, match="'not-a-model'"):
        load_job_config(None, [f"model.path={tmp_path}", "data.path=/d"])


# The parallel layout is checked once in `spindle train`, before --nproc launches anything: these run
# in-process (spindle_cli), and a check moved after the launch would start torchrun and fail here.


def test_world_size_mismatch_fails_before_launch(tiny_wan, shapes_videos, tmp_path, spindle_cli):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    args = train_overrides(tiny_wan, shapes_videos, tmp_path / "o", parallel__dp_shard=3)
    r = spindle_cli("train", cfg, *args, "--nproc", "2")
    assert r.returncode == 2
    assert "but the world size is 2" in r.stderr
    assert not (tmp_path / "o").exists()


def test_sp_not_dividing_heads_fails_before_launch(tiny_wan, shapes_videos, tmp_path, spindle_cli):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    # the tiny Wan transformer has 4 heads
    args = train_overrides(tiny_wan, shapes_videos, tmp_path / "o", parallel__sp=3, parallel__dp_shard=1)
    r = spindle_cli("train", cfg, *args, "--nproc", "3")
    assert r.returncode == 2
    assert "4 attention heads" in r.stderr and "parallel.sp=3" in r.stderr
    assert not (tmp_path / "o").exists()
