"""Reward models: the Bradley-Terry loss of a scalar head's scores on preference pairs.

Per pair i with scores s_c (chosen) and s_r (rejected), read at each sequence's last token:
-log σ(s_c - s_r - m_i), with m_i the pair's `margin` column when the data has one (and `reward.use_margin`),
else 0; plus, with `center_rewards_coefficient` κ, κ·mean((s_c + s_r)²) over the batch, which keeps the scores
centred on 0 (TRL's `RewardTrainer.compute_loss`, the same two terms).

Units: both terms are means over pairs (`pair_losses` sums to the trainer's loss sum over `pairs`).
Metrics: accuracy (share of pairs with s_c > s_r), margin (mean s_c - s_r), mean / min / max score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spindle.contracts.task import Objective, StepOutput


@dataclass
class RewardLoss:
    loss: torch.Tensor  # scalar: the batch's mean
    pair_losses: torch.Tensor  # [B] differentiable, centring term included
    chosen_scores: torch.Tensor  # [B] detached
    rejected_scores: torch.Tensor  # [B] detached

    @property
    def pairs(self) -> int:
        return int(self.pair_losses.shape[0])

    def metrics(self) -> dict[str, float]:
        scores = torch.cat([self.chosen_scores, self.rejected_scores])
        margin = self.chosen_scores - self.rejected_scores
        return {
            "accuracy": (margin > 0).float().mean().item(),
            "margin": margin.mean().item(),
            "mean_reward": scores.mean().item(),
            "min_reward": scores.min().item(),
            "max_reward": scores.max().item(),
        }


def reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> RewardLoss:
    """The Bradley-Terry loss of [B] chosen and rejected scores (module doc)."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_scores + rejected_scores) ** 2
    return RewardLoss(losses.mean(), losses, chosen_scores.detach(), rejected_scores.detach())


SCORE_HEAD = "score"  # transformers' name of a ForSequenceClassification's head (every causal-LM family's)


class ScoreHead:
    """The model-class choice of a reward run, a part the causal-LM task holds (`CausalLMTask.head`): the family's
    `AutoModelForSequenceClassification` with one label instead of its ForCausalLM. The decoder is read from the
    causal-LM checkpoint (its `lm_head` left out); the `score` head is new, initialised as transformers does
    (normal, std `initializer_range`) from a generator keyed on `train.seed`, the same on every layout and load
    path. The export is then a standard sequence-classification folder (`spindle.export.transformers.
    classification_config`: num_labels 1, architectures, pad_token_id)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def model_cls(self, config: Any) -> Any:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification._model_mapping[type(config)]

    def config(self, config: Any, pad_token_id: int) -> Any:
        from spindle.export.transformers import classification_config

        return classification_config(config, self.model_cls(config), pad_token_id)

    def sources(self, sources: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's tensors the classification model reads: all but the language-model head."""
        return {k: v for k, v in sources.items() if not k.startswith("lm_head.")}

    @staticmethod
    def is_fresh(name: str) -> bool:
        return name.split(".")[0] == SCORE_HEAD

    def export(self, config: Any, state: dict[str, torch.Tensor]) -> Any:
        """What a LoRA run's export writes beside the adapters (`spindle.export.peft.TrainedHead`): the trained
        head's tensors (PEFT's `modules_to_save`, task SEQ_CLS) and the classification config a merged folder
        is loaded with."""
        from spindle.export.peft import TrainedHead

        tensors = {k: v for k, v in state.items() if self.is_fresh(k)}
        return TrainedHead(SCORE_HEAD, tensors, config, "SEQ_CLS")

    def init(self, model: torch.nn.Module) -> None:
        from spindle.distributed.sharded_load import local_region

        weight = getattr(model, SCORE_HEAD).weight
        std = float(model.config.get_text_config().initializer_range)  # type: ignore[operator, union-attr]
        generator = torch.Generator().manual_seed(self.seed)
        full = torch.empty(tuple(weight.shape)).normal_(0.0, std, generator=generator)
        local, region = local_region(weight)
        with torch.no_grad():
            local.copy_(full[region])


