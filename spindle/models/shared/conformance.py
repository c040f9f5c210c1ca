"""What a family declares for the conformance suites (spindle/testing/conformance.py, causal_lm_conformance.py,
vlm_conformance.py, omni_conformance.py; tests/conformance/): the spec classes, and the parts of the DiT families'
specs that several state alike (the shape of the parity cases, the request-error rows whose message the shared
request checks write, the seeded conditioning images).

Test data, not production: each family's spec is its folder's `conformance.py` (`<FAMILY NAME> = ...Spec(...)`),
found by family name (`spindle.testing.specs`); only the test suites, spindle.testing and other conformance modules
import a conformance module (tests/project/test_structure.py). Light (no torch, no diffusers at import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spindle.contracts.family import import_object

# what the tiny image checkpoints' height and width divide by (a VAE factor 2, 2x2 latent patches)
PACKING = "VAE x2 x 2x2 packing"
PROMPT = "a red fox in the snow"  # the parity cases' prompt where a family has no reason for its own


@dataclass(frozen=True)
class ConformanceSpec:
    """How the conformance suite (spindle/testing/conformance.py, tests/conformance/) exercises a family.

    `parity_cases`: name -> keyword arguments valid both for the stock diffusers pipeline call and
    for `DiffusionGenerator.generate` (with `seed`), small enough for a CPU test; at least one case
    with classifier-free guidance ("cfg") and one without ("nocfg"; a family whose pipeline has no CFG says why in
    `no_cfg` and has no "cfg" case). A family taking conditioning images
    (`FamilyOptions.images`) gets the suite's seeded test image(s) as `image` in every case.
    """

    parity_cases: dict[str, dict[str, Any]] = field(default_factory=dict)
    # why the family runs no classifier-free guidance (its stock pipeline has none: FLUX.2-dev is
    # guidance-distilled); "" for the others, whose "cfg" case runs CFG (the suite checks it does) and "nocfg" not
    no_cfg: str = ""
    # the 2-process layouts the family trains with, checked equal to one process: "ulysses2"
    # (parallel.sp=2) and "ring2" (parallel.ring=2). A family leaves one out only with the reason.
    sequence_parallel: tuple[str, ...] = ("ulysses2", "ring2")
    # the frames of those layouts' training batch where the demo's do not split over 2 ranks (None: the demo's):
    # LTX-2's 9 frames give 9 audio tokens
    sequence_parallel_frames: int | None = None
    # Spindle's default request on the tiny checkpoint: the diffusers pipeline's __call__ defaults
    # (`extra`: the family options'). The suite also reads them off the pipeline, so a stale value fails.
    default_params: dict[str, Any] = field(default_factory=dict)
    # requests the tiny checkpoint refuses for what the checkpoint bounds (sizes, frames, text length,
    # scheduler): (generate() keyword arguments over the "nocfg" case, the RequestError message as a
    # regex); the suite adds the rows every family shares (spindle.testing.conformance.COMMON_REQUEST_ERRORS)
    request_errors: tuple[tuple[dict[str, Any], str], ...] = ()
    # image families: a `spindle generate` request (generate() keyword arguments) using a flag of the
    # family's own, which the suite runs as a real process and compares with generate()'s image
    cli_case: dict[str, Any] | None = None
    # model.max_text_length of the suite's condition models and training runs (small, divisible by the SP
    # degrees); a family whose transformer fixes the text length (Wan I2V: 512) declares that length
    text_tokens: int = 16
    # the stock pipeline's keyword for a family option named otherwise (FLUX.1 Kontext: auto_resize is the
    # pipeline's `_auto_resize`): the suite calls the stock pipeline with these names
    stock_names: dict[str, str] = field(default_factory=dict)
    # the size (pixels a side, or (height, width)) the stock pipeline's __call__ falls back to when it has no
    # `default_sample_size` (ZImagePipeline: `height or 1024`); None: `default_sample_size` x `vae_scale_factor`
    stock_size: int | tuple[int, int] | None = None
    # generate() arguments the stock pipeline takes through its `guider` component's config, not its __call__
    # (HunyuanVideo15Pipeline's guidance_scale): the suite sets them with `pipe.guider.new(...)`, and a default of
    # one is the folder's guider's
    stock_guider: tuple[str, ...] = ()
    # edit families: source images per sample in the suite's training batches (`batch["images"]`)
    train_sources: int = 0
    # generate() options under which inference sees what training sees (the suite's token count), e.g.
    # FLUX.1 Kontext's auto_resize=False: sources at the target's size, as training has them
    train_request: dict[str, Any] = field(default_factory=dict)
    # the family option `cli_case` shows to change generate()'s image (default: every option in it); the
    # others only make the request valid on the tiny checkpoint (FLUX.1 Kontext's max_area)
    cli_option: str | None = None
    # "module:function(root) -> dict": `from_pretrained` overrides with which stock diffusers loads the
    # checkpoint here, for a component whose class cannot be built on this machine (Qwen-Image-Edit's
    # Qwen2VLProcessor needs torchvision); the suite's references are the stock pipeline loaded so
    stock_components: str | None = None
    # family options of the request whose token count the suite compares with training's at the demo size
    # (an edit family sizes its input images by an option; training encodes them at the sample's size)
    token_request: dict[str, Any] = field(default_factory=dict)

    def stock_overrides(self, root: Path) -> dict[str, Any]:
        return {} if self.stock_components is None else dict(import_object(self.stock_components)(root))

    # frames of the suite's runtime-adapter requests (a video family's adapters act per frame: 1 is enough); LTX-2
    # image-to-video keeps its one latent frame as the given image, so it needs a second latent frame to show them
    adapter_frames: int = 1
    # denoising steps of the suite's step-cache runs: enough that the cache skips a few (a two-expert family's
    # experts each compute every block at their first step)
    cache_steps: int = 3
    # dotted overrides every training run of the suite adds, for what the family's training requires
    # (a two-expert family: which expert to train, `train__expert`)
    train_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CausalLMConformanceSpec:
    """How the conformance suite (spindle/testing/causal_lm_conformance.py, tests/conformance/) exercises a
    causal-LM family. The defaults fit a dense family; a family changes a field only with the reason."""

    # transformers config overrides of the tiny checkpoint the tests use (`tiny_checkpoint(family)`),
    # e.g. an MoE router aux coefficient large enough that a wrong aux loss shows in the step loss
    tiny_overrides: dict[str, Any] = field(default_factory=dict)
    # config overrides of the small stock/patched pair the loss-parity tests build (over the suite's shape,
    # spindle.testing.causal_lm_conformance.PAIR_CONFIG) where the family's attention needs them, e.g.
    # multi-head latent attention's as many key/value heads as query heads
    pair_overrides: dict[str, Any] = field(default_factory=dict)
    # extra keyword arguments of the stock transformers forward whose `loss` Spindle's step loss equals
    # (MoE: {"output_router_logits": True}, which adds the router aux loss as Spindle's task does)
    stock_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    # step metrics equal to the same-named output of that stock forward (MoE: "aux_loss")
    stock_outputs: tuple[str, ...] = ()
    # the 2-process layouts the family trains with, checked equal to one process: "dp_shard2"
    # (parallel.dp_shard=2) and "sp2" (parallel.sp=2); "ep2" (parallel.ep=2) joins them when the family's
    # task supports expert parallelism. A family leaves one out only with the reason.
    parallel: tuple[str, ...] = ("dp_shard2", "sp2")


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


def noise_image(height: int, width: int, seed: int = 0) -> Any:
    """An RGB PIL image of seeded uniform noise: a conditioning image whose size the request does not have."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
