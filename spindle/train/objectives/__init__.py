"""Training objectives, one module each (`train.objective`): the part of a task that owns the data format, the
loss and its metrics (`spindle.contracts.task.Objective`). A task builds its objective by name and delegates
`build_loader`, `loss_units` and `forward` to it; what runs the model on a batch stays the task's (its input kind,
its experts part), so an objective works for every model kind that offers what it calls.

- `sft` (language models): next-token loss on text / chat / multimodal conversations (sft.py);
- `flow_matching` (DiTs): the velocity loss on media and conditions (flow_matching.py);
- `diffusion_dpo` (DiTs): Diffusion-DPO on preference pairs of images or videos against the starting weights
  (diffusion_dpo.py: the loss and its `DiffusionDPO` part; the pairs file is spindle/data/media_pairs.py);
- `dpo` (text causal LMs): preference pairs against a frozen reference (dpo.py: the loss and its `DPO` part);
- `reward` (text causal LMs): a scalar head's Bradley-Terry loss on preference pairs (reward.py: the loss, its
  `Reward` part and the `ScoreHead` model choice the task builds);
- `grpo` (text causal LMs, online): completions sampled from the live policy, scored by rewards, the clipped
  objective on group-relative advantages (grpo.py: the loss and its `GRPO` part; spindle/train/generation.py).

The post-training losses are pure functions on log-probability (or score) tensors: `dpo` (sigmoid / ipo / simpo
preference losses), `reward` (Bradley-Terry loss of a scalar head), `grpo` (group-relative advantages and the
clipped policy objective), and `logprobs` (the per-token log-probabilities they start from). Each is the one TRL
1.16 computes (tests/train/test_objectives.py compares them with TRL's own code) and says how it splits into a sum
over units, so that the trainer's global normalisation (`spindle.contracts.task`) gives the same step on every
layout.
"""

from __future__ import annotations

from typing import Any

# objective name -> "module:Class" (built from the job config)
OBJECTIVES: dict[str, str] = {
    "sft": "spindle.train.objectives.sft:SFT",
    "flow_matching": "spindle.train.objectives.flow_matching:FlowMatching",
    "diffusion_dpo": "spindle.train.objectives.diffusion_dpo:DiffusionDPO",
    "dpo": "spindle.train.objectives.dpo:DPO",
    "reward": "spindle.train.objectives.reward:Reward",
    "grpo": "spindle.train.objectives.grpo:GRPO",
}


def build_objective(name: str, cfg: Any) -> Any:
    """The objective `name` for a job config `cfg` (its section of settings, when it has one)."""
    from spindle.contracts.family import import_object

    if name not in OBJECTIVES:
        raise ValueError(f"unknown training objective {name!r}; known: {', '.join(sorted(OBJECTIVES))}")
    return import_object(OBJECTIVES[name])(cfg)
