"""Wan2.2 A14B two-expert inference (families wan22 / wan22_i2v): which expert denoises which step, the
per-expert engine options (offload, block swap, step caches), and folders forced on the wrong family.
Parity with the stock pipelines (both experts, guidance_scale_2) is the conformance suite's
(tests/conformance/test_conformance.py, parametrised over the registry)."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.testing.specs import dit_spec

CASE = dit_spec("wan22").parity_cases["nocfg"]  # 3 steps: t = 1000, 857, 600 (shift 3)


@pytest.fixture(scope="module")
def tiny_wan22(tiny_checkpoint):
    return tiny_checkpoint("wan22")


def count_calls(gen) -> dict[str, int]:
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:

        def hook(module, args, name=name):
            calls[name] += 1

        gen.pipeline.components[name].register_forward_pre_hook(hook)
    return calls


def test_each_expert_denoises_the_steps_on_its_side_of_the_boundary(tiny_wan22):
    gen = load_generator(tiny_wan22)
    calls = count_calls(gen)
    gen.generate(**CASE)
    # boundary_ratio 0.875 x 1000: the high-noise expert takes t=1000, the low-noise one t=857 and t=600
    assert calls == {"transformer": 1, "transformer_2": 2}
    cfg = dit_spec("wan22").parity_cases["cfg"]  # 2 steps, t = 1000, 750; CFG batched
    calls.update(transformer=0, transformer_2=0)
    gen.generate(**cfg)
    assert calls == {"transformer": 1, "transformer_2": 1}


def test_guidance_scale_2_is_the_low_noise_experts_cfg_scale(tiny_wan22, monkeypatch):
    gen = load_generator(tiny_wan22)
    spec = gen.pipeline.spec
    scales = []
    combine = spec.combine_cfg
    monkeypatch.setattr(spec, "combine_cfg", lambda c, u, scale: scales.append(scale) or combine(c, u, scale))
    cfg = dit_spec("wan22").parity_cases["cfg"]  # t = 1000 (high noise), 750 (low noise)
    default = gen.generate(**{k: v for k, v in cfg.items() if k != "guidance_scale_2"}).frames
    assert scales == [cfg["guidance_scale"]] * 2  # unset: guidance_scale, as stock
    scales.clear()
    other = gen.generate(**cfg).frames
    assert scales == [cfg["guidance_scale"], cfg["guidance_scale_2"]]
    # a tiny random model's prompt moves the prediction little: the output changes well above rounding
    assert np.abs(other - default).max() > 1e-6


def test_expert_offload_keeps_one_expert_on_the_device_and_changes_nothing(tiny_wan22):
    plain = load_generator(tiny_wan22).generate(**CASE).frames
    gen = load_generator(tiny_wan22, expert_offload=True)
    offload = gen.pipeline.offloads["experts"]
    out = gen.generate(**CASE).frames
    np.testing.assert_array_equal(out, plain)
    assert offload.max_resident_bytes == max(offload.unit_bytes)  # never both experts at once
    assert offload.onloads == 2  # each expert moved in once for its run of steps
    gen.generate(**CASE)
    assert offload.onloads == 4


def test_blocks_to_swap_streams_the_blocks_of_both_experts(tiny_wan22):
    plain = load_generator(tiny_wan22).generate(**CASE).frames
    gen = load_generator(tiny_wan22, blocks_to_swap=1)
    assert set(gen.pipeline.offloads) == {"transformer", "transformer_2"}
    np.testing.assert_array_equal(gen.generate(**CASE).frames, plain)
    with pytest.raises(ValueError, match="blocks_to_swap streams blocks of each expert, expert_offload whole"):
        load_generator(tiny_wan22, blocks_to_swap=1, expert_offload=True)


def test_expert_offload_on_one_transformer_and_mag_on_two_experts_are_refused(tiny_wan22, tiny_wan):
    with pytest.raises(ValueError, match=r"expert_offload: this model denoises with one transformer"):
        load_generator(tiny_wan, expert_offload=True)
    with pytest.raises(ValueError, match="cache 'mag' calibrates its ratios over one model's whole schedule"):
        load_generator(tiny_wan22, cache="mag")


def test_step_cache_runs_on_each_expert(tiny_wan22):
    gen = load_generator(tiny_wan22, cache="fbc", cache_threshold=0.0)
    assert set(gen.pipeline.denoising.caches) == {"transformer", "transformer_2"}
    exact = load_generator(tiny_wan22).generate(**CASE).frames
    np.testing.assert_allclose(gen.generate(**CASE).frames, exact, atol=1e-6, rtol=0)


def test_a_two_expert_folder_forced_on_the_single_transformer_family_names_its_family(tiny_wan22, tiny_wan):
    with pytest.raises(ValueError, match=r"two-expert Wan2\.2 A14B folder .* it is the wan22 family's"):
        load_generator(tiny_wan22, family="wan")
    with pytest.raises(ValueError, match=r"wan22 serves two-expert Wan2\.2 A14B folders"):
        load_generator(tiny_wan, family="wan22")
