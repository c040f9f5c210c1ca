"""Inputs that sequence parallel splits at the model's entry must divide by the SP degree: clear error."""

import pytest
import torch

from spindle.distributed.context_parallel import check_split_inputs


@pytest.fixture(scope="module")
def flux_transformer(tiny_flux):
    from spindle.export.diffusers import load_transformer

    return load_transformer(tiny_flux)


def test_text_tokens_not_divisible_by_sp_name_the_input(flux_transformer):
    inputs = {
        "hidden_states": torch.zeros(1, 16, 4),
        "encoder_hidden_states": torch.zeros(1, 7, 8),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(7, 3),
    }
    with pytest.raises(ValueError, match=r"'encoder_hidden_states' along dim 1, which has length 7.*max_text_length"):
        check_split_inputs(flux_transformer, 2, inputs)


def test_divisible_inputs_pass_and_sp1_is_a_no_op(flux_transformer):
    inputs = {
        "hidden_states": torch.zeros(1, 16, 4),
        "encoder_hidden_states": torch.zeros(1, 8, 8),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    check_split_inputs(flux_transformer, 2, inputs)
    check_split_inputs(flux_transformer, 1, {**inputs, "encoder_hidden_states": torch.zeros(1, 7, 8)})
