"""What LoRA and the precompute cache ask of every registered DiT family (Wan, Flux, any added later):

- the condition model built with `encoders=False` (what `data.precomputed` trains with) loads no
  encoder weights and turns cached conditions into exactly the training inputs the full one does;
- default LoRA targets exist in the family's transformer blocks, only adapters train, and the
  diffusers-format file written through the family pipeline's `save_lora_weights` reads back
  through its `lora_state_dict` to the same tensors.
"""

from __future__ import annotations

import pytest
import torch

from spindle.config import LoraConfig
from spindle.models.base import import_object, load_transformer
from spindle.registry import all_families, get_family
from spindle.train.tasks.flow_matching import sample_generator

DIT_FAMILIES = sorted(f.name for f in all_families() if f.task == "flow_matching")


@pytest.fixture(scope="module", params=DIT_FAMILIES)
def tiny(request, tmp_path_factory):
    family = get_family(request.param)
    return family, import_object(family.tiny_model)(tmp_path_factory.mktemp(family.name) / "model", seed=0)


def test_condition_model_without_encoders_matches_the_full_one(tiny):
    family, root = tiny
    cls = family.condition_model_cls()
    full = cls.from_pretrained(root, torch.device("cpu"), torch.float32, max_text_length=16)
    light = cls.from_pretrained(root, torch.device("cpu"), torch.float32, max_text_length=16, encoders=False)
    resident = [p for m in light.pipe.components.values() if isinstance(m, torch.nn.Module) for p in m.parameters()]
    assert all(p.is_meta for p in resident), "encoders=False loaded encoder weights"

    demo = family.demo
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, demo.num_frames, *demo.size, generator=g) * 2 - 1
    conditions = full.encode({"pixels": pixels, "caption": ["a red circle", "a blue square"]})

    def inputs(model):
        return model.training_inputs(conditions, [sample_generator(0, 3, i) for i in range(2)])

    a, b = inputs(full), inputs(light)
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]) if torch.is_tensor(value) else value == b[key], key


def test_default_lora_targets_and_diffusers_file_round_trip(tiny, tmp_path):
    from spindle.train.lora import adapter_state_dict, lora_scale
    from spindle.train.tasks.flow_matching import add_lora

    family, root = tiny
    model = add_lora(load_transformer(root), LoraConfig(rank=2, alpha=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any(".norm" in n for n in trainable), "modulation layers are not default targets"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g))
    adapters = adapter_state_dict(model.state_dict(), lora_scale(model))
    pipeline = family.pipeline_class()
    pipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=adapters)
    back = pipeline.lora_state_dict(tmp_path / "lora")
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    assert back.keys() == adapters.keys()
    assert all(torch.equal(back[k], adapters[k]) for k in adapters)
