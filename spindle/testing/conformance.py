"""The conformance suite's checks: what every DiT family must pass to be registered.

tests/conformance/test_conformance.py runs each check over every flow-matching family in the registry; a new
family is its folder + its registration + passing these (docs/adding-a-model.md). Each check raises
AssertionError naming the family and what differs, so the same functions also show that a broken
family fails (tests/conformance/test_conformance.py::test_a_broken_family_fails_the_suite).

What a family declares for the suite: a `ConformanceSpec` (spindle/models/shared/conformance.py) in its folder's
`conformance.py`, found by family name (spindle.testing.specs), with parity cases, keyword arguments valid both for the stock diffusers pipeline call and for Spindle's
`DiffusionGenerator.generate` (at least one case with classifier-free guidance and one without).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spindle.api import load_generator
from spindle.contracts.family import DiTFamily
from spindle.export.diffusers import load_transformer
from spindle.model_index import read_model_index
from spindle.models.shared.conformance import ConformanceSpec
from spindle.testing.specs import dit_spec

PARITY_ATOL = 1e-5  # fp32 CPU, max abs difference of frames in [0, 1]
SP_RTOL = 1e-5  # loss and gradients of a sequence-parallel layout against one process
TEXT_TOKENS = 16  # model.max_text_length for the tiny checks (divides the SP degrees used here)


def text_tokens(family: DiTFamily) -> int:
    """model.max_text_length for `family`'s checks: TEXT_TOKENS unless its transformer fixes the length."""
    spec = dit_spec(family)
    return spec.text_tokens if spec is not None else TEXT_TOKENS


# ---------------------------------------------------------------- checkpoint and inference


def stock_pipeline(root: Path, pipeline_cls: Any = None) -> Any:
    """The stock diffusers pipeline of `root` (`DiffusionPipeline`, or `pipeline_cls`), loaded with the
    overrides its family's `ConformanceSpec.stock_components` declares (a component whose class cannot
    be built here, e.g. Qwen-Image-Edit's torchvision-only processor)."""
    from diffusers import DiffusionPipeline

    from spindle.registry import resolve_family

    family = resolve_family(root)
    spec = dit_spec(family) if isinstance(family, DiTFamily) else None
    overrides = spec.stock_overrides(root) if spec is not None else {}
    return (pipeline_cls or DiffusionPipeline).from_pretrained(root, **overrides)


def check_stock_load(family: DiTFamily, root: Path) -> None:
    """The tiny checkpoint is a standard diffusers folder: stock `DiffusionPipeline` loads it as the
    family's pipeline class, with the family's transformer class and every model component (VAE, text
    encoders) of the class its `model_index.json` names. (That the stock pipeline then runs it to
    non-constant images of the requested size: `check_inference_parity`'s reference.)"""
    pipe = stock_pipeline(root)
    assert type(pipe).__name__ == family.checkpoint.pipeline, (
        f"{family.name}: stock diffusers loads {root} as {type(pipe).__name__}, not {family.checkpoint.pipeline}"
    )
    transformer = type(pipe.transformer).__name__
    assert transformer == family.checkpoint.transformer, (
        f"{family.name}: the checkpoint's transformer is {transformer}, not {family.checkpoint.transformer}"
    )
    index = read_model_index(root)
    models = {
        k: v[1] for k, v in index.items() if not k.startswith("_") and isinstance(getattr(pipe, k), torch.nn.Module)
    }
    assert {"transformer", "vae", "text_encoder"} <= set(models), f"{family.name}: model components {sorted(models)}"
    for name, cls in models.items():
        loaded = [c.__name__ for c in type(getattr(pipe, name)).__mro__]
        assert cls in loaded, f"{family.name}: stock diffusers loads {name} as {loaded[0]}, model_index.json says {cls}"


def stock_output(root: Path, kwargs: dict[str, Any], names: dict[str, str] | None = None) -> np.ndarray:
    """What the stock diffusers pipeline returns for `kwargs` (+ `seed`; `names`: a family option's stock
    keyword, `ConformanceSpec.stock_names`), as numpy in [0, 1]."""
    pipe = stock_pipeline(root)
    pipe.set_progress_bar_config(disable=True)
    kw = {(names or {}).get(k, k): v for k, v in kwargs.items()}
    seed = kw.pop("seed")
    guided = {k: kw.pop(k) for k in guider_names(root) if k in kw}
    if guided:  # what the pipeline's guider component takes (HunyuanVideo-1.5's guidance_scale)
        pipe.guider = pipe.guider.new(**guided)
    out = pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="np")
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


def guider_names(root: Path) -> tuple[str, ...]:
    """The generate() arguments `root`'s stock pipeline takes through its guider (`ConformanceSpec.stock_guider`)."""
    from spindle.registry import resolve_family

    family = resolve_family(root)
    spec = dit_spec(family) if isinstance(family, DiTFamily) else None
    return spec.stock_guider if spec is not None else ()


def check_reference(family: str, reference: np.ndarray, kwargs: dict[str, Any]) -> None:
    """The stock pipeline's output is an image/video of the requested size, finite and not constant
    (parity with a blank or NaN reference would prove nothing)."""
    size = tuple(reference.shape[-3:-1])
    if "height" in kwargs and "width" in kwargs:
        assert size == (kwargs["height"], kwargs["width"]), f"{family}: stock output is {size}, not the requested size"
    assert np.isfinite(reference).all() and reference.std() > 0.01, f"{family}: stock output is blank or not finite"


