"""`cache="auto"`: pick the fastest step cache whose output stays above a PSNR floor.

On one calibration request (the user's own prompt template, size and step count), the uncached
output is the reference; each policy then tries its knob values from the most aggressive down and
keeps the first one whose output is at least `min_psnr` dB against the reference. The fastest of
those (denoising seconds) wins; none passing means no cache. A knob that skips nothing (output
identical to the reference) is not a candidate. MagCache's model-specific ratios are
measured on the reference run itself (its calibration mode never skips, so that run is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from spindle.infer.caches import POLICIES, candidate_settings
from spindle.infer.quality import psnr

if TYPE_CHECKING:
    from spindle.contracts.request import ValidRequest


class Generator(Protocol):
    """What calibration uses of a `spindle.infer.generator.DiffusionGenerator` (which calls it)."""

    pipeline: Any

    def run(self, request: ValidRequest) -> Any: ...


@dataclass
class CacheChoice:
    name: str | None  # None: no policy reached min_psnr
    threshold: float | None
    options: dict[str, Any]
    psnr: float | None
    seconds: float | None  # denoising seconds with the choice
    reference_seconds: float  # denoising seconds without cache
    min_psnr: float
    trials: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        if self.name is None:
            return f"cache auto: no policy kept PSNR >= {self.min_psnr} dB on the calibration request; running uncached"
        knobs = {
            POLICIES[self.name].knob: self.threshold,
            **{k: v for k, v in self.options.items() if k != "mag_ratios"},
        }
        settings = ", ".join(f"{k}={v}" for k, v in knobs.items())
        return (
            f"cache auto: chose {self.name} ({settings}): PSNR {self.psnr:.2f} dB >= {self.min_psnr} dB, "
            f"denoising {self.seconds:.2f}s vs {self.reference_seconds:.2f}s uncached "
            f"({len(self.trials)} trials)"
        )


def calibrate_cache(
    gen: Generator, params: ValidRequest, min_psnr: float, policies: tuple[str, ...] | None = None
) -> CacheChoice:
    """Try the policies on `params` (validated: every trial runs it as it is) and leave the chosen one enabled
    on `gen`. -> the choice and every trial."""
    stage = gen.pipeline.denoising
    # calibration mode: computes every block (exact) and measures MagCache's ratios (where MagCache can run)
    stage.set_cache("mag" if stage.cache_unavailable("mag") is None else None)
    reference = gen.run(params)
    mag_ratios = stage.cache.mag_ratios if stage.cache is not None else None
    stage.set_cache(None)
    ref_seconds = reference.timings["denoising"]
    trials: list[dict[str, Any]] = []
    for name in policies or tuple(POLICIES):
        policy = POLICIES[name]
        if stage.cache_unavailable(name) is not None:
            continue
        measured = {"mag_ratios": mag_ratios} if name == "mag" else {}
        if name == "mag" and mag_ratios is None:
            continue
        # most aggressive first: the first that passes is this policy's fastest
        for value, overrides in candidate_settings(policy):
            options = {**overrides, **measured}
            stage.set_cache(name, value, options)
            out = gen.run(params)
            value_db = psnr(out.frames, reference.frames)
            trials.append(
                dict(name=name, threshold=value, options=overrides, psnr=value_db, seconds=out.timings["denoising"])
            )
            if value_db >= min_psnr:
                break
    stage.set_cache(None)
    # an output identical to the reference (infinite PSNR) skipped nothing: no speed-up to choose
    passing = [t for t in trials if min_psnr <= t["psnr"] < float("inf")]
    if not passing:
        return CacheChoice(None, None, {}, None, None, ref_seconds, min_psnr, trials)
    best = min(passing, key=lambda t: t["seconds"])
    options = {**best["options"], **({"mag_ratios": mag_ratios} if best["name"] == "mag" else {})}
    stage.set_cache(best["name"], best["threshold"], options)
    return CacheChoice(
        best["name"], best["threshold"], options, best["psnr"], best["seconds"], ref_seconds, min_psnr, trials
    )
