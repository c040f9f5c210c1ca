"""`train.objective: grpo` on vision-language and omni families: prompts with an image, completions sampled from
the live policy with the image in its context (the prompt's forward runs the towers, the next tokens' forwards
continue the 3-D positions), scored, and the clipped objective on rows that carry the image again."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from spindle.train.metrics import read_metrics

REWARD = """
def short(completions, **kwargs):
    return [1.0 / (1 + len(c[0]["content"])) for c in completions]
"""


@pytest.fixture(scope="module")
def image_prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm_prompts")
    rng = np.random.default_rng(1)
    lines = []
    for i, question in enumerate(["What is this?", "Describe it.", "Which colour?", "Is it big?"]):
        Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        content = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": question}]
        lines.append({"prompt": [{"role": "user", "content": content}], "topic": "shapes"})
    (folder / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "rewards.py").write_text(REWARD)
    return folder / "prompts.jsonl", folder / "rewards.py", lines


def grpo_values(rewards, **values):
    base = dict(
        train__objective="grpo", data__seq_len=256, data__shuffle=False, train__global_batch_size=2,
        train__micro_batch_size=2, train__lr=1e-3, grpo__num_generations=2, grpo__max_new_tokens=4,
        grpo__rewards=f"[{rewards}:short]", checkpoint__export=False,
    )  # fmt: skip
    return {**base, **values}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3_vl"])
def test_greedy_rollouts_of_an_image_prompt_equal_stock_generate(family, tiny_checkpoint, image_prompts, tmp_path):
    """The rollout machinery with (effectively) greedy sampling gives the tokens stock `generate(do_sample=False)`
    gives on what the stock processor makes of the same prompt and image: the image reaches the prompt's forward
    and the cached decode steps continue its positions as the model's own generate does (Qwen2.5-VL's 3-D ones;
    Gemma 3's 1-D ones, the prompt's image tokens one bidirectional block)."""
    from spindle.api import make_trainer
    from spindle.testing.vlm_conformance import stock_model, stock_processor
    from spindle.train.generation import Sampling, sample_group
    from tests.conftest import lm_overrides, load_job_config

    prompts, rewards, lines = image_prompts
    path = tiny_checkpoint(family)
    trainer = make_trainer(load_job_config(None, lm_overrides(path, prompts, tmp_path / "run", **grpo_values(rewards))))
    objective = trainer.task.objective
    _, example = next(trainer.loader)[0]
    model = trainer.model.eval()
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    greedy = Sampling(max_new_tokens=6, temperature=1.0, top_p=1e-9)  # only the most likely token survives
    eos = {trainer.task.tokenizer.eos_token_id}
    tokens, mask = sample_group(
        model,
        example.prompt_ids,
        gens,
        greedy,
        eos,
        0,
        trainer.task.device,
        objective.inputs.rollout_inputs(example, 2),
    )

    processor = stock_processor(path)
    text = processor.apply_chat_template(lines[0]["prompt"], tokenize=False, add_generation_prompt=True)
    image = Image.open(prompts.parent / "0.png").convert("RGB")
    inputs = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)  # template's BOS
    assert inputs["input_ids"][0].tolist() == example.prompt_ids
    stock = stock_model(path).eval()
    out = stock.generate(**inputs, do_sample=False, max_new_tokens=6, eos_token_id=list(eos), pad_token_id=0)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert tokens[0, : len(new)][mask[0, : len(new)].bool()].tolist() == new[: int(mask[0].sum())].tolist()
    assert torch.equal(tokens[0], tokens[1])  # greedy: both samples alike


def _media_families() -> list[str]:
    from spindle.registry import all_families

    return [f.name for f in all_families() if f.kind in ("vlm", "omni")]


@pytest.mark.parametrize("family", _media_families())
def test_every_vision_language_and_omni_family_trains_on_image_prompts(
    family, tiny_checkpoint, image_prompts, tmp_path
):
    """Two GRPO steps on image prompts for each vision-language / omni family of the registry: completions are
    sampled and scored (the prompt's extra column reaches the reward's keyword arguments), the policy updates,
    and the samples file holds the prompts with their image parts."""
    from tests.conftest import lm_train

    prompts, rewards, _ = image_prompts
    lm_train(tiny_checkpoint(family), prompts, tmp_path / "run", **grpo_values(rewards, train__max_steps=2))
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 < m["reward_mean"] <= 1 and m["grad_norm"] > 0 for m in metrics)
    assert metrics[0]["completion_length"] > 0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert samples and samples[0]["prompt"][0]["content"][0]["type"] == "image"


@pytest.mark.slow
def test_two_processes_one_with_a_text_only_prompt_equal_one_process(tiny_qwen2_5_vl, image_prompts, tmp_path):
    """dp_shard=2 where one rank's prompt has an image and the other's none: the text-only rank runs the vision
    tower's dummy in the prompt's forward (FSDP2's gathers pair up, no hang) and both ranks sample what one process
    samples (rollouts keyed on seed, step, prompt, sample): rewards, losses and grad norms equal over 2 steps."""
    from tests.conftest import lm_train, lm_train_cli

    prompts, rewards, lines = image_prompts
    mixed = tmp_path / "mixed.jsonl"
    text_only = {"prompt": [{"role": "user", "content": "Say something short."}], "topic": "text"}
    image_line = {**lines[0], "prompt": [{**lines[0]["prompt"][0], "content": [
        {**lines[0]["prompt"][0]["content"][0], "image": str(prompts.parent / "0.png")},
        lines[0]["prompt"][0]["content"][1],
    ]}]}  # fmt: skip
    mixed.write_text(json.dumps(image_line) + "\n" + json.dumps(text_only) + "\n")
    values = grpo_values(rewards, train__max_steps=2, train__micro_batch_size=1, train__adam_eps=1e-4)
    lm_train(tiny_qwen2_5_vl, mixed, tmp_path / "one", **values)
    lm_train_cli(tiny_qwen2_5_vl, mixed, tmp_path / "two", 2, parallel__dp_shard=2, **values)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), strict=True):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
