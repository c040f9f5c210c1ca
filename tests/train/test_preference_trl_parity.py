"""A first DPO step on a tiny Qwen3 policy and a *different* reference model equals `trl.DPOTrainer`'s (and Spindle's
whole first DPO training step on each family of `DPO_FAMILIES`), and a first
reward-model step (a Qwen3 sequence-classification head) equals `trl.RewardTrainer`'s.

Spindle's pieces, end to end: the preference JSONL read and tokenised by `spindle.data.preference`, batched by
`collate_pairs`, each model's per-token log-probabilities from its hidden states through the chunked
`token_log_probs` (the lm_head applied chunk by chunk), summed per completion and fed to `dpo_loss`. TRL's side:
a real `DPOTrainer` built on the same policy, reference and lines, its loss for one batch holding every pair
computed by its own `compute_loss` (no optimizer step). Loss to 1e-6 and gradient norm to 1e-5 relative (fp32).
GRPO's scoring of sampled completions (left-padded prompts, right-padded completions, the sampling temperature)
is `GRPOTrainer._get_per_token_logps_and_entropies` on the model with TRL's fused LM head, against
`collate_sequences` rows scored by `token_log_probs`. The reward model the same way: `reward_pairs` + `collate_reward_pairs`, the head's score at each sequence's last
token, `reward_loss` with the margin column, against `RewardTrainer.compute_loss` on the same model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset  # TRL's own dependency: its trainers take `datasets.Dataset`s
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

from spindle.data.preference import (
    collate_pairs,
    collate_reward_pairs,
    collate_sequences,
    preference_pairs,
    read_prompts,
    reward_pairs,
)
from spindle.train.generation import completion_mask
from spindle.train.objectives.dpo import dpo_loss
from spindle.train.objectives.logprobs import sequence_log_probs, token_log_probs
from spindle.train.objectives.reward import reward_loss

LINES = {
    "standard": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, mostly."},
        {"prompt": "Answer: ", "chosen": "yes", "rejected": "no way at all"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ],
    "conversational": [
        {
            "prompt": [{"role": "user", "content": "What color is the sky?"}],
            "chosen": [{"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "assistant", "content": "Green, I think."}],
        },
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        },
    ],
}
SEQ_LEN = 64


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    """A second tiny Qwen3 with other weights (seed 1): the reference is not the starting policy."""
    from spindle.testing.tiny import build_tiny

    return build_tiny("qwen3", tmp_path_factory.mktemp("models") / "qwen3_ref", seed=1)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def grad_norm(model):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))


def trl_step_one(policy_path, ref_path, tokenizer, lines, loss_type, beta, rpo_alpha, tmp_path):
    policy = load(policy_path)
    types, weights = ([loss_type, "sft"], [1.0, rpo_alpha]) if rpo_alpha else ([loss_type], None)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=len(lines),
        max_length=SEQ_LEN,
        beta=beta,
        loss_type=types,
        loss_weights=weights,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=load(ref_path),
        args=args,
        train_dataset=Dataset.from_list(lines),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))  # every pair (the order does not change a mean)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), grad_norm(policy)


def spindle_step_one(policy_path, ref_path, tokenizer, path, loss_type, beta, rpo_alpha):
    pairs, _ = preference_pairs(path, tokenizer, seq_len=SEQ_LEN)
    batch = collate_pairs(pairs, tokenizer.pad_token_id)

    def logps(model):
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        per_token = token_log_probs(hidden, model.lm_head.weight, batch["shift_labels"], chunk_size=16)
        return sequence_log_probs(per_token, batch["shift_labels"])

    policy, reference = load(policy_path), load(ref_path)
    sums, tokens = logps(policy)
    with torch.no_grad():
        ref_sums, _ = logps(reference)
    chosen, rejected = sums.chunk(2)
    chosen_n, rejected_n = tokens.chunk(2)
    ref_chosen, ref_rejected = ref_sums.chunk(2)
    out = dpo_loss(
        chosen,
        rejected,
        chosen_n,
        rejected_n,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=loss_type,
        rpo_alpha=rpo_alpha,
    )
    out.loss.backward()
    return out.loss.detach(), grad_norm(policy)


@pytest.mark.parametrize(
    "fmt, loss_type, beta, rpo_alpha",
    [("standard", "sigmoid", 0.1, None), ("conversational", "ipo", 0.5, None), ("standard", "sigmoid", 0.2, 0.5)],
)
def test_step_one_equals_trl_dpo_trainer(fmt, loss_type, beta, rpo_alpha, tiny_qwen3, reference_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    lines = LINES[fmt]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    theirs, theirs_norm = trl_step_one(
        tiny_qwen3, reference_model, tokenizer, lines, loss_type, beta, rpo_alpha, tmp_path
    )
    ours, ours_norm = spindle_step_one(tiny_qwen3, reference_model, tokenizer, path, loss_type, beta, rpo_alpha)
    assert abs(theirs.item() - 0.6931) > 1e-3  # the reference differs from the policy: not the untrained log 2
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_norm, theirs_norm, rtol=1e-5, atol=0)


# The families whose first DPO training step (Spindle's trainer, end to end) is checked against TRL's: Gemma 3's
# final-logit softcap in the log-probs, DeepSeek-V3's latent attention and routed experts (no router aux loss:
# the DPO loss alone), GPT-OSS's sinks, sliding-window layers and biased experts with its router aux loss (TRL
# adds `router_aux_loss_coef x aux_loss` for a config with `output_router_logits`, as Spindle's DPO does).
DPO_FAMILIES = ["qwen2", "gemma3", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("name", DPO_FAMILIES)
def test_dpo_training_step_one_equals_trl_on_each_family(name, tiny_checkpoint, tmp_path):
    """Post-training a family: Spindle's step 1 DPO loss and grad norm with the starting policy as the reference
    equal trl.DPOTrainer's (1e-5 / 1e-4)."""
    from spindle.train.metrics import read_metrics
    from tests.conftest import lm_train
    from tests.train.test_dpo_train import dpo_overrides, pairs_file

    root = tiny_checkpoint(name)
    lines = LINES["standard"]
    lm_train(
        root,
        pairs_file(tmp_path, lines),
        tmp_path / "run",
        **dpo_overrides(len(lines), dpo__beta=0.1, train__max_steps=1, checkpoint__export=False),
    )
    metrics = read_metrics(tmp_path / "run")[0]
    tokenizer = AutoTokenizer.from_pretrained(root)
    loss, norm = trl_step_one(root, root, tokenizer, lines, "sigmoid", 0.1, None, tmp_path)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


