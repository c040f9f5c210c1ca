"""How a FLUX.2 pipeline guides: the part that makes FLUX.2 [klein] a variant of FLUX.2-dev.

Both pipelines share everything up to the denoising loop but the guidance:

- `Flux2Pipeline` (FLUX.2-dev, guidance-distilled): `guidance_scale` is the transformer's *embedded* guidance,
  given at every step; there is no classifier-free guidance and no negative prompt.
- `Flux2KleinPipeline`: the transformer takes no guidance; `guidance_scale > 1` runs classifier-free guidance
  against an empty negative prompt, unless the checkpoint is step-distilled (`is_distilled` in
  model_index.json: the klein-4B/9B models), which ignores it.

The family's spec, before-denoising stage and condition model hold one `Guidance` and ask it at these points.
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle.contracts.request import RequestError, SamplingParams

# the embedded guidance of guidance-distilled training samples: Flux2Pipeline's default guidance_scale
TRAIN_GUIDANCE = 4.0


@dataclass(frozen=True)
class Guidance:
    embedded: bool  # guidance_scale is the transformer's embedded guidance (FLUX.2-dev); else CFG's scale
    label: str  # the pipeline, in messages
    # model_index.json keys the pipeline's constructor takes (Klein's `is_distilled`)
    pipeline_config: tuple[str, ...] = ()

    def cfg(self, params: SamplingParams, distilled: bool) -> bool:
        """Whether classifier-free guidance runs for this request, as the pipeline decides it."""
        scale = params.guidance_scale
        return not self.embedded and not distilled and scale is not None and scale > 1

    def check(self, params: SamplingParams, distilled: bool) -> None:
        """A negative prompt where the pipeline never runs CFG would be ignored: refused, naming why."""
        if params.negative_prompt is None:
            return
        if self.embedded:
            raise RequestError(
                f"negative_prompt: {self.label} has no classifier-free guidance (guidance_scale is the "
                "transformer's embedded guidance); leave negative_prompt unset",
                field="negative_prompt",
            )
        if distilled:
            raise RequestError(
                f"negative_prompt: this {self.label} checkpoint is step-distilled (is_distilled in "
                "model_index.json), which runs no classifier-free guidance; leave negative_prompt unset",
                field="negative_prompt",
            )

    def train_guidance(self, guidance_embeds: bool) -> float | None:
        """The embedded guidance training samples carry: the pipeline's default where the transformer embeds
        it (FLUX.2-dev), None where the pipeline passes none (Klein)."""
        return TRAIN_GUIDANCE if self.embedded and guidance_embeds else None


EMBEDDED_GUIDANCE = Guidance(embedded=True, label="FLUX.2-dev (Flux2Pipeline)")
# Klein's: CFG on an empty negative prompt (a given negative_prompt replaces it), off when step-distilled
KLEIN_GUIDANCE = Guidance(
    embedded=False, label="FLUX.2 [klein] (Flux2KleinPipeline)", pipeline_config=("is_distilled",)
)