def sampling_params(kwargs: dict[str, Any]) -> Any:
    """`generate(**kwargs)`-style keyword arguments -> SamplingParams (unknown names go to `extra`)."""
    import dataclasses

    from spindle.contracts.request import SamplingParams

    common = {f.name for f in dataclasses.fields(SamplingParams)} - {"extra"}
    return SamplingParams(
        **{k: v for k, v in kwargs.items() if k in common}, extra={k: v for k, v in kwargs.items() if k not in common}
    )


def before_denoising(root: Path, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """-> (the default `DiffusionGenerator` of `root`, the request for `kwargs` after the family's
    before-denoising stage: latents, timesteps, prompt embeddings, CFG settings)."""

    gen = load_generator(root)
    return gen, gen.pipeline.stages[0](gen.make_request(gen.validated(sampling_params(kwargs))))


def check_default_params(family: DiTFamily, root: Path, expected: dict[str, Any]) -> None:
    """Spindle's default request (`DiffusionGenerator.defaults`) has the `expected` values (`extra`:
    the family options' defaults), and they are the stock pipeline's: every one the pipeline's
    `__call__` gives a default is that default, and a size it leaves to the checkpoint (None) is its
    `default_sample_size` x `vae_scale_factor`."""

    defaults = load_generator(root).defaults
    got = {k: getattr(defaults, k) for k in expected}
    assert got == expected, f"{family.name}: Spindle's default params {got}, expected {expected}"
    pipeline_cls = family.pipeline_class()
    call = inspect.signature(pipeline_cls.__call__).parameters
    pipe: Any = None
    spec = dit_spec(family)
    for name, value in {**{k: v for k, v in expected.items() if k != "extra"}, **expected.get("extra", {})}.items():
        stock = call[name].default if name in call else None
        if spec is not None and name in spec.stock_guider:
            if pipe is None:
                pipe = stock_pipeline(root, pipeline_cls)
            stock = pipe.guider.config[name]  # the folder's guider's
        # (a None size is left to the input image, as an edit pipeline's __call__ leaves it)
        if stock is None and name in ("height", "width") and value is not None:
            if pipe is None:
                pipe = stock_pipeline(root, pipeline_cls)
            sample_size = getattr(pipe, "default_sample_size", None)
            # a pipeline without one falls back to a fixed size in __call__'s body, which the family declares
            declared = spec.stock_size if spec is not None else None
            if isinstance(declared, tuple):  # (height, width): a pipeline falling back to a non-square size
                declared = declared[("height", "width").index(name)]
            stock = declared if sample_size is None else sample_size * pipe.vae_scale_factor
            assert stock is not None, (
                f"{family.name}: {pipeline_cls.__name__} has no default_sample_size; declare stock_size"
            )
        if stock is not None:
            assert value == stock, f"{family.name}: default {name} is {value}, {pipeline_cls.__name__}'s is {stock}"


def check_cfg_batch_is_one_forward(family: DiTFamily, root: Path, kwargs: dict[str, Any]) -> tuple[int, int]:
    """With classifier-free guidance, the batched step is one transformer forward of batch 2 and equals
    the two forwards of batch 1 (cond, then uncond); text of different lengths (masked families) is
    padded to the longer. -> the (cond, uncond) text lengths."""
    gen, req = before_denoising(root, kwargs)
    assert req.do_cfg, f"{family.name}: {kwargs} does not enable classifier-free guidance"
    stage = gen.pipeline.denoising
    calls: list[tuple[int, int]] = []

    def record(module: Any, args: Any, kw: dict[str, Any]) -> None:
        if "hidden_states" in kw:
            calls.append((kw["hidden_states"].shape[0], kw["encoder_hidden_states"].shape[1]))
        else:  # a transformer taking per-sample lists (Z-Image: x, cap_feats)
            calls.append((len(kw["x"]), max(c.shape[0] for c in kw["cap_feats"])))

    hook = gen.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        t = req.timesteps[0]
        with torch.no_grad():
            stage.cfg_batch = False
            two = stage.predict(req, req.latents, t, 0)
            stage.cfg_batch = True
            one = stage.predict(req, req.latents, t, 0)
    finally:
        hook.remove()
    cond, uncond = req.prompt_embeds.shape[1], req.negative_prompt_embeds.shape[1]
    assert calls == [(1, cond), (1, uncond), (2, max(cond, uncond))], f"{family.name}: transformer calls {calls}"
    torch.testing.assert_close(one, two, atol=PARITY_ATOL, rtol=0, msg=f"{family.name}: batched CFG != two forwards")
    return cond, uncond


def check_request_error(gen: Any, kwargs: dict[str, Any], message: str, field: str | None = None) -> None:
    """`gen.generate(**kwargs)` raises RequestError matching `message` (before running anything), naming
    `field` (given by the raise site, never guessed from the message: the server's 400 names it)."""
    import pytest

    from spindle.contracts.request import RequestError

    with pytest.raises(RequestError, match=message) as err:
        gen.generate(**kwargs)
    if field is not None:
        assert err.value.field == field, f"{message}: RequestError.field is {err.value.field!r}, not {field!r}"


# bad requests every family refuses the same way (the sampling schema: spindle.contracts.sampling): (generate() keyword
# arguments over the family's "nocfg" case, the RequestError message as a regex). A family's own rows
# (what its checkpoint bounds) are its ConformanceSpec.request_errors.
COMMON_REQUEST_ERRORS: tuple[tuple[dict[str, Any], str], ...] = (
    (dict(num_inference_steps=0), r"num_inference_steps must be >= 1; got 0"),
    (dict(num_inference_steps=2.5), r"num_inference_steps must be an integer"),
    (dict(prompt=""), r"prompt must be a non-empty string"),
    (dict(prompt="   "), r"prompt must be a non-empty string"),
    (dict(prompt=[]), r"prompt is required"),
    (dict(guidance_scale=-1.0), r"guidance_scale must be >= 0"),
    (dict(prompt=["a", "b"], negative_prompt=["x"]), r"negative_prompt has 1 entries but prompt has 2"),
    (dict(seed=-3), r"seed must be >= 0"),
)


def request_error_cases(family: DiTFamily) -> list[tuple[dict[str, Any], str]]:
    """The shared rows, then the family's own (`ConformanceSpec.request_errors`)."""
    spec = dit_spec(family)
    own = spec.request_errors if spec is not None else ()
    return [*COMMON_REQUEST_ERRORS, *own]


def check_request_errors(family: DiTFamily, root: Path) -> None:
    """The declaration-driven request checks name the family and the field: an unknown option, each
    declared option's type, bounds and rule, and frames asked of an image family."""
    import re

    from spindle.contracts.options import needs_negative_prompt
    from spindle.contracts.sampling import option_bounds

    gen = load_generator(root)
    spec = dit_spec(family)
    base = dict(spec.parity_cases["nocfg"]) if spec is not None else {}
    known = ", ".join(family.options.names()) or "none"
    check_request_error(
        gen, {**base, "strength": 0.5}, rf"strength is not an option of {family.name} \(its options: {known}\)"
    )
    if gen.spec.media == "image":
        check_request_error(
            gen, {**base, "num_frames": 5}, r"num_frames must be left unset \(or 1\): .* generates images"
        )
    for option in family.options.extra:
        name, bounds = option.name, re.escape(option_bounds(option))
        kind = "a number" if option.type is float else f"a {option.type.__name__}"
        kind += f" {bounds}" if bounds else ""  # (an unbounded option: a bool)
        check_request_error(gen, {**base, name: "3"}, rf"{name} must be {kind} for {family.name}; got '3'")
        if option.minimum is not None:
            low = option.minimum - 1
            check_request_error(
                gen,
                {**base, name: low, "negative_prompt": "x"},
                rf"{name} must be {bounds} for {family.name}; got {low}",
            )
        if option.rule is needs_negative_prompt:
            check_request_error(gen, {**base, name: 3.0}, rf"{name}=3 enables CFG only with a negative_prompt")


def check_inference_parity(
    family: DiTFamily, root: Path, kwargs: dict[str, Any], *, cfg_batch: bool = True, atol: float = PARITY_ATOL
) -> None:
    """Spindle's staged engine, built from the family's own inference spec, gives the stock pipeline's
    output for the same seed. On an export that records its trained text length (`spindle.json`), the
    engine's default max_sequence_length is that length: the stock pipeline is given the same, as the
    export's docs tell a diffusers user to."""
    from spindle.engine_config import EngineConfig
    from spindle.export.record import trained_text_length
    from spindle.infer.generator import DiffusionGenerator
    from spindle.infer.pipeline import InferencePipeline, load_components

    spec = family.inference_spec()
    trained = trained_text_length(root) if spec.follows_trained_text_length else None
    stock_kwargs = kwargs if trained is None else {"max_sequence_length": trained, **kwargs}
    declared = dit_spec(family)
    names = declared.stock_names if declared is not None else {}
    reference = stock_output(root, stock_kwargs, names)
    check_reference(family.name, reference, kwargs)
    options = EngineConfig(cfg_batch=cfg_batch)
    engine = InferencePipeline.build(spec, load_components(root, spec, options), options, root=root)
    result = DiffusionGenerator(engine).generate(**kwargs)
    assert result.frames.shape == reference.shape, (
        f"{family.name}: Spindle output shape {result.frames.shape} != diffusers {reference.shape}"
    )
    diff = float(np.abs(result.frames - reference).max())
    assert diff <= atol, f"{family.name}: Spindle differs from diffusers by {diff:.3g} (max abs) > {atol} for {kwargs}"


def check_generator_parity(
    family: str, root: Path, kwargs: dict[str, Any], *, cfg_batch: bool, stock_kwargs: dict[str, Any] | None = None
) -> None:
    """`load_generator(root, cfg_batch=...).generate(**kwargs)` (the public API, the
    family's default engine) gives the stock pipeline's images for `stock_kwargs` (default: the same
    kwargs) within PARITY_ATOL, as float32 frames, with the three stages timed."""

    reference = stock_output(root, kwargs if stock_kwargs is None else stock_kwargs)
    check_reference(family, reference, kwargs)
    gen = load_generator(root, cfg_batch=cfg_batch)
    result = gen.generate(**kwargs)
    assert gen.family == family and result.media == "image", f"{root}: {gen.family} {result.media}, not {family}"
    assert result.frames.dtype == np.float32 and result.frames.shape == reference.shape, (
        f"{family}: Spindle frames {result.frames.dtype} {result.frames.shape} != diffusers {reference.shape}"
    )
    np.testing.assert_allclose(result.frames, reference, atol=PARITY_ATOL, rtol=0)
    assert set(result.timings) == {"before_denoising", "denoising", "decoding"}, sorted(result.timings)


# ---------------------------------------------------------------- the CLI

CLI_FLAGS = {"num_inference_steps": "--steps", "guidance_scale": "--guidance"}  # the rest: --field-name


def check_generate_cli_png(
    family: DiTFamily, root: Path, out: Path, kwargs: dict[str, Any], run_spindle: Callable[..., Any] | None = None
) -> None:
    """`spindle generate` with the flags for `kwargs` (generate()'s keyword arguments, family options included)
    names the family and writes a png holding what `DiffusionGenerator.generate(**kwargs)` returns, to the 8-bit
    rounding. `run_spindle(*argv)` runs the command (-> returncode, stdout, stderr): by default a real process, as
    users run it; the per-family suite passes `spindle.cli.main` in the test process (the same parser and command,
    without a fresh interpreter's imports per family; real processes are tests/infer/test_infer_cli.py's). A family
    option in `kwargs` must change generate()'s image (a case that sets it to no effect tests nothing); on a tiny
    model that change can be under the png's rounding, so a dropped flag shows in the family's one-line option
    errors (e.g. tests/infer/test_qwenimage.py::test_generate_cli_option_errors_are_one_line)."""
    from PIL import Image

    from spindle.testing.multiprocess import run_spindle as in_a_process

    run = in_a_process if run_spindle is None else run_spindle

    if "image" in kwargs:  # input images go to the CLI as files (`--image PATH`, repeated), generate() reads the same
        images = kwargs["image"] if isinstance(kwargs["image"], list) else [kwargs["image"]]
        paths = [out.with_name(f"{out.stem}-input{i}.png") for i in range(len(images))]
        for image, path in zip(images, paths, strict=True):
            image.save(path)
        kwargs = {**kwargs, "image": [str(p) for p in paths]}
    flags = [
        str(a)
        for k, v in kwargs.items()
        for item in (v if k == "image" else [v])
        for a in (CLI_FLAGS.get(k, "--" + k.replace("_", "-")), item)
    ]
    command = ["generate", "--model", str(root), *flags, "--out", str(out)]
    r = run(*command)
    assert r.returncode == 0, f"{family.name}: spindle {' '.join(command)} failed: {r.stderr[-3000:]}"
    assert f"family {family.name}" in r.stdout, f"{family.name}: the output does not name the family: {r.stdout}"
    image = np.asarray(Image.open(out))
    size = (kwargs["height"], kwargs["width"], 3)
    assert image.shape == size and image.dtype == np.uint8 and image.std() > 1, (
        f"{family.name}: the png is {image.shape} {image.dtype} (std {image.std():.2f}), not a {size} uint8 image"
    )
    gen = load_generator(root)
    frames = gen.generate(**kwargs).frames
    diff = np.abs(image.astype(np.float32) - frames[0] * 255).max()
    assert diff <= 1.0, f"{family.name}: the png differs from generate()'s image by {diff} of 255"
    spec = dit_spec(family)
    shown = spec.cli_option if spec is not None else None
    for name in family.options.names():
        if name in kwargs and shown in (None, name):
            default = gen.generate(**{k: v for k, v in kwargs.items() if k != name}).frames
            assert np.abs(default - frames).max() > 1e-3, f"{family.name}: {name} changes nothing; pick another value"


# ---------------------------------------------------------------- training


def training_batch(family: DiTFamily, samples: int = 2, frames: int | None = None) -> dict[str, Any]:
    """A raw loader batch at the family's demo size (`frames`: other than the demo's): pixels [B, 3, F, H, W] in
    [-1, 1], captions, indices."""
    if family.demo is None:
        raise AssertionError(f"family {family.name!r} has no DemoSpec (sizes the suite trains at)")
    (height, width) = family.demo.size
    frames = frames or family.demo.num_frames
    g = torch.Generator().manual_seed(0)
    batch = {
        "pixels": torch.rand(samples, 3, frames, height, width, generator=g) * 2 - 1,
        "caption": ["a red circle moves left", "a blue square on the right"][:samples],
        "index": torch.arange(samples),
    }
    spec = dit_spec(family)
    sources = spec.train_sources if spec is not None else 0
    if not sources and family.options.images[0] and frames == 1:  # an image-editing family's required sources
        sources = min(2, family.options.images[1])
    if sources:  # edit families: the source images (spindle.data.edit_pairs) [B, N, 3, H, W], sized as the target
        batch["images"] = torch.rand(samples, sources, 3, height, width, generator=g) * 2 - 1
    return batch


def condition_model(family: DiTFamily, root: Path) -> Any:
    """The family's condition model on `root` (CPU, fp32, the suite's text length)."""
    return family.condition_model_cls().from_pretrained(
        root, torch.device("cpu"), torch.float32, max_text_length=text_tokens(family)
    )


def training_inputs(family: DiTFamily, root: Path, condition: Any = None, frames: int | None = None) -> dict[str, Any]:
    """The transformer's training inputs (+ "target", "sigmas") for `training_batch`, at step 0."""
    from spindle.train.tasks.flow_matching import sample_generator

    if condition is None:
        condition = condition_model(family, root)
    batch = training_batch(family, frames=frames)
    generators = [sample_generator(0, 0, int(i)) for i in batch["index"]]
    return condition.training_inputs(condition.encode(batch), generators)


def check_training_inputs(family: DiTFamily, root: Path, condition: Any = None) -> None:
    """The condition model's inputs are exactly forward kwargs of the transformer, and the target has
    the shape of its prediction (so the flow-matching MSE compares like with like)."""
    condition = condition or condition_model(family, root)
    inputs = training_inputs(family, root, condition)
    missing = {"target", "sigmas"} - set(inputs)
    assert not missing, f"{family.name}: training_inputs must return {sorted(missing)}"
    target, sigmas = inputs.pop("target"), inputs.pop("sigmas")
    inputs.pop("loss_mask", None)  # the task's, not the transformer's
    model = load_transformer(root)
    params = inspect.signature(model.forward).parameters
    unknown = sorted(set(inputs) - set(params))
    assert not unknown, f"{family.name}: training inputs {unknown} are not arguments of {type(model).__name__}.forward"
    with torch.no_grad():
        pred = condition.target_prediction(model(**inputs, return_dict=False)[0], target)
    assert pred.shape == target.shape, f"{family.name}: prediction {tuple(pred.shape)} vs target {tuple(target.shape)}"
    assert sigmas.shape == (target.shape[0],) and bool(((sigmas > 0) & (sigmas < 1)).all()), (
        f"{family.name}: sigmas must be one value in (0, 1) per sample, got {sigmas}"
    )


def check_condition_rejects_bad_pixels(family: DiTFamily, root: Path) -> None:
    """The condition model refuses, with the shape in the message, a size the VAE x patching does not
    divide and (image families) a video."""
    import pytest

    cls = family.condition_model_cls()
    condition = cls.from_pretrained(root, torch.device("cpu"), torch.float32, max_text_length=text_tokens(family))
    assert family.demo is not None
    frames, (height, width) = family.demo.num_frames, family.demo.size

    def encode(*shape: int) -> None:
        condition.encode({"pixels": torch.zeros(1, 3, *shape), "caption": ["x"], "index": [0]})

    if frames == 1:
        with pytest.raises(ValueError, match=r"generates images: pixels must be \[B, C, 1, H, W\]"):
            encode(5, height, width)
    with pytest.raises(ValueError, match=rf"divisible by \d+; got {height - 2}x{width}"):
        encode(frames, height - 2, width)


def get_conformance(name: str) -> ConformanceSpec:
    spec = dit_spec(name)
    assert spec is not None, f"{name}: no ConformanceSpec (its folder's conformance.py)"
    return spec


def inference_tokens(root: Path, height: int, width: int, num_frames: int) -> int:
    """The tokens the transformer sees per sample at this size, as the inference engine counts them
    (the family's before-denoising stage and `sequence_length`): an independent count for the trainer's.
    An edit family's count includes its sources', given as training has them (`ConformanceSpec`)."""
    from PIL import Image

    from spindle.contracts.request import Req

    kw: dict[str, Any] = dict(prompt="x", height=height, width=width, num_frames=num_frames, num_inference_steps=2)
    gen = load_generator(root)
    family = gen.pipeline.spec.family
    spec = get_conformance(family)
    low, _ = gen.options.images
    if spec.train_sources:  # sources given as training has them (FLUX.1 Kontext)
        kw.update(spec.train_request, image=[Image.new("RGB", (width, height))] * spec.train_sources)
    elif low:  # input images the size of the training samples (an edit family's reference tokens count)
        kw["image"] = [Image.new("RGB", (width, height))] * low
    params = sampling_params({**kw, **spec.token_request}).merged_with(gen.defaults)
    req = Req(
        params=params, device=gen.pipeline.device, raw_latent_shape=gen.pipeline.before_denoising.latent_shape(params)
    )
    tokens = gen.spec.sequence_length(req, gen.transformer)
    assert tokens is not None, f"{gen.family}: its inference spec does not count the transformer's tokens"
    return int(tokens)


def check_overfit(family: DiTFamily, losses: list[float]) -> None:
    """A few samples, a high learning rate: the loss must clearly fall (the inputs carry signal)."""
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < 0.8 * first, f"{family.name}: the loss did not fall when overfitting ({first:.4f} -> {last:.4f})"


def trained_component(family: DiTFamily, root: Path) -> str:
    """The checkpoint component the suite's training runs train (`ConformanceSpec.train_overrides`)."""
    spec = dit_spec(family)
    expert = spec.train_overrides.get("train__expert") if spec is not None else None
    index = read_model_index(root)
    return family.condition_model_cls().trained_component(index, expert)


def check_export_round_trip(family: DiTFamily, base: Path, export: Path, trained: dict[str, torch.Tensor]) -> None:
    """The export loads in stock diffusers as the family's pipeline, every tensor of the trained component
    equal to the trained one (which differs from the base checkpoint's), its config.json with diffusers'
    keys only; every other file of the base folder is copied byte for byte (a two-expert checkpoint's
    other expert too)."""
    import json

    from spindle.export.record import EXPORT_RECORD

    component = trained_component(family, base)
    keys = set(json.loads((export / component / "config.json").read_text()))
    base_keys = set(json.loads((base / component / "config.json").read_text()))
    assert keys == base_keys, f"{family.name}: exported config.json keys differ: {sorted(keys ^ base_keys)}"
    pipe = stock_pipeline(export)
    assert type(pipe).__name__ == family.checkpoint.pipeline, f"{family.name}: export loads as {type(pipe).__name__}"
    exported = getattr(pipe, component).state_dict()
    assert exported.keys() == trained.keys(), f"{family.name}: exported keys differ from the trained model's"
    for key, value in trained.items():
        assert torch.equal(exported[key], value), f"{family.name}: exported {key} differs from the trained tensor"
    original = load_transformer(base, component=component).state_dict()
    assert any(not torch.equal(original[k], trained[k]) for k in trained), f"{family.name}: training changed nothing"
    untouched = [
        p.relative_to(base)
        for p in sorted(base.rglob("*"))
        if p.is_file() and p.relative_to(base).parts[0] not in (component, EXPORT_RECORD)
    ]
    for rel in untouched:
        assert (export / rel).read_bytes() == (base / rel).read_bytes(), f"{family.name}: export changed {rel}"


def check_ema_export(family: DiTFamily, export: Path, ema: dict[str, torch.Tensor]) -> None:
    """`export.weights: both`: the EMA is `transformer_ema/` (a trained expert's: `transformer_2_ema/`) beside
    the trained transformer, loaded by stock
    diffusers' transformer class with `subfolder=`, every tensor equal to the average."""
    import json

    import diffusers

    component = trained_component(family, export)  # the trained expert's twin: `<component>_ema`
    name = json.loads((export / component / "config.json").read_text())["_class_name"]
    loaded = getattr(diffusers, name).from_pretrained(export, subfolder=f"{component}_ema").state_dict()
    assert set(ema) <= loaded.keys(), f"{family.name}: transformer_ema lacks {sorted(set(ema) - loaded.keys())[:3]}"
    for key, value in ema.items():
        assert torch.equal(loaded[key], value), f"{family.name}: transformer_ema {key} differs from the EMA"


# ---------------------------------------------------------------- sequence parallel (spawned ranks)


def _mse_step(model: torch.nn.Module, inputs: dict[str, Any], target: torch.Tensor, condition: Any) -> torch.Tensor:
    """One MSE step; a `loss_mask` input (image-to-video: the conditioned first frame's tokens out) weights it."""
    inputs = dict(inputs)
    mask = inputs.pop("loss_mask", None)
    pred = condition.target_prediction(model(**inputs, return_dict=False)[0], target)
    error = (pred.float() - target.float()) ** 2
    loss = (error if mask is None else error * mask.to(error)).mean()
    loss.backward()
    return loss.detach()


def _sp_frames(family: DiTFamily) -> int | None:
    spec = dit_spec(family)
    return spec.sequence_parallel_frames if spec is not None else None


def sp_reference(family: DiTFamily, root: Path) -> dict[str, Any]:
    """One process: loss and gradients of one MSE step on the family's training inputs."""
    condition = condition_model(family, root)
    inputs = training_inputs(family, root, condition, frames=_sp_frames(family))
    target, _ = inputs.pop("target"), inputs.pop("sigmas")
    model = load_transformer(root)
    loss = _mse_step(model, inputs, target, condition)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the same step in float64: how far one fp32 process is from exact, per gradient (the noise floor)
    exact = load_transformer(root).double()
    _mse_step(
        exact,
        {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()},
        target.double(),
        condition,
    )
    fp32_error = {
        n: ((grads[n].double() - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        for n, p in exact.named_parameters()
        if p.grad is not None
    }
    return {"loss": loss.item(), "grads": grads, "fp32_error": fp32_error}


def sp_worker(rank: int, world: int, family_name: str, root: str, layouts: dict[str, dict[str, int]], out: str) -> None:
    """Every layout in turn on the spawned ranks (all ranks see the same sample); rank 0 saves results."""
    from spindle.distributed.fsdp import full_grads
    from spindle.distributed.mesh import ParallelDims, build_mesh
    from spindle.distributed.parallelize import parallelize_transformer
    from spindle.registry import family_of

    family = family_of(root, family_name)
    if not isinstance(family, DiTFamily):
        raise TypeError(
            f"{family.name} is not a DiT family: sequence-parallel conformance covers diffusion transformers"
        )
    condition = condition_model(family, Path(root))
    inputs = training_inputs(family, Path(root), condition, frames=_sp_frames(family))
    target, _ = inputs.pop("target"), inputs.pop("sigmas")
    results = {}
    for name, dims in layouts.items():
        mesh = build_mesh(ParallelDims(dp_shard=1, **dims))
        model = load_transformer(root)
        config: Any = model.config  # a diffusers model: its config
        plan = family.inference_spec().sequence_parallel_plan(config)  # the family's own, as training's
        model = parallelize_transformer(model, mesh, mixed_precision="no", cp_plan=plan)
        loss = _mse_step(model, dict(inputs), target, condition)
        results[name] = {"loss": loss.item(), "grads": full_grads(model)}
    if rank == 0:
        torch.save(results, out)


def check_sequence_parallel(family: DiTFamily, reference: dict[str, Any], result: dict[str, Any], layout: str) -> None:
    assert abs(result["loss"] - reference["loss"]) <= SP_RTOL * abs(reference["loss"]), (
        f"{family.name} {layout}: loss {result['loss']} vs one process {reference['loss']}"
    )
    assert result["grads"].keys() == reference["grads"].keys()
    for name, ref in reference["grads"].items():
        got = result["grads"][name]
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        # a gradient that nearly cancels (Wan I2V's cross-attention keys over 512 mostly-padding text tokens)
        # is rounding noise even in one process: hold SP to twice one process's own fp32 error there
        rtol = max(SP_RTOL, 2 * reference["fp32_error"][name])
        assert rel <= rtol, f"{family.name} {layout}: gradient of {name} differs by {rel:.2e} (relative)"


# ---------------------------------------------------------------- precomputed conditions and LoRA


def check_precomputed_condition_model(family: DiTFamily, root: Path) -> None:
    """`encoders=False` (training on a `spindle precompute` cache) holds no encoder weights and turns
    the conditions the full condition model encodes into exactly the same training inputs."""
    from spindle.train.tasks.flow_matching import sample_generator

    cls = family.condition_model_cls()
    cpu, fp32 = torch.device("cpu"), torch.float32
    full = cls.from_pretrained(root, cpu, fp32, max_text_length=text_tokens(family))
    light = cls.from_pretrained(root, cpu, fp32, max_text_length=text_tokens(family), encoders=False)
    modules = getattr(getattr(light, "pipe", None), "components", {}).values()
    resident = [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters() if not p.is_meta]
    assert not resident, f"{family.name}: the condition model with encoders=False loaded encoder weights"
    batch = training_batch(family)
    conditions = full.encode(batch)
    a, b = (
        m.training_inputs(conditions, [sample_generator(0, 0, int(i)) for i in batch["index"]]) for m in (full, light)
    )
    assert a.keys() == b.keys(), f"{family.name}: encoders=False gives other training inputs: {sorted(b)}"
    for key, value in a.items():
        same = _same_inputs(value, b[key])
        assert same, f"{family.name}: training input {key!r} differs with encoders=False"


def check_lora_file_round_trip(family: DiTFamily, root: Path, out: Path) -> None:
    """Default LoRA targets exist in the family's blocks (attention/feed-forward, no modulation), only
    the adapters train, and the diffusers LoRA file written through the family pipeline's
    `save_lora_weights` reads back through its `lora_state_dict` to the same tensors."""
    from spindle.config import LoraConfig
    from spindle.testing.lora import random_lora, write_lora
    from spindle.train.tasks.flow_matching import add_lora

    model = add_lora(load_transformer(root), LoraConfig(rank=2, alpha=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), (
        f"{family.name}: parameters other than LoRA adapters train: {[n for n in trainable if '.lora_' not in n][:3]}"
    )
    assert not any(".norm" in n for n in trainable), f"{family.name}: modulation layers are default LoRA targets"
    adapters = random_lora(root, seed=0)
    write_lora(family, adapters, out)
    pipeline = family.lora_pipeline_class()
    back = {k.removeprefix("transformer."): v for k, v in pipeline.lora_state_dict(out).items()}
    assert back.keys() == adapters.keys(), f"{family.name}: the LoRA file reads back with other keys"
    for key, value in adapters.items():
        assert torch.equal(back[key], value), f"{family.name}: LoRA tensor {key} differs after the round trip"


def check_runtime_adapters(family: DiTFamily, root: Path, out: Path, kwargs: dict[str, Any]) -> None:
    """LoRA adapters loaded at run time and chosen per request (`spindle serve --lora-dir`): requests
    with adapter `a`, none and `b` at half strength, interleaved on one engine, each equal (1e-5) the
    same request on an engine loaded with only that LoRA (`lora=PATH`, what `spindle generate --lora`
    does) or none; and the adapters change the output (so the comparison can fail)."""
    from spindle.testing.lora import random_lora, write_lora

    for seed, name in ((1, "a"), (2, "b")):
        write_lora(family, random_lora(root, seed=seed, std=0.3), out / name)
    gen = load_generator(root)
    adapters = gen.enable_adapters(out, max_loras=2)
    for name in ("a", "b"):
        adapters.load(name, adapters.resolve(None, name))
    if "num_frames" in kwargs:  # a video family's adapters act per frame as well: one is usually enough
        spec = dit_spec(family)
        kwargs = {**kwargs, "num_frames": spec.adapter_frames if spec is not None else 1}
    asked: list[tuple[str | None, float | None]] = [("a", None), (None, None), ("b", 0.5)]
    served = [gen.generate(**kwargs, lora=name, lora_scale=scale).frames for name, scale in asked]
    alone = {
        "a": load_generator(root, lora=str(out / "a")).generate(**kwargs).frames,
        None: load_generator(root).generate(**kwargs).frames,
        "b": load_generator(root, lora=str(out / "b"), lora_scale=0.5).generate(**kwargs).frames,
    }
    for (choice, _), frames in zip(asked, served, strict=True):
        err = float(np.abs(frames - alone[choice]).max())
        assert err <= 1e-5, f"{family.name}: the request with adapter {choice} differs from it alone by {err:.2e}"
    for adapter in ("a", "b"):
        moved = float(np.abs(alone[adapter] - alone[None]).max())
        assert moved > 1e-2, f"{family.name}: adapter {adapter} changes the output by only {moved:.2e}"


# ---------------------------------------------------------------- engine speed options


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's repeated blocks (diffusers `_repeated_blocks`: what regional compile compiles
    and the first-block cache skips), in order."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    # the block lists directly under the model, where diffusers' cache hooks find the blocks (HunyuanVideo-1.5 also
    # lists its patch embedder and text refiner as repeated: computed every forward, never skipped)
    lists = [child for child in transformer.children() if isinstance(child, torch.nn.ModuleList)]
    blocks = [m for blocks in lists for m in blocks if type(m).__name__ in names]
    assert blocks, f"{type(transformer).__name__} declares no _repeated_blocks"
    return blocks


def count_block_calls(transformer: torch.nn.Module, calls: list[int] | None = None) -> list[int]:
    """A counter ([n]) of real block computations: calls of each repeated block's first attention
    module (a block the step cache skips does not compute its attention); `calls`: add to that counter."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    calls = [0] if calls is None else calls
    for block in repeated_blocks(transformer):
        attn = next(m for m in block.modules() if isinstance(m, (Attention, AttentionModuleMixin)))
        attn.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def denoisers(gen: Any) -> list[torch.nn.Module]:
    """Every transformer the generator denoises with (a two-expert family's both)."""
    return list(gen.pipeline.denoising.denoisers.values())


def count_denoiser_calls(gen: Any) -> list[list[int]]:
    """`count_block_calls` per denoiser."""
    return [count_block_calls(model) for model in denoisers(gen)]


def _same_inputs(a: Any, b: Any) -> bool:
    """Two training inputs are equal: tensors exactly, lists (a transformer taking per-sample lists) item by item."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_inputs(x, y) for x, y in zip(a, b, strict=True))
    return bool(torch.equal(a, b)) if torch.is_tensor(a) and torch.is_tensor(b) else bool(a == b)


def check_cache_refused(family: DiTFamily, root: Path) -> bool:
    """A transformer without diffusers' cache hooks (no CacheMixin: Z-Image's) refuses every step cache with an
    error naming its class before any request runs. -> True when it did (the cache checks end there)."""
    import pytest
    from diffusers.models.cache_utils import CacheMixin

    cls = getattr(__import__("diffusers"), family.checkpoint.transformer)
    if issubclass(cls, CacheMixin):
        return False
    with pytest.raises(ValueError, match=rf"{cls.__name__} .* does not support diffusers' caches"):
        load_generator(root, cache="fbc", cache_threshold=0.0)
    return True


def check_step_cache_exact(family: DiTFamily, root: Path, kwargs: dict[str, Any], *, cfg_batch: bool) -> None:
    """First-block cache with threshold 0 computes every block of every forward and changes nothing."""
    if check_cache_refused(family, root):
        return

    exact = load_generator(root, cfg_batch=cfg_batch).generate(**kwargs).frames
    gen = load_generator(root, cache="fbc", cache_threshold=0.0, cfg_batch=cfg_batch)
    calls = [0]
    for model in denoisers(gen):
        count_block_calls(model, calls)
    out = gen.generate(**kwargs).frames
    forwards = kwargs["num_inference_steps"] * (1 if cfg_batch else 2)
    blocks = len(repeated_blocks(gen.transformer))
    assert calls[0] == blocks * forwards, f"{family.name}: {calls[0]} block calls, not {blocks} x {forwards}"
    np.testing.assert_allclose(out, exact, atol=PARITY_ATOL, rtol=0, err_msg=f"{family.name}: cache threshold 0")


def check_step_cache_skips(family: DiTFamily, root: Path, kwargs: dict[str, Any]) -> None:
    """First-block cache with a huge threshold: step 0 computes every block, later steps only the first
    (one batched CFG forward a step); the result is lossy but the same picture (PSNR), and the cache
    state is reset per request (a second request repeats the first)."""
    from spindle.infer import psnr

    if check_cache_refused(family, root):
        return
    exact = load_generator(root).generate(**kwargs).frames
    gen = load_generator(root, cache="fbc", cache_threshold=1e6, cfg_batch=True)
    counters = count_denoiser_calls(gen)
    out = gen.generate(**kwargs).frames
    # each denoiser that ran (a two-expert family: each expert, over its own steps) computes every block at
    # its first step and only the first block after
    used = sum(1 for c in counters if c[0])
    expected = used * (len(repeated_blocks(gen.transformer)) - 1) + kwargs["num_inference_steps"]
    total = sum(c[0] for c in counters)
    assert total == expected, f"{family.name}: {total} block calls with every later step cached, not {expected}"
    value = psnr(out, exact)
    assert np.isfinite(value) and 5.0 < value < 80.0, f"{family.name}: cached PSNR {value} dB"
    for c in counters:
        c[0] = 0
    np.testing.assert_array_equal(gen.generate(**kwargs).frames, out, err_msg=f"{family.name}: cache not reset")
    assert sum(c[0] for c in counters) == expected
    assert psnr(exact, exact) == float("inf")


def check_compile_matches_eager(family: DiTFamily, root: Path, kwargs: dict[str, Any]) -> None:
    """Regional torch.compile compiles every repeated block, each traced whole (no graph break), within 1e-4 of
    eager.

    With the aot_eager backend: what a family's code decides is whether its blocks trace (dynamo, AOTAutograd) and
    run traced as they run eagerly; inductor's CPU code generation (~20-35 s of C++ compiling per family on CI's two
    cores) is PyTorch's and is tested on Wan, training and inference (tests/train/test_train_speed.py,
    tests/infer/test_infer_caches.py)."""
    import torch._dynamo

    exact = load_generator(root).generate(**kwargs).frames
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = load_generator(root, compile=True, compile_backend="aot_eager")
    blocks = [b for model in denoisers(gen) for b in repeated_blocks(model)]
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    np.testing.assert_allclose(gen.generate(**kwargs).frames, exact, atol=1e-4, rtol=0, err_msg=family.name)
    # each block traces whole: a graph break splits it into graphs compiled (and fused) apart, with Python between
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, f"{family.name}: graph breaks in the compiled blocks: {breaks}"
