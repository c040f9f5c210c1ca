"""`train.objective: dpo` on a vision-language family: preference pairs whose prompts hold images (TRL's
conversational format, the image as a content part), against a stock transformers computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from spindle.testing.vlm_conformance import grad_norm, stock_model, stock_processor
from spindle.train.metrics import read_metrics

SEQ = 96
BETA = 0.1
QUESTIONS = [
    ("What is this?", "A square.", "A circle, I think."),
    ("Describe it.", "Red and flat.", "Nothing."),
    ("Which colour?", "Blue.", "Green, mostly."),
    ("Is it big?", "No.", "Yes, very big indeed."),
]


def write_image_pairs(folder):
    """`folder`/pairs.jsonl: the QUESTIONS as TRL conversational pairs, a 56x84 random image (`folder`/i.png) in each
    prompt. -> (its path, the lines)."""
    rng = np.random.default_rng(0)
    lines = []
    for i, (question, chosen, rejected) in enumerate(QUESTIONS):
        Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        prompt = [
            {"role": "user", "content": [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": question}]}
        ]
        lines.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, lines


@pytest.fixture(scope="module")
def image_pairs(tmp_path_factory):
    return write_image_pairs(tmp_path_factory.mktemp("vlm_pairs"))


@pytest.fixture(scope="module")
def reference_vl(tmp_path_factory):
    """`reference_vl(family)`: a tiny checkpoint of the family with other weights (seed 1), made on first use."""
    from spindle.testing.tiny import build_tiny

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp("vl-ref") / family, seed=1)
        return built[family]

    return get


def stock_completion_log_probs(model, processor, lines, folder, completion: str):
    """Each line's summed log-probability of its `completion` ("chosen" / "rejected") under stock `model`: the
    stock processor's input ids, pixel values and grid of the prompt-and-completion conversation (the prompt's
    own tokens, rendered with the generation prompt, are not scored) and the model's own 3-D positions."""
    sums = []
    for line in lines:
        image = Image.open(folder / line["prompt"][0]["content"][0]["image"]).convert("RGB")
        prompt = processor.apply_chat_template(line["prompt"], tokenize=False, add_generation_prompt=True)
        whole = processor.apply_chat_template(line["prompt"] + line[completion], tokenize=False)
        # the template wrote the BOS where the model has one (Gemma 3)
        prompt_ids = processor(text=[prompt], images=[image], return_tensors="pt", add_special_tokens=False)
        prompt_ids = prompt_ids["input_ids"]
        inputs = processor(text=[whole], images=[image], return_tensors="pt", add_special_tokens=False)
        ids = inputs["input_ids"]
        assert torch.equal(ids[:, : prompt_ids.shape[1]], prompt_ids)
        logits = model(**inputs).logits.float()
        scores = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        sums.append(scores[prompt_ids.shape[1] - 1 :].sum())
    return torch.stack(sums)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3_vl"])
def test_an_image_dpo_step_equals_a_stock_transformers_computation(
    family, tiny_checkpoint, reference_vl, image_pairs, tmp_path
):
    """Qwen2.5-VL (3-D positions) and Gemma 3 (1-D positions, bidirectional image blocks), a different model of the
    family as dpo.reference_model, pairs with an image in each prompt: step 1's loss and grad norm equal the DPO
    loss of the stock ForConditionalGeneration run on what the stock processor makes of each
    prompt-and-completion conversation (1e-5 / 1e-4); the export loads in stock transformers."""
    from tests.conftest import lm_train

    data, lines = image_pairs
    policy_path, reference_path = tiny_checkpoint(family), reference_vl(family)
    lm_train(
        policy_path,
        data,
        tmp_path / "run",
        train__objective="dpo",
        data__seq_len=SEQ,
        data__shuffle=False,
        train__global_batch_size=len(lines),
        train__micro_batch_size=len(lines),
        train__max_steps=1,
        dpo__beta=BETA,
        dpo__reference_model=reference_path,
    )
    logged = read_metrics(tmp_path / "run")[0]
    processor = stock_processor(policy_path)
    policy, reference = stock_model(policy_path), stock_model(reference_path)
    reference.eval()
    chosen = stock_completion_log_probs(policy, processor, lines, data.parent, "chosen")
    rejected = stock_completion_log_probs(policy, processor, lines, data.parent, "rejected")
    with torch.no_grad():
        ref_chosen = stock_completion_log_probs(reference, processor, lines, data.parent, "chosen")
        ref_rejected = stock_completion_log_probs(reference, processor, lines, data.parent, "rejected")
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    loss = -torch.nn.functional.logsigmoid(BETA * margin).mean()
    loss.backward()
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(policy), rel=1e-4)
    assert logged["margin"] == pytest.approx((BETA * margin).mean().item(), abs=1e-6)
    assert stock_model(tmp_path / "run" / "export") is not None


