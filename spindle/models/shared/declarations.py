"""The parts of DiT family declarations (`FAMILY` in models/<family>/__init__.py) that several families state
alike: the demo datasets of a media kind, the detection of renamed folders, the options several pipelines share.
A family passes only what is its own. (What the families' conformance specs share: models/shared/conformance.py.)

Light (no torch, no diffusers): the registry imports every family's declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spindle.contracts.family import DemoSpec
from spindle.contracts.options import Option, needs_negative_prompt

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
        maximum=100.0,  # as guidance_scale (sampling.MAX_GUIDANCE): larger scales only blow latents up
        help="true classifier-free guidance scale, with a negative prompt",
        rule=needs_negative_prompt,
    )
