"""Qwen2 / Qwen2.5 and Gemma 3 text (spindle/models/qwen2, spindle/models/gemma3) beyond the registry-parametrised
causal-LM conformance suite: Qwen2.5's ChatML tokens and template; LoRA adapts every decoder projection (Qwen2's
biased q/k/v, Gemma 3's sliding-window and full layers alike) and exports a PEFT folder stock peft loads with the
trained model's outputs; reward modelling's step 1 equals TRL's. (DPO's step 1 against TRL, for these and the other
families: tests/train/test_preference_trl_parity.py, DPO_FAMILIES.)"""

from __future__ import annotations

import pytest

from tests.conftest import lm_train
from tests.train.test_lm_lora import LORA, check_peft_and_merged, trained_only_adapters

FAMILIES = ["qwen2", "gemma3"]


def test_qwen2_tokenizer_has_chatml_turns_tools_and_the_default_system(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    default = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert tok.apply_chat_template(chat, tokenize=False) == (
        default + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    system = [{"role": "system", "content": "Be brief."}, *chat[:1], {"role": "tool", "content": "42"}]
    assert tok.apply_chat_template(system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tok(token, add_special_tokens=False).input_ids) == 1, token
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_adapts_every_decoder_projection_and_exports_a_peft_folder(name, tiny_checkpoint, lm_corpus, tmp_path):
    """Default LoRA targets: the attention and MLP projections of every decoder layer (Gemma 3's sliding-window
    layers and its full-attention layers); stock peft + transformers load the PEFT folder with the trained
    model's logits, and the merged folder loads alone (1e-5)."""
    root = tiny_checkpoint(name)
    trainer, _ = lm_train(root, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = {n.split(".lora_")[0].split(".layers.")[1] for n in trained_only_adapters(trainer)}
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    projections += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    layers = trainer.model.config.num_hidden_layers
    assert adapted == {f"{i}.{p}" for i in range(layers) for p in projections}
    check_peft_and_merged(trainer, root, tmp_path / "run" / "export")


@pytest.mark.parametrize(("name", "head"), [("qwen2", "Qwen2"), ("gemma3", "Gemma3Text")], ids=FAMILIES)
def test_reward_step_one_equals_trl_and_the_export_scores_in_stock_transformers(name, head, tiny_checkpoint, tmp_path):
    """Reward modelling: step 1's loss and grad norm equal trl.RewardTrainer's (1e-5); the export is the family's
    stock sequence-classification class and scores as the trained model does."""
    import json

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from spindle.train.metrics import read_metrics
    from tests.train.test_reward_train import PAIRS, pairs_file, reward_overrides, trl_reward_step_one

    root = tiny_checkpoint(name)
    trainer, _ = lm_train(
        root, pairs_file(tmp_path, PAIRS), tmp_path / "run", **reward_overrides(len(PAIRS), train__max_steps=1)
    )
    trainer.model.eval()
    (first,) = read_metrics(tmp_path / "run")
    loss, norm = trl_reward_step_one(root, PAIRS, tmp_path)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    export = tmp_path / "run" / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == [f"{head}ForSequenceClassification"]
    stock = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    texts = [PAIRS[0]["prompt"] + PAIRS[0]["chosen"], PAIRS[1]["prompt"] + PAIRS[1]["rejected"]]
    batch = AutoTokenizer.from_pretrained(export)(texts, padding=True, padding_side="right", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(stock(**batch).logits, trainer.model(**batch).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
def test_grpo_trains_and_logs_each_sampled_completion(name, tiny_checkpoint, tmp_path):
    """GRPO: rollouts sampled from the family's model, scored by a reward function, one update; every sampled
    completion is logged with its reward, and the step's mean reward is theirs."""
    import json

    from spindle.train.metrics import read_metrics

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Write:", "Hello")))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    lm_train(
        tiny_checkpoint(name),
        prompts,
        tmp_path / "run",
        train__objective="grpo",
        data__seq_len=32,
        train__global_batch_size=2,
        train__micro_batch_size=2,
        train__max_steps=1,
        train__log_every=1,
        grpo__num_generations=2,
        grpo__max_new_tokens=4,
        grpo__rewards=f"[{rewards}:length]",
        checkpoint__export=False,
    )
    (metrics,) = read_metrics(tmp_path / "run")
    lines = (tmp_path / "run" / "samples" / "grpo.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) == 4 and all(s["reward"] == float(len(s["completion"])) for s in samples)
    assert metrics["reward/length"] == pytest.approx(sum(s["reward"] for s in samples) / 4)
    assert metrics["grad_norm"] > 0
