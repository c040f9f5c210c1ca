"""Qwen-Image's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec

# the scheduler's terminal shift needs two steps
STEPS_ERROR = (dict(num_inference_steps=1), r"num_inference_steps must be >= 2 for this checkpoint's scheduler")

QWENIMAGE = ConformanceSpec(
    # classifier-free guidance is true_cfg_scale with a negative prompt (here longer than the
    # prompt: variable-length text, padded with a mask when CFG is batched)
    parity_cases=shared.parity_cases(
        cfg=dict(negative_prompt="blurry low quality picture of a fox", true_cfg_scale=4.0, seed=7),
        nocfg=dict(seed=0),
    ),
    # both layouts: the joint attention's text-padding mask goes through ring attention chunk by chunk
    # (spindle.distributed.context_parallel, key masks under ring attention)
    sequence_parallel=("ulysses2", "ring2"),
    # true_cfg_scale: QwenImagePipeline's, which runs only with a negative prompt
    default_params=shared.image_default_params(4.0, negative_prompt=None, num_inference_steps=50),
    request_errors=(
        shared.multiple_error("height", 34, 4, "32 or 36", why=shared.PACKING),
        STEPS_ERROR,
        shared.text_length_error(1024),
    ),
    # the --true-cfg-scale flag
    cli_case=dict(
        prompt="a fox",
        negative_prompt="blurry",
        true_cfg_scale=2.5,
        height=32,
        width=48,
        num_inference_steps=2,
        seed=4,
    ),
)
