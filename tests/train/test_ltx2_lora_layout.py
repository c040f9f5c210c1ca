"""LTX-2's LoRA in the original Lightricks layout (`original_layout_lora.safetensors`, what ComfyUI and the LTX-2
trainer use) reads back through the stock pipeline's own reader to exactly the diffusers-layout adapters, for every
linear layer of the transformer; a key the reader would map elsewhere is refused naming it. (The export writing the
file beside `pytorch_lora_weights.safetensors`: tests/conftest.py `train_video_lora`, used by tests/train/test_ltx2.py.)
"""

from __future__ import annotations

import pytest
import torch

from spindle.contracts.family import import_object
from spindle.registry import get_family


@pytest.mark.parametrize("name", ["ltx2", "ltx2_i2v"])
def test_every_linear_layer_reads_back_through_the_stock_reader(name, tiny_checkpoint):
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    to_original = import_object(get_family(name).lora_original)
    transformer = LTX2VideoTransformer3DModel.from_pretrained(tiny_checkpoint(name), subfolder="transformer")
    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for module, layer in transformer.named_modules():
        if isinstance(layer, torch.nn.Linear):  # every projection, embedder and modulation a LoRA can target
            adapters[f"{module}.lora_A.weight"] = torch.randn(2, layer.in_features, generator=generator)
            adapters[f"{module}.lora_B.weight"] = torch.randn(layer.out_features, 2, generator=generator)
    original = to_original(adapters)
    assert all(k.startswith("diffusion_model.") for k in original)
    # the renamed modules are in the original's names (the attention projections keep theirs)
    assert {"diffusion_model.patchify_proj.lora_A.weight", "diffusion_model.adaln_single.linear.lora_A.weight"} <= set(
        original
    )
    back = LTX2Pipeline.lora_state_dict(original)
    assert back.keys() == {f"transformer.{k}" for k in adapters}
    assert all(torch.equal(back[f"transformer.{k}"], v) for k, v in adapters.items())


def test_a_key_the_reader_maps_elsewhere_is_refused_naming_it():
    from spindle.models.ltx2.lora import to_original

    # diffusers' reader renames `patchify_proj` to `proj_in`: a module literally named so cannot round-trip
    with pytest.raises(ValueError, match=r"'blocks\.patchify_proj\.lora_A\.weight' has no place in the original"):
        to_original({"blocks.patchify_proj.lora_A.weight": torch.zeros(2, 4)})
