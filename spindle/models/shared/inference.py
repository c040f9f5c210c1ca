"""Inference pieces shared by pipeline-backed families: a BeforeDenoisingStage around the family's own
diffusers pipeline, and the request checks of 2x2-packed image families."""

from __future__ import annotations

from typing import Any

from spindle.contracts.family import import_object
from spindle.contracts.request import RequestError, check_int_range, check_size
from spindle.contracts.stage import BeforeDenoisingStage


class PipelineBeforeDenoisingStage(BeforeDenoisingStage):
    """A BeforeDenoisingStage around the family's diffusers pipeline, built from the loaded components
    without its transformer (`pipeline_class = "diffusers:FluxPipeline"`): its prompt encoding and
    latent helpers are the reference code (`self.text_pipe`)."""

    pipeline_class: str = ""

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        parts = {k: v for k, v in components.items() if k != spec.transformer_component}
        self.text_pipe = import_object(self.pipeline_class)(**parts, transformer=None)
        self.transformer = components[spec.transformer_component]
        self.scheduler = components["scheduler"]
        self.vae_scale_factor = self.text_pipe.vae_scale_factor


def check_packed_image_request(params: Any, vae_scale_factor: int, max_sequence_length: int, label: str) -> None:
    """The request checks of a 2x2-packed image family (after the common ones): sizes a multiple of
    VAE factor x 2, no frames, the text length its encoder takes. `RequestError` naming the field."""
    multiple = 2 * vae_scale_factor
    check_size(params, multiple, multiple, f"VAE x{vae_scale_factor} x 2x2 packing")
    if params.num_frames not in (None, 1):
        raise RequestError(
            f"num_frames must be left unset (or 1): {label} generates images; got {params.num_frames!r}",
            field="num_frames",
        )
    check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=max_sequence_length)
