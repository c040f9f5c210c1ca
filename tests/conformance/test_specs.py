"""The conformance suites find each family's spec by its name in its folder's conformance.py
(spindle.testing.specs): the records carry no test data, and a family is never run with another's spec."""

from __future__ import annotations

import dataclasses

import pytest

from spindle.models.flux2 import conformance as flux2_specs
from spindle.models.shared.conformance import CausalLMConformanceSpec
from spindle.registry import get_family
from spindle.testing.specs import declared, dit_spec, lm_spec


def test_two_records_in_one_folder_each_get_their_own_spec():
    assert dit_spec("flux2") is flux2_specs.FLUX2
    assert dit_spec("flux2_klein") is flux2_specs.FLUX2_KLEIN
    assert dit_spec("flux2").no_cfg and not dit_spec("flux2_klein").no_cfg  # FLUX.2-dev has no CFG, klein has


def test_a_variant_s_spec_is_derived_from_its_base_s():
    wan, wan22 = dit_spec("wan"), dit_spec("wan22")
    assert wan is not None and wan22 is not None
    assert wan22.train_overrides == {"train__expert": "high_noise"} and not wan.train_overrides
    assert wan22.parity_cases["nocfg"] == wan.parity_cases["nocfg"]
    assert wan22.parity_cases["cfg"] == {**wan.parity_cases["cfg"], "guidance_scale_2": 3.0}


def test_a_causal_lm_family_without_a_conformance_module_runs_with_the_defaults():
    assert declared("qwen3") is None
    assert lm_spec("qwen3") == CausalLMConformanceSpec()
    assert lm_spec("qwen3_moe").stock_outputs == ("aux_loss",)  # an MoE family's own, from its module


def test_a_conformance_module_without_the_family_s_spec_names_what_is_missing():
    renamed = dataclasses.replace(get_family("wan"), name="wan_renamed", package="spindle.models.wan")
    with pytest.raises(AssertionError, match=r"spindle\.models\.wan\.conformance defines no WAN_RENAMED"):
        dit_spec(renamed)
