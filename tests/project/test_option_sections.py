"""One option system: engine options, request limits and server limits are typed sections
(`spindle.engine_config`) whose fields give every `spindle generate` / `spindle serve` flag and
docs/cli.md; the Python API takes the same names and names the closest one on a typo."""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args, get_origin

import pytest

from spindle.commands.flags import flag_names, section_from_args, section_values, unwrap_optional
from spindle.commands.reference import DOC, cli_reference
from spindle.config import ConfigError, OptionSection
from spindle.engine_config import AdapterConfig, EngineConfig, RequestLimits, ServeLimits, ServeSettings

SECTIONS: dict[str, tuple[type[OptionSection], ...]] = {
    "generate": (EngineConfig,),
    "serve": (EngineConfig, RequestLimits, ServeLimits, ServeSettings, AdapterConfig),
}


def command_parser(command: str) -> argparse.ArgumentParser:
    from spindle.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def other_value(section: type[OptionSection], name: str) -> tuple[list[str], Any]:
    """Command-line words that set field `name` to a value other than its default, and that value."""
    info = section.model_fields[name]
    kind, _ = unwrap_optional(info.annotation)
    flag = flag_names(section)[name]
    default = section().model_dump()[name]
    if kind is bool:
        return ([f"--no-{flag[2:]}"] if default else [flag]), not default
    if get_origin(kind) is Literal:
        choice = next(c for c in get_args(kind) if c != default)
        return [flag, choice], choice
    if get_origin(kind) is dict or kind is dict:
        return [flag, "max_skip_steps=2", flag, "mode=fast"], {"max_skip_steps": 2, "mode": "fast"}
    value = {int: 7, float: 2.5, str: "somewhere"}[kind]
    return [flag, str(value)], value


@pytest.mark.parametrize("command", SECTIONS)
def test_every_field_has_a_flag_that_sets_it(command):
    parser = command_parser(command)
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for section in SECTIONS[command]:
        for name, info in section.model_fields.items():
            kind, _ = unwrap_optional(info.annotation)
            if isinstance(kind, type) and issubclass(kind, OptionSection):
                continue  # a nested section: its own fields have the flags
            flag = flag_names(section)[name]
            assert flag in by_flag, f"{section.__name__}.{name} has no flag {flag} on spindle {command}"
            action = by_flag[flag]
            assert info.description and action.help.startswith(info.description), f"{flag}: help is not the field's"
            if kind is bool:
                assert f"--no-{flag[2:]}" in action.option_strings
            if get_origin(kind) is Literal:
                assert tuple(action.choices) == get_args(kind)
            words, value = other_value(section, name)
            args = parser.parse_args(_required(command))
            assert section_values(args, section)[name] == section().model_dump()[name], f"{flag}: default differs"
            args = parser.parse_args([*_required(command), *words])
            assert section_values(args, section)[name] == value, flag


def _required(command: str) -> list[str]:
    return ["--model", "m", "--prompt", "p", "--out", "o"] if command == "generate" else ["--model", "m"]


def test_every_serve_flag_but_the_model_and_launcher_comes_from_a_section():
    """`spindle serve`'s own settings (address, queue, results, shutdown, warm-up) are `ServeSettings`
    fields like the engine options and limits, not hand-written flags."""
    generated = {flag for section in SECTIONS["serve"] for flag in flag_names(section).values()}
    generated |= {f"--no-{flag[2:]}" for flag in generated}
    flags = {s for a in command_parser("serve")._actions for s in a.option_strings}
    assert flags - generated == {"-h", "--help", "--model", "--nproc", "--verbose"}


def test_flags_without_a_hand_written_mapping_reach_the_engine():
    """`vae_dtype`, `fast_vae` and `fast_mlp` had no flag before the flags came from the fields."""
    parser = command_parser("generate")
    args = parser.parse_args([*_required("generate"), "--vae-dtype", "bf16", "--no-fast-vae", "--no-fast-mlp"])
    engine = section_from_args(args, EngineConfig)
    assert (engine.vae_dtype, engine.fast_vae, engine.fast_mlp) == ("bf16", False, False)
    assert engine.onednn_vae is False


def test_cli_reference_is_up_to_date():
    assert DOC.read_text() == cli_reference(), "docs/cli.md is stale: run python -m spindle.commands.reference"


def test_cli_reference_documents_every_engine_and_limit_flag():
    text = cli_reference()
    for sections in SECTIONS.values():
        for section in sections:
            for name, flag in flag_names(section).items():
                if name != "request":
                    assert flag in text, flag


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(cahce="fbc"), "unknown engine option 'cahce'; did you mean 'cache'?"),
        (dict(compiel=True), "unknown engine option 'compiel'; did you mean 'compile'?"),
        (dict(dtype="float33"), "dtype must be one of 'float32', 'fp32', 'bfloat16', 'bf16', 'float16' or 'fp16'"),
        (dict(sp=0), "sp must be >= 1; got 0"),
        (dict(sp=True), "sp: input should be a valid integer; got True"),
        (dict(lora_scale="1"), "lora_scale: input should be a valid number; got '1'"),
        (dict(exact=True, compile=True), "cannot be combined with compile"),
        (dict(compile_backend="aot_eager"), "compile_backend='aot_eager' applies to compile; set compile too"),
        (dict(compile=True, compile_backend="eager"), "compile_backend must be one of 'inductor' or 'aot_eager'"),
    ],
)
def test_bad_engine_options_fail_in_one_line_naming_the_option(options, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_limits_take_zero_as_no_bound_and_refuse_negative():
    assert RequestLimits(max_pixels=0).max_pixels is None
    assert RequestLimits(max_pixels=None).max_pixels is None
    with pytest.raises(ConfigError, match=r"max_steps must be >= 0 \(0: no limit\); got -1"):
        RequestLimits(max_steps=-1)
    with pytest.raises(ConfigError, match=r"unknown server limit 'max_body_byte'; did you mean 'max_body_bytes'\?"):
        ServeLimits(max_body_byte=4096)
    reported = ServeLimits(request=RequestLimits(max_frames=9), max_results=3).as_dict()
    assert reported["max_frames"] == 9 and reported["max_results"] == 3 and "request" not in reported


@pytest.mark.parametrize(
    "words, message",
    [
        (["--cache-threshold", "-1"], "--cache-threshold must be >= 0"),
        (["--cache", "fbc", "--cache-option", "treshold=1"], "unknown fbc cache option(s) ['treshold']"),
        (["--cache-option", "novalue"], "--cache-option takes KEY=VALUE"),
        (["--min-psnr", "0", "--cache", "auto"], "--min-psnr must be > 0"),
    ],
)
def test_bad_engine_flags_exit_2_naming_the_flag_before_loading(spindle_cli, tmp_path, words, message):
    r = spindle_cli("generate", "--model", tmp_path / "absent", "--prompt", "p", "--out", tmp_path / "o.png", *words)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cache_names_are_the_policies_and_auto():
    from spindle.infer.caches import CACHE_NAMES, POLICIES

    assert set(CACHE_NAMES) == {*POLICIES, "auto"} and len(CACHE_NAMES) == len(POLICIES) + 1


def test_dtype_names_all_map_to_torch_dtypes():
    from spindle.engine_config import DType
    from spindle.infer.pipeline import DTYPES

    assert set(DTYPES) == set(get_args(DType))
