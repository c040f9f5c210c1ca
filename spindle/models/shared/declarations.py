"""The parts of DiT family declarations (`FAMILY` in models/<family>/__init__.py) that several families state
alike: the demo datasets of a media kind, the shape of the conformance suite's parity cases, and the
request-error rows whose message the shared request checks write. A family passes only what is its own.

Light (no torch, no diffusers): the registry imports every family's declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spindle.contracts.family import DemoSpec
from spindle.contracts.options import Option, needs_negative_prompt

# what the tiny image checkpoints' height and width divide by (a VAE factor 2, 2x2 latent patches)
PACKING = "VAE x2 x 2x2 packing"
PROMPT = "a red fox in the snow"  # the parity cases' prompt where a family has no reason for its own

# `spindle demo` data of each media kind: 16 captioned 32x32 samples (shapes; 9-frame videos)
IMAGE_DEMO = DemoSpec(dataset="spindle.data.synthetic:make_shapes_image_dataset", dataset_kwargs={"num_images": 16})
VIDEO_DEMO = DemoSpec(
    dataset="spindle.data.synthetic:make_shapes_video_dataset",
    dataset_kwargs={"num_videos": 16, "num_frames": 9},
    num_frames=9,
    sample_suffix=".mp4",
    sample_kwargs={"num_frames": 9, "guidance_scale": 1.0},
)
EDIT_DEMO = DemoSpec(dataset="spindle.data.synthetic:make_shapes_edit_dataset", dataset_kwargs={"num_pairs": 16})


def config_mentions(root: Path, component: str, text: str) -> bool:
    """A renamed local folder's `component/config.json` exists and holds `text` (a class name, a config key):
    what a family's `detect` reads to recognise its layout."""
    config = root / component / "config.json"
    return config.is_file() and text in config.read_text()


def demo(kind: DemoSpec, size: tuple[int, int] = (32, 32), **fields: Any) -> DemoSpec:
    """`kind` (IMAGE_DEMO, VIDEO_DEMO, EDIT_DEMO) at `size` (its dataset's too), with the family's `fields`."""
    return dataclasses.replace(kind, size=size, dataset_kwargs={**kind.dataset_kwargs, "size": size}, **fields)


def true_cfg_scale(default: float) -> Option:
    """The `true_cfg_scale` option of a pipeline whose classifier-free guidance runs on a negative prompt
    (FluxPipeline's, QwenImagePipeline's); `default`: the pipeline's."""
    return Option(
        "true_cfg_scale",
        float,
        default=default,
        minimum=0.0,
        maximum=100.0,  # as guidance_scale (request.MAX_GUIDANCE): larger scales only blow latents up
        help="true classifier-free guidance scale, with a negative prompt",
        rule=needs_negative_prompt,
    )


def parity_cases(cfg: dict[str, Any], nocfg: dict[str, Any], **both: Any) -> dict[str, dict[str, Any]]:
    """`ConformanceSpec.parity_cases`: "cfg", classifier-free guidance with a negative prompt at 32x32 in 2 steps,
    and "nocfg" at a non-square 32x48 in 3 steps; `both` (a conditioning image, a text length) goes into each,
    and `cfg` / `nocfg` (the family's guidance, seed, other prompts or sizes) override the case's values."""
    return {
        "cfg": dict(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_inference_steps=2, **both) | cfg,
        "nocfg": dict(prompt=PROMPT, height=32, width=48, num_inference_steps=3, **both) | nocfg,
    }


def image_default_params(true_cfg_scale: float, **params: Any) -> dict[str, Any]:
    """An image pipeline's default request on its tiny checkpoint (`ConformanceSpec.default_params`): the
    pipeline's `default_sample_size` 128 x the tiny VAE's factor 2 a side, 512 text tokens, its other `params`,
    and its `true_cfg_scale` default (a family option)."""
    return dict(height=256, width=256, **params, max_sequence_length=512, extra={"true_cfg_scale": true_cfg_scale})


def multiple_error(name: str, got: int, multiple: int, tries: str, why: str | None = None) -> tuple[dict, str]:
    """A `request_errors` row: `name=got`, not a positive multiple of `multiple` (the VAE factor x patch), refused
    naming the values to try (`tries`, e.g. "16 or 32") and, where given, the reason (`why`, e.g. "VAE x2 x 2x2
    packing")."""
    reason = rf"\({why}\)" if why else r"\(.*\)"  # `why` has no regex syntax of its own
    message = rf"{name} must be a positive multiple of {multiple} for this model {reason} \(got {got}\); try {tries}"
    return {name: got}, message


def text_length_error(limit: int) -> tuple[dict, str]:
    """A `request_errors` row: a max_sequence_length one over the text encoder's `limit`."""
    message = rf"max_sequence_length must be an integer between 1 and {limit}; got {limit + 1}"
    return {"max_sequence_length": limit + 1}, message


def amended(cases: dict[str, dict[str, Any]], values: dict[str, Any], only: str | None = None) -> dict[str, dict]:
    """The parity cases of the family a family derives from, with `values` in each (`only`: in that case only)."""
    return {name: case | values if only in (None, name) else case for name, case in cases.items()}
