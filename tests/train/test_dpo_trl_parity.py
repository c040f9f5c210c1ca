"""A first DPO step on a tiny Qwen3 policy and a *different* reference model equals `trl.DPOTrainer`'s.

Spindle's pieces, end to end: the preference JSONL read and tokenised by `spindle.data.preference`, batched by
`collate_pairs`, each model's per-token log-probabilities from its hidden states through the chunked
`token_log_probs` (the lm_head applied chunk by chunk), summed per completion and fed to `dpo_loss`. TRL's side:
a real `DPOTrainer` built on the same policy, reference and lines, its loss for one batch holding every pair
computed by its own `compute_loss` (no optimizer step). Loss to 1e-6 and gradient norm to 1e-5 relative (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset  # TRL's own dependency: its trainers take `datasets.Dataset`s
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from spindle.data.preference import collate_pairs, preference_pairs
from spindle.train.objectives.dpo import dpo_loss
from spindle.train.objectives.logprobs import sequence_log_probs, token_log_probs

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