def test_reward_step_one_equals_trl_reward_trainer(tiny_qwen3, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    lines = [{**line, "margin": 0.5 * i} for i, line in enumerate(LINES["standard"])]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    torch.manual_seed(0)  # the new score head's initialisation; both sides start from this one model
    model = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3, num_labels=1, dtype=torch.float32)
    ours_model = copy.deepcopy(model)

    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=len(lines),
        max_length=SEQ_LEN,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(lines), processing_class=tokenizer)
    theirs = trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))
    theirs.backward()

    pairs, _ = reward_pairs(path, tokenizer, seq_len=SEQ_LEN)
    batch = collate_reward_pairs(pairs, tokenizer.pad_token_id)
    hidden = ours_model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    last = hidden[torch.arange(hidden.shape[0]), batch["last_index"]]
    chosen, rejected = ours_model.score(last).squeeze(-1).chunk(2)
    ours = reward_loss(chosen, rejected, batch["margin"])
    ours.loss.backward()

    torch.testing.assert_close(ours.loss.detach(), theirs.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_norm(ours_model), grad_norm(model), rtol=1e-5, atol=0)


def test_grpo_completion_log_probs_equal_trl_scoring(tiny_qwen3, tmp_path):
    """Sampled completions (one ends at EOS and runs on after it, one has no EOS) scored at temperature 0.7."""
    import contextlib
    import types

    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head, pad

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "Count to three."}]})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    prompts = [p.prompt_ids for p in read_prompts(path, tokenizer)]
    eos = tokenizer.eos_token_id
    generated = torch.tensor([[300, 301, eos, 302, 303], [310, 311, 312, 313, 314], [320, eos, 5, 5, 5]])
    mask = completion_mask(generated, [eos])
    completions = [row[: int(m.sum())].tolist() for row, m in zip(generated, mask, strict=True)]
    prompt_rows = [prompts[0], prompts[1], prompts[0]]
    temperature = 0.7

    # TRL: left-padded prompts + right-padded completions, the completion tokens scored by the fused head
    trl_model = load(tiny_qwen3)
    add_fused_lm_head(trl_model, temperature=temperature)
    prompt_ids = pad([torch.tensor(p) for p in prompt_rows], padding_value=tokenizer.pad_token_id, padding_side="left")
    prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_rows], padding_value=0, padding_side="left")
    stand_in = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    )
    theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        stand_in,
        trl_model,
        torch.cat([prompt_ids, generated], dim=1),
        torch.cat([prompt_mask, mask], dim=1),
        generated.shape[1],
    )

    model = load(tiny_qwen3)
    batch = collate_sequences(list(zip(prompt_rows, completions, strict=True)), tokenizer.pad_token_id)
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    per_token = token_log_probs(hidden, model.lm_head.weight, batch["shift_labels"], temperature=temperature)
    # each row's completion log-probabilities, laid out as TRL's [B, completion length]
    ours = torch.zeros_like(theirs)
    for i, (prompt, completion) in enumerate(zip(prompt_rows, completions, strict=True)):
        ours[i, : len(completion)] = per_token[i, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    assert bool((ours[mask.bool()] < 0).all())  # every scored token has a real log-probability
    # 1e-5, not 1e-6: TRL's left padding moves the prompt's absolute positions (RoPE is relative, so only rounding)
    torch.testing.assert_close(ours, theirs * mask, rtol=1e-5, atol=1e-5)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