def test_pairs_with_media_outside_the_prompt_or_as_text_are_named(tiny_qwen2_5_vl, image_pairs, tmp_path):
    from spindle.api import make_trainer
    from spindle.data.preference import PreferenceDataError
    from tests.conftest import lm_overrides, load_job_config

    _, lines = image_pairs
    folder = image_pairs[0].parent
    bad = tmp_path / "bad.jsonl"
    image = {"type": "image", "image": str(folder / "0.png")}
    prompt = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
    good = {**lines[0], "prompt": prompt}
    in_completion = {**good, "chosen": [{"role": "assistant", "content": [image]}]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps(in_completion) + "\n")
    values = dict(train__objective="dpo", data__seq_len=SEQ, train__global_batch_size=1, train__micro_batch_size=1)
    with pytest.raises(PreferenceDataError, match=rf'{bad}:2: "chosen" holds an image/video/audio part'):
        make_trainer(load_job_config(None, lm_overrides(tiny_qwen2_5_vl, bad, tmp_path / "a", **values)))
    bad.write_text(json.dumps({"prompt": "Hi", "chosen": " yes", "rejected": " no"}) + "\n")
    with pytest.raises(PreferenceDataError, match=rf"{bad}:1: a vision-language model's pairs are conversations"):
        make_trainer(load_job_config(None, lm_overrides(tiny_qwen2_5_vl, bad, tmp_path / "b", **values)))


def _media_families() -> list[str]:
    from spindle.registry import all_families

    return [f.name for f in all_families() if f.kind in ("vlm", "omni")]


@pytest.mark.parametrize("family", _media_families())
def test_every_vision_language_and_omni_family_takes_image_pairs(family, tiny_checkpoint, image_pairs, tmp_path):
    """One DPO step on image pairs for each vision-language / omni family of the registry, the reference its
    starting weights (a frozen copy): the policy is the reference at step 1, so every log-ratio is 0."""
    from tests.conftest import lm_train

    data, _ = image_pairs
    lm_train(
        tiny_checkpoint(family), data, tmp_path / "run", train__objective="dpo", data__seq_len=256,
        train__global_batch_size=2, train__micro_batch_size=2, train__max_steps=1, checkpoint__export=False,
    )  # fmt: skip
    (step,) = read_metrics(tmp_path / "run")
    assert step["margin"] == 0.0 and step["rewards/chosen"] == 0.0 and step["grad_norm"] > 0
    if "aux_loss" not in step:  # an MoE adds its router aux term
        assert step["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)


@pytest.mark.slow
def test_two_process_layouts_equal_one_process(tiny_qwen2_5_vl, reference_vl, image_pairs, tmp_path):
    """Image pairs on two processes: dp_shard=2 (each rank its half of the pairs, the vision tower and the
    reference model sharded) and Ulysses sp=2 (each rank a chunk of every row, the pairs' log-probabilities summed
    over the SP ranks) give one process's losses, grad norms and margins over 2 steps."""
    from tests.conftest import lm_train, lm_train_cli

    data, _ = image_pairs
    values = dict(
        train__objective="dpo",
        data__seq_len=SEQ,
        data__shuffle=False,
        train__global_batch_size=2,
        train__micro_batch_size=1,
        train__max_steps=2,
        train__adam_eps=1e-4,
        dpo__beta=BETA,
        dpo__reference_model=reference_vl("qwen2_5_vl"),
        checkpoint__export=False,
    )
    lm_train(tiny_qwen2_5_vl, data, tmp_path / "one", **values)
    layouts = {"dp_shard2": {"parallel__dp_shard": 2}, "sp2": {"parallel__sp": 2}}
    for name, layout in layouts.items():
        lm_train_cli(tiny_qwen2_5_vl, data, tmp_path / name, 2, **layout, **values)
    for name in layouts:
        for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / name), strict=True):
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key)
            # the margin is BETA x a difference of four summed log-probabilities (~-150 each, where fp32's spacing
            # is 1.5e-5), summed over the SP ranks in another order: 1.05e-6 apart seen on an AVX-512 CPU
            assert b["margin"] == pytest.approx(a["margin"], rel=1e-5, abs=BETA * 5e-5), name
