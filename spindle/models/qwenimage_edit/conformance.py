"""The conformance specs of Qwen-Image-Edit (`QWENIMAGE_EDIT`) and -Edit-Plus (`QWENIMAGE_EDIT_PLUS`): how the conformance suite exercises them.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.qwenimage.conformance import STEPS_ERROR
from spindle.models.qwenimage_edit import CONDITION_IMAGE_AREA, VAE_IMAGE_AREA, text_tokens
from spindle.models.shared.conformance import ConformanceSpec, multiple_error, noise_image, parity_cases


def sample_image(height: int = 40, width: int = 56, seed: int = 0) -> object:
    """The conformance suite's input image: seeded noise whose aspect the pipeline must size."""
    return noise_image(height, width, seed)


def edit_conformance(images: list[object], demo_size: tuple[int, int] = (32, 32)) -> ConformanceSpec:
    """The suite's cases for an edit family (`images`: what each case edits; `demo_size`: its DemoSpec's)."""
    image = images if len(images) > 1 else images[0]
    return ConformanceSpec(
        text_tokens=text_tokens(len(images)),
        parity_cases=parity_cases(
            cfg=dict(
                prompt="make the circle red", negative_prompt="blurry low quality picture", true_cfg_scale=4.0, seed=7
            ),
            nocfg=dict(prompt="a blue square", width=64, seed=0),
            image=image,
        ),
        sequence_parallel=("ulysses2", "ring2"),
        default_params=dict(
            height=None,
            width=None,
            negative_prompt=None,
            num_inference_steps=50,
            max_sequence_length=512,
            extra={"true_cfg_scale": 4.0, "image_area": VAE_IMAGE_AREA}
            | ({"condition_image_area": CONDITION_IMAGE_AREA} if len(images) > 1 else {}),
        ),
        request_errors=(multiple_error("height", 48, 32, "32 or 64", why="VAE x16 x 2x2 packing"), STEPS_ERROR),
        # --image-area (a small reference: on the tiny model the text barely moves the output next to the
        # reference's tokens, so true_cfg_scale is not the flag to check here)
        cli_case=dict(
            prompt="a fox",
            negative_prompt="blurry",
            image=image,
            image_area=64 * 64,
            height=32,
            width=64,
            num_inference_steps=2,
            seed=4,
        ),
        stock_components="spindle.models.qwenimage_edit.processor:stock_components",
        token_request={"image_area": demo_size[0] * demo_size[1]},  # training encodes sources at the demo size
    )


QWENIMAGE_EDIT = edit_conformance([sample_image()])


# two images of different aspects: the size follows the last one
QWENIMAGE_EDIT_PLUS = edit_conformance([sample_image(), sample_image(48, 32, seed=1)], demo_size=(64, 32))
