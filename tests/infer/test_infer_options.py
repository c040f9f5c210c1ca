"""Family sampling options: declared once per family (`FamilyOptions` on its `DiTFamily`), built into the
family's strict pydantic schema (`spindle.contracts.sampling`) that validates a request once, and from which
`spindle generate`'s flags and the server's request fields are generated, with no family code."""

from __future__ import annotations

import argparse

import pytest

from spindle.commands.flags import add_sampling_arguments, sampling_values
from spindle.contracts.options import FamilyOptions, Option, needs_negative_prompt
from spindle.contracts.request import RequestError, SamplingParams
from spindle.contracts.sampling import sampling_schema
from spindle.infer.options import request_model

OPTIONS = FamilyOptions(
    extra=(
        Option("true_cfg_scale", float, 4.0, "true CFG", minimum=0.0, rule=needs_negative_prompt),
        Option("shift", float, 3.0, "sigma shift", minimum=1.0, maximum=10.0),
        Option("clean_text", bool, True, "clean prompts"),
    )
)


def validate(**extra) -> dict:
    negative = extra.pop("negative_prompt", None)
    return (
        sampling_schema(OPTIONS, "fam")
        .validate(SamplingParams(prompt="x", negative_prompt=negative, extra=extra))
        .extra
    )


def test_valid_options_are_typed_and_defaults_are_declared():
    assert validate(true_cfg_scale=2, negative_prompt="", shift=4.5) == {"true_cfg_scale": 2.0, "shift": 4.5}
    assert isinstance(validate(true_cfg_scale=2, negative_prompt="")["true_cfg_scale"], float)
    assert OPTIONS.defaults() == {"true_cfg_scale": 4.0, "shift": 3.0, "clean_text": True}


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(strength=0.5), r"strength is not an option of fam \(its options: true_cfg_scale, shift, clean_text\)"),
        (dict(shift="3"), r"shift must be a number between 1 and 10 for fam; got '3'"),
        (dict(shift=True), r"shift must be a number between 1 and 10 for fam; got True"),
        (dict(shift=11.0), r"shift must be between 1 and 10 for fam; got 11.0"),
        (dict(clean_text=1), r"clean_text must be a bool for fam; got 1"),
        (dict(true_cfg_scale=2.0), r"true_cfg_scale: true_cfg_scale=2 enables CFG only with a negative_prompt"),
    ],
)
def test_bad_options_name_family_and_field(extra, message):
    with pytest.raises(RequestError, match=message):
        validate(**extra)


def test_a_default_value_is_never_refused():
    """The default true_cfg_scale (4) without a negative prompt is what a request without the option runs with,
    so giving it is never a rule error; a non-default value still is one."""
    assert validate(true_cfg_scale=4.0)["true_cfg_scale"] == 4.0
    with pytest.raises(RequestError, match="enables CFG only with a negative_prompt"):
        validate(true_cfg_scale=4.5)


def test_an_unknown_field_names_the_closest_valid_one():
    with pytest.raises(RequestError, match=r"shfit is not an option of fam \(its options: .*\); did you mean 'shift'"):
        validate(shfit=4.0)
    with pytest.raises(RequestError, match=r"did you mean 'num_inference_steps'") as e:
        validate(num_inference_step=4)
    assert e.value.field == "num_inference_step"


def test_the_schema_is_a_strict_frozen_pydantic_model_with_the_bounds():
    from pydantic import ValidationError

    schema = sampling_schema(OPTIONS, "fam")
    shift = schema.model.model_json_schema()["properties"]["shift"]
    assert shift["anyOf"][0] == {"type": "number", "minimum": 1.0, "maximum": 10.0}
    parsed = schema.parse({"prompt": "x", "shift": 2})
    assert parsed.shift == 2.0 and isinstance(parsed.shift, float)
    with pytest.raises(ValidationError, match="frozen"):
        parsed.shift = 3.0


def test_declarations_must_not_shadow_common_fields_or_repeat():
    with pytest.raises(ValueError, match=r"\['guidance_scale'\] repeat a common SamplingParams field"):
        sampling_schema(FamilyOptions(extra=(Option("guidance_scale", float, 1.0, "x"),)), "x")
    sampling_schema(OPTIONS, "fam")
    with pytest.raises(ValueError, match=r"\['a'\] are declared twice"):
        FamilyOptions(extra=(Option("a", int, 1, "x"), Option("a", int, 2, "y")))
    with pytest.raises(TypeError, match="type must be one of"):
        Option("a", list, [], "x")


class Fam:
    def __init__(self, name, options):
        self.name, self.options = name, options


