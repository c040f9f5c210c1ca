"""Qwen-Image-Edit fine-tuning on edit pairs, what the conformance suite does not cover (its overfit and
full-weight export into the stock pipelines: tests/conformance/test_conformance.py): the condition model
encodes the sources as the pipeline does (the vision-language prompt with the image, the reference
latents), and a LoRA fine-tune's export loads in the stock QwenImageEditPipeline and edits there as in
Spindle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator, load_job_config, make_trainer
from spindle.data.synthetic import make_shapes_edit_dataset
from spindle.models.qwenimage_edit.conformance import sample_image
from spindle.testing.conformance import stock_pipeline
from tests.conftest import train_overrides

TEXT = 32  # model.max_text_length: the instruction plus the image's vision tokens


@pytest.fixture(scope="module")
def edit(tiny_checkpoint):
    return tiny_checkpoint("qwenimage_edit")


@pytest.fixture(scope="module")
def condition(edit):
    from spindle.models.qwenimage_edit.condition import QwenImageEditConditionModel

    return QwenImageEditConditionModel.from_pretrained(edit, max_text_length=TEXT)


def test_conditions_are_the_pipelines_prompt_with_the_image_and_its_reference_latents(condition):
    """Per sample: `encode_prompt` with the source as the uint8 image a user passes, padded with a zero
    mask; the references are the pipeline's `_encode_vae_image` of the source; the transformer input is
    [noisy target tokens; reference tokens] and the loss reads the target's tokens only."""
    from spindle.data.media import tensor_to_image
    from spindle.train.tasks.flow_matching import sample_generator

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 1, 32, 32, generator=g) * 2 - 1
    sources = (torch.randint(0, 256, (2, 1, 3, 32, 32), generator=g) / 127.5 - 1).float()
    batch = {"pixels": pixels, "images": sources, "caption": ["make the circle red", "a blue square"]}
    conditions = condition.encode(batch)
    pipe = condition.pipe
    for i, caption in enumerate(batch["caption"]):
        embeds, mask = pipe.encode_prompt(prompt=[caption], image=[tensor_to_image(sources[i, 0])], device="cpu")
        n = embeds.shape[1]
        assert mask is None and n < TEXT  # all valid, then padded
        torch.testing.assert_close(conditions["prompt_embeds"][i, :n], embeds[0], rtol=0, atol=0)
        assert conditions["prompt_embeds_mask"][i].tolist() == [1] * n + [0] * (TEXT - n)
        reference = pipe._encode_vae_image(sources[i, :, :, None], generator=None)
        torch.testing.assert_close(conditions["image_latents"][i, 0], reference[0, :, 0], rtol=0, atol=1e-6)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    target = inputs["target"]
    refs = [pipe._pack_latents(conditions["image_latents"][:, 0], 2, 4, 2, 2)]
    assert inputs["hidden_states"].shape[1] == target.shape[1] + refs[0].shape[1]
    torch.testing.assert_close(inputs["hidden_states"][:, target.shape[1] :], refs[0], rtol=0, atol=0)
    assert inputs["img_shapes"] == [[(1, 1, 1), (1, 1, 1)]] * 2
    pred = torch.randn(2, inputs["hidden_states"].shape[1], 16)
    assert torch.equal(condition.target_prediction(pred, target), pred[:, : target.shape[1]])


def test_no_source_images_is_a_clear_error(condition):
    batch = {"pixels": torch.zeros(1, 3, 1, 32, 32), "caption": ["x"]}
    with pytest.raises(ValueError, match="trains on edit pairs: the batch has no source images"):
        condition.encode(batch)


def test_lora_edit_fine_tune_exports_what_stock_diffusers_applies(edit, tmp_path):
    data = make_shapes_edit_dataset(tmp_path / "pairs", num_pairs=4, size=(32, 32))
    overrides = train_overrides(
        edit, data, tmp_path / "run", data__num_frames=1, model__max_text_length=TEXT, train__max_steps=3,
        train__global_batch_size=2, train__lr=1e-2, train__lora="{rank: 4, alpha: 8}",
    )  # fmt: skip
    result = make_trainer(load_job_config(None, overrides)).run()
    lora = result.export_dir / "lora"
    kw = dict(prompt="make the circle red", image=sample_image(), height=32, width=32, num_inference_steps=2)
    pipe = stock_pipeline(edit)
    pipe.set_progress_bar_config(disable=True)
    base = pipe(**kw, generator=torch.Generator().manual_seed(0), output_type="np").images
    pipe.load_lora_weights(lora)
    tuned = pipe(**kw, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.abs(tuned - base).max() > 1e-4, "the LoRA changed nothing in the stock pipeline"
    ours = load_generator(edit, lora=str(lora)).generate(**kw, seed=0, max_sequence_length=512).frames
    assert np.abs(ours - tuned).max() <= 1e-5
