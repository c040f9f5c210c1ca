"""FLUX.1 Kontext's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.flux.conformance import FLUX
from spindle.models.flux_kontext import MAX_AREA
from spindle.models.shared.conformance import ConformanceSpec, noise_image, text_length_error

# the stock pipeline's name of each Spindle option that differs (the suite calls it with these)
STOCK_NAMES = {"auto_resize": "_auto_resize"}

FLUX_KONTEXT = ConformanceSpec(
    # Flux's cases editing the seeded image at their own size (max_area = height x width, no auto-resize), the
    # CFG one at Kontext's embedded guidance
    parity_cases={
        name: case
        | dict(
            prompt="the red circle to blue",
            image=noise_image(40, 56),
            max_area=case["height"] * case["width"],
            auto_resize=False,
        )
        | ({"guidance_scale": 2.5} if name == "cfg" else {})
        for name, case in FLUX.parity_cases.items()
    },
    stock_names=STOCK_NAMES,
    train_sources=1,
    train_request={"auto_resize": False},  # training's sources have the target's size
    # FluxKontextPipeline's __call__: no size (its default_sample_size x VAE factor, fitted to max_area)
    default_params=FLUX.default_params
    | dict(height=None, width=None, extra={"true_cfg_scale": 1.0, "max_area": MAX_AREA, "auto_resize": True}),
    request_errors=(
        FLUX.request_errors[0],
        (
            dict(max_area=1024),
            r"max_area=1024: FluxKontextPipeline would generate 24x36, not the asked 32x48 \(it scales "
            r"height x width to max_area pixels\); give max_area=1536 to keep 32x48, or ask height=24, width=36",
        ),
        text_length_error(512),
    ),
    # --true-cfg-scale with the sizing flags that keep the tiny model's small size
    cli_case=dict(
        prompt="a cat",
        negative_prompt="blurry",
        height=32,
        width=48,
        max_area=32 * 48,
        num_inference_steps=2,
        true_cfg_scale=4.0,
        seed=4,
    ),
    cli_option="true_cfg_scale",
)