def test_cli_flags_come_from_every_familys_declaration():
    p = argparse.ArgumentParser()
    add_sampling_arguments(p, [Fam("a", OPTIONS), Fam("b", FamilyOptions(extra=(OPTIONS.extra[0],)))])
    help_text = " ".join(p.format_help().split())
    assert "--true-cfg-scale" in help_text and "a default 4.0, b default 4.0; >= 0)" in help_text
    assert "--shift" in help_text and "(a default 3.0; between 1 and 10)" in help_text and "--clean-text" in help_text
    assert "--steps STEPS denoising steps (>= 1)" in help_text  # the common fields, from the same schema
    args = p.parse_args(["--prompt", "x", "--true-cfg-scale", "2.5", "--clean-text", "false", "--steps", "3"])
    # unset flags are left out
    assert sampling_values(args) == {
        "prompt": "x",
        "true_cfg_scale": 2.5,
        "clean_text": False,
        "num_inference_steps": 3,
    }
    clash = Fam("c", FamilyOptions(extra=(Option("shift", int, 3, "x"),)))
    with pytest.raises(TypeError, match=r"families \['a', 'c'\] declare option 'shift' with different types"):
        add_sampling_arguments(argparse.ArgumentParser(), [Fam("a", OPTIONS), clash])


def test_cli_parser_imports_no_torch():
    """Reading every registered family's options for generate's flags imports no torch (the CLI
    parser is built for every command, `spindle --help` included)."""
    import subprocess
    import sys

    code = (
        "import sys, argparse; from spindle.commands.flags import add_sampling_arguments; "
        "from spindle.registry import all_families; "
        "add_sampling_arguments(argparse.ArgumentParser(), all_families()); "
        "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, 'heavy import'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_registered_families_declare_their_options():
    from spindle.contracts.family import DiTFamily
    from spindle.registry import all_families, get_family

    assert [o.name for o in get_family("flux").options.extra] == ["true_cfg_scale"]
    assert get_family("flux").options.defaults() == {"true_cfg_scale": 1.0}
    assert get_family("qwenimage").options.defaults() == {"true_cfg_scale": 4.0}
    assert "embedded guidance" in get_family("flux").options.guidance
    wan = get_family("wan").options
    assert (wan.fps, wan.frame_multiple, wan.extra) == (16, 4, ())
    # `spindle generate --help` lists them with each family's default and guidance meaning
    from spindle.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = " ".join(sub.choices["generate"].format_help().split())
    assert "--true-cfg-scale" in help_text and "(flux default 1.0, flux_kontext default 1.0," in help_text
    assert "qwenimage default 4.0," in help_text
    assert "flux: embedded guidance" in help_text and "wan: classifier-free guidance scale" in help_text
    # --guidance names the diffusion families only: language models are not generated with it
    guidance = help_text.split("--guidance GUIDANCE guidance scale (between 0 and 100);")[1].split("--seed")[0]
    named = {f.name for f in all_families() if f"{f.name}: " in guidance}
    assert (
        named
        == {f.name for f in all_families() if isinstance(f, DiTFamily)}
        == {"flux", "flux_kontext", "qwenimage", "qwenimage_edit", "qwenimage_edit_plus"}
        | {"wan", "wan_i2v", "wan22", "wan22_i2v", "wan22_ti2v"}
        | {"flux2", "flux2_klein", "z_image"}
        | {"hunyuan_video_1_5", "hunyuan_video_1_5_i2v"}
        | {"ltx2", "ltx2_i2v"}
    )


def test_request_fields_come_from_the_declaration():
    from pydantic import ValidationError

    from spindle.serve.schemas import ImageGenerationRequest

    model = request_model(ImageGenerationRequest, sampling_schema(OPTIONS, "fam"))
    body = model.model_validate({"prompt": "x", "true_cfg_scale": 2, "clean_text": False})
    assert body.true_cfg_scale == 2.0 and body.clean_text is False and body.shift is None
    with pytest.raises(ValidationError, match="true_cfg_scale"):
        model.model_validate({"prompt": "x", "true_cfg_scale": "lots"})
    with pytest.raises(ValidationError, match="shift"):  # the schema's bounds, not a bare type
        model.model_validate({"prompt": "x", "shift": 11})
    assert model.model_json_schema()["properties"]["shift"]["anyOf"][0]["maximum"] == 10.0
    # a family without options: the base model, which refuses the field
    assert request_model(ImageGenerationRequest, sampling_schema(FamilyOptions(), "none")) is ImageGenerationRequest
    with pytest.raises(ValidationError, match="true_cfg_scale"):
        ImageGenerationRequest.model_validate({"prompt": "x", "true_cfg_scale": 2})