class Reward(Objective):
    """`train.objective: reward`: a reward model (a scalar head) trained with the Bradley-Terry loss above on
    preference pairs (`reward:` settings), as `trl.RewardTrainer` trains one.

    Model: the task builds its `ScoreHead` model (the family's ForSequenceClassification, num_labels 1) from the
    causal-LM checkpoint (a vision-language family's: from its ForConditionalGeneration checkpoint, where
    transformers defines such a class for its model_type, `classification_refused`). Data: `data.path` holds
    preference lines in TRL's formats (`spindle.data.preference.reward_pairs`: whole prompt + completion sequences,
    a pair longer than `data.seq_len` dropped; a VLM's prompts may carry images, `task.preference_inputs`),
    optionally a "margin" column; batched B chosen then B rejected rows, right-padded, scored with the task's
    `scoring_inputs` (the attention mask; a VLM's positions and media inputs). Each row's score is the head's output at
    its last token that is not padding (transformers' own pooling, the one the exported folder scores with). The
    loss unit is the pair: the trainer divides the summed pair losses by the global batch's pairs."""

    name = "reward"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.settings = cfg.reward
        self.stats: Any = None

    def head(self) -> ScoreHead:
        return ScoreHead(self.cfg.train.seed)

    def check_plan(self, family: Any, dims: Any) -> None:
        from spindle.config import ConfigError

        why = classification_refused(family, self.cfg.model.path)
        if why is not None:
            raise ConfigError(
                f"train.objective=reward: {family.name} ({family.kind}) models get no reward model: {why}; reward "
                "models train on text causal-LM families and on the vision-language families with a transformers "
                "ForSequenceClassification (e.g. gemma3_vl, qwen3_5)"
            )
        if family.kind == "vlm" and dims.sp > 1:
            raise ConfigError(
                f"parallel.sp={dims.sp}: train.objective=reward on a vision-language model ({family.name}) does not "
                "run under Ulysses SP: its images are embedded into the whole row before the language model's chunk "
                "is cut, and the sequence-classification head pools each row at its last token of the whole row, "
                "which a rank's chunk of the scores does not hold; set parallel.sp: 1 (dp_shard scales it)"
            )

    def build_loader(self, task: Any) -> Any:
        from functools import partial

        from spindle.data.preference import collate_reward_pairs, reward_pairs
        from spindle.train.tasks.base import resumable_loader

        data = self.cfg.data
        inputs = task.preference_inputs()  # text, or images in the prompts (vision-language families)
        pairs, self.stats = reward_pairs(data.path, task.tokenizer, data.seq_len, inputs.tokenize)
        task._data_stats = {"rows": len(pairs), "pairs": len(pairs)}
        # text: TRL's reward batch; media in the prompts: DPO's batch of the same rows (with each row's positions
        # and the media inputs), which the scoring forward reads as `task.scoring_inputs`
        rows = collate_reward_pairs if inputs.tokenize is None else inputs.collate
        # under SP each rank holds an equal chunk of every row: batches padded to a multiple of parallel.sp
        collate = partial(rows, pad_id=task.pad_token_id(), multiple=task.mesh.dims.sp)
        return resumable_loader(task, pairs, collate)

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0]) // 2  # pairs

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepOutput:
        from spindle.contracts.task import Metric

        ids = batch["input_ids"].to(task.device)
        if task.mesh.dims.sp > 1:
            scores = sequence_parallel_scores(task, model, ids)
        else:
            inputs = task.scoring_inputs(batch)  # the attention mask; a VLM's positions and media inputs too
            with task._autocast():
                out = model(input_ids=ids, **inputs, use_cache=False)
            scores = out.logits[:, 0]
        chosen, rejected = scores.float().chunk(2)
        margin = batch.get("margin") if self.settings.use_margin else None
        loss = reward_loss(
            chosen,
            rejected,
            None if margin is None else margin.to(task.device),
            self.settings.center_rewards_coefficient,
        )
        metrics: dict[str, Any] = {k: Metric(v, "mean", "mean") for k, v in loss.metrics().items()}
        # every SP rank computed the whole pairs' loss; the trainer sums the loss over them (a token loss's chunks)
        return StepOutput(loss.pair_losses.sum() / task.mesh.dims.sp, loss.pairs, int(ids.numel()), metrics)


def classification_refused(family: Any, path: str) -> str | None:
    """Why the `family` checkpoint at `path` gets no reward model (None: it gets one). A text causal-LM family's
    ForSequenceClassification is the reward model. A multimodal checkpoint needs transformers' own
    ForSequenceClassification of its model_type, which takes the media inputs (Gemma 3's
    `Gemma3ForSequenceClassification`, Qwen3.5's `Qwen3_5ForSequenceClassification`), else no standard export
    exists: most have none (the Qwen-VL, Qwen3.5-MoE and Qwen-Omni models in transformers 5.23). An omni family
    trains its thinker, a sub-model, so a classification head over the whole checkpoint does not fit it."""
    import json
    from pathlib import Path

    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES

    if family.kind == "causal_lm":
        return None
    if family.kind not in ("vlm", "omni"):
        return "reward models score text"
    config = Path(path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if CLASSES.get(model_type or "") is None:
        return f"transformers defines no ForSequenceClassification for model_type {model_type!r}"
    if family.kind == "omni":
        return "an omni model trains its thinker, which has no sequence-classification class of its own"
    return None


def last_scored_token(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """[B] the position whose score is each row's: the rightmost token that is not padding, transformers'
    sequence-classification pooling (the rule the exported folder scores with)."""
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def sequence_parallel_scores(task: Any, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Collective under Ulysses SP: each row's score [B] on every SP rank. Each rank runs its chunk of the rows
    (causal attention over right padding, so no mask) through the model, whose pooling scores the chunk's rightmost
    token that is not padding: on the rank holding the row's last scored token (`last_scored_token` of the whole
    row) that is the row's own, since only padding follows it. That rank's score goes to every rank by a
    differentiable all-reduce (the others give 0), so the backward reaches the owner's chunk only, as one process's
    gradient does. (The model's own output is used, not its head's per-position output: FSDP2 unshards the
    weights for the backward from hooks on the model's outputs.)"""
    from spindle.distributed import ulysses_attention
    from spindle.train.objectives.logprobs import sequence_parallel_sum

    sp, rank = task.mesh.dims.sp, task.mesh.sp_rank
    last = last_scored_token(input_ids, model.config.get_text_config().pad_token_id)  # type: ignore[operator, union-attr]
    rows = ulysses_attention.shard_batch({"input_ids": input_ids}, rank, sp)
    with task._autocast():
        out = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False)
    local = out.logits[:, 0]
    mine = (last // rows["input_ids"].shape[1]) == rank
    return sequence_parallel_sum(torch.where(mine, local, torch.zeros_like(local)), task)
