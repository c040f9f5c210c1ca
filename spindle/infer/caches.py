"""Step caches: diffusers' cache hooks behind one name, with their knobs, reset per request.

Every policy is a diffusers hook config applied through the transformer's own `enable_cache`; Spindle
adds the names, knob validation, what the hooks need from the denoising loop (the current timestep,
the step count, MagCache's per-checkpoint ratios) and `auto` calibration (`spindle.infer.calibrate`).

| name         | diffusers config                  | main knob (`cache_threshold`)            |
|--------------|-----------------------------------|------------------------------------------|
| `fbc`        | FirstBlockCacheConfig             | threshold                                |
| `mag`        | MagCacheConfig                    | threshold (ratios calibrated per model)  |
| `taylorseer` | TaylorSeerCacheConfig             | cache_interval                           |
| `pab`        | PyramidAttentionBroadcastConfig   | spatial_attention_block_skip_range       |
| `faster`     | FasterCacheConfig                 | spatial_attention_block_skip_range       |
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # the CLI imports CACHE_NAMES to parse flags: keep torch out of that path
    import torch


@dataclass(frozen=True)
class CachePolicy:
    name: str
    config_class: str  # in diffusers.hooks
    knob: str  # the knob `cache_threshold` sets
    knob_type: type
    # what `auto` tries, fastest (most skipping) first: a knob value, or (knob value, {option: value}) where
    # the knob alone cannot skip more (MagCache's skips are capped by max_skip_steps, whatever the threshold)
    candidates: tuple[Any, ...]
    # Spindle's defaults where diffusers' do not fit a short schedule
    defaults: dict[str, Any] = field(default_factory=dict)
    needs_timestep: bool = False  # the config takes a `current_timestep_callback`
    needs_cfg_batch: bool = False  # the hook splits the batch into [uncond; cond]
    needs_spatial_output: bool = False  # the hook needs the output's layout (InferenceSpec.output_layout)

    def cfg_unavailable(self, cfg_batch: bool, cfg_parallel: bool) -> str | None:
        """Why this policy cannot run with these CFG settings (None: it can). One definition for
        `EngineConfig` (validated before the engine is built) and `DenoisingStage.cache_unavailable`."""
        if self.needs_cfg_batch and (not cfg_batch or cfg_parallel):
            return (
                f"cache={self.name!r} approximates the unconditional half of a CFG-batched forward: "
                "it needs cfg_batch=True and no cfg_parallel"
            )
        return None


POLICIES: dict[str, CachePolicy] = {
    p.name: p
    for p in (
        CachePolicy("fbc", "FirstBlockCacheConfig", "threshold", float, (0.4, 0.2, 0.1, 0.05)),
        CachePolicy(
            "mag",
            "MagCacheConfig",
            "threshold",
            float,
            (
                (2.0, {"max_skip_steps": 6}),
                (1.0, {"max_skip_steps": 5}),
                (0.5, {"max_skip_steps": 4}),
                0.24,
                0.12,
                0.06,
            ),
            # diffusers' retention of the first 20% of steps and at most 3 skips in a row (the paper's K)
            defaults={"max_skip_steps": 3, "retention_ratio": 0.2},
        ),
        CachePolicy(
            "taylorseer",
            "TaylorSeerCacheConfig",
            "cache_interval",
            int,
            (4, 3, 2),
            # diffusers' default warm-up of 3 full steps leaves nothing to cache on short CPU schedules
            defaults={"disable_cache_before_step": 2, "taylor_factors_dtype": "float32", "use_lite_mode": True},
        ),
        CachePolicy(
            "pab",
            "PyramidAttentionBroadcastConfig",
            "spatial_attention_block_skip_range",
            int,
            (4, 3, 2),
            defaults={"spatial_attention_timestep_skip_range": (100, 950)},
            needs_timestep=True,
        ),
        CachePolicy(
            "faster",
            "FasterCacheConfig",
            "spatial_attention_block_skip_range",
            int,
            (4, 3, 2),
            defaults={"spatial_attention_timestep_skip_range": (-1, 950)},
            needs_timestep=True,
            needs_cfg_batch=True,
            needs_spatial_output=True,
        ),
    )
}
# the names an engine option may give (`EngineConfig.cache`): every policy, and "auto" (calibrated);
# tests/project/test_option_sections.py checks that the two lists agree
CacheName = Literal["fbc", "mag", "taylorseer", "pab", "faster", "auto"]
CACHE_NAMES: tuple[str, ...] = get_args(CacheName)


def candidate_settings(policy: CachePolicy) -> list[tuple[Any, dict[str, Any]]]:
    """`policy.candidates` as (knob value, option overrides), most aggressive first."""
    return [c if isinstance(c, tuple) else (c, {}) for c in policy.candidates]


def config_class(policy: CachePolicy) -> type:
    import diffusers.hooks

    cls: type = getattr(diffusers.hooks, policy.config_class)
    return cls


def check_cache_options(name: str | None, threshold: float | None, options: dict[str, Any]) -> None:
    """Raise naming the policy / knob when a cache setting cannot apply."""
    if name is None:
        if options:
            raise ValueError(f"cache_options {sorted(options)} given without a cache; pass cache=NAME ({CACHE_NAMES})")
        return
    if name not in CACHE_NAMES:
        raise ValueError(f"cache must be one of {CACHE_NAMES} (or None); got {name!r}")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise ValueError(f"cache_threshold must be a number; got {threshold!r}")
    if threshold is not None and threshold < 0:
        raise ValueError(f"cache_threshold must be >= 0; got {threshold!r}")
    if name == "auto":
        if options:
            raise ValueError("cache_options cannot be combined with cache='auto' (calibration picks the knobs)")
        return
    policy = POLICIES[name]
    if threshold is not None and policy.knob_type is int and threshold != int(threshold):
        raise ValueError(f"cache_threshold sets {name}'s {policy.knob} (an integer); got {threshold!r}")
    known = {f.name for f in dataclasses.fields(config_class(policy))} - {"current_timestep_callback", "calibrate"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {name} cache option(s) {unknown}; {policy.config_class} takes {sorted(known)}")


def build_config(
    name: str,
    threshold: float | None = None,
    options: dict[str, Any] | None = None,
    current_timestep: Callable[[], float | None] | None = None,
) -> Any:
    """The diffusers hook config for policy `name` with Spindle's defaults under `options`, the main knob
    set by `threshold`; usable on any diffusers transformer (`transformer.enable_cache(config)`), so the
    bench runs diffusers with exactly the cache Spindle runs."""
    import torch

    policy = POLICIES[name]
    kw = {**policy.defaults, **(options or {})}
    if threshold is not None:
        kw[policy.knob] = policy.knob_type(threshold)
    if isinstance(kw.get("taylor_factors_dtype"), str):  # CLI / defaults name dtypes as strings
        kw["taylor_factors_dtype"] = getattr(torch, kw["taylor_factors_dtype"])
    if policy.needs_timestep:
        if current_timestep is None:
            raise ValueError(f"cache {name!r} needs the denoising loop's current timestep")
        kw["current_timestep_callback"] = current_timestep
    return config_class(policy)(**kw)


class StepCache:
    """One policy applied to one transformer; `start_request(num_steps)` before each request's loop.

    The hooks are diffusers'; their state is reset per request by the denoising stage
    (`_reset_stateful_cache`). MagCache needs model-specific magnitude ratios: without
    `mag_ratios` in the options, the first request runs MagCache's calibration (no skipping, so
    that request is exact) and the ratios it measures are used from the next request on.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        name: str,
        threshold: float | None = None,
        options: dict[str, Any] | None = None,
        current_timestep: Callable[[], float | None] | None = None,
    ):
        check_cache_options(name, threshold, options or {})
        if name == "auto":
            raise ValueError("cache='auto' is resolved by calibration (spindle.infer.calibrate), not applied directly")
        self.transformer: Any = transformer  # a diffusers transformer (enable_cache / disable_cache)
        self.policy = POLICIES[name]
        self.name = name
        self.options = {**self.policy.defaults, **(options or {})}
        if threshold is not None:
            self.options[self.policy.knob] = self.policy.knob_type(threshold)
        self.current_timestep = current_timestep
        self.mag_ratios: list[float] | None = self.options.pop("mag_ratios", None) if name == "mag" else None
        self._config: Any = None
        self._num_steps: int | None = None
        if name != "mag":
            self._enable(self._make_config())

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(self.options.items()) if k in (self.policy.knob,))
        return f"{self.name} ({knobs})"

    def _make_config(self, **extra: Any) -> Any:
        return build_config(self.name, None, {**self.options, **extra}, self.current_timestep)

    def _enable(self, config: Any) -> None:
        if self._config is not None:
            self.transformer.disable_cache()
        self.transformer.enable_cache(config)
        self._config = config

    def disable(self) -> None:
        if self._config is not None:
            self.transformer.disable_cache()
            self._config = None

    def start_request(self, num_steps: int) -> None:
        """MagCache counts steps against the configured schedule length: reconfigure when it changes."""
        if self.name != "mag" or (self._num_steps == num_steps and self._config is not None):
            return
        self._num_steps = num_steps
        if self.mag_ratios is None:
            self._enable(self._make_config(num_inference_steps=num_steps, calibrate=True))
        else:
            self._enable(self._make_config(num_inference_steps=num_steps, mag_ratios=list(self.mag_ratios)))

    @contextlib.contextmanager
    def around_request(self) -> Iterator[None]:
        """MagCache calibration prints the ratios it measured at the end of the schedule: read them there."""
        if self.name != "mag" or self.mag_ratios is not None:
            yield
            return
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            yield
        found = re.findall(r"\[MagCache\] Calibration Complete[^\n]*\n(\[[^\n]*\])", buf.getvalue())
        if found:
            self.mag_ratios = [float(x) for x in found[0].strip("[]").split(",")]
            self._num_steps = None  # next request: skipping with the measured ratios
