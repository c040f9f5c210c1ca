"""Direct preference optimisation: the per-pair loss from summed completion log-probabilities.

Inputs per pair i: the policy's summed log-probability of the chosen and the rejected completion
(`logprobs.sequence_log_probs`), the reference model's (not for `simpo`), and each completion's token count.
With the log-ratios  c_i = logp(chosen) - ref_logp(chosen),  r_i = logp(rejected) - ref_logp(rejected):

- `sigmoid` (DPO): -(1 - ε) log σ(β (c_i - r_i)) - ε log σ(-β (c_i - r_i)), ε = `label_smoothing` (0: TRL's
  `DPOTrainer` loss_type "sigmoid"; ε > 0: conservative DPO, the form TRL's sigmoid losses take with label
  smoothing, e.g. `CPOTrainer.cpo_loss`);
- `ipo`: ((c_i / n_chosen - r_i / n_rejected) - 1 / (2β))², the log-ratios averaged per completion token as
  TRL's `DPOTrainer` "ipo" does (label smoothing does not apply);
- `simpo` (reference-free): the sigmoid form on the policy's *average* log-probabilities a_i (sum / tokens)
  with the target margin γ: -(1 - ε) log σ(β (a_c - a_r) - γ) - ε log σ(-(β (a_c - a_r) - γ)) (TRL's
  `CPOTrainer` with loss_type "simpo" and cpo_alpha 0).

`rpo_alpha` adds the chosen completions' negative log-likelihood, averaged over their tokens in the batch, times
rpo_alpha (TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]; the RPO paper's term).

Rewards (logged): β·c_i and β·r_i (simpo: β·a_c and β·a_r, as CPO logs them); margin = their difference;
accuracy = the share of pairs whose chosen reward beats the rejected one.

Units, for the trainer's global normalisation: the preference term is a mean over pairs (`pair_loss_sum` over
`pairs`); the NLL term is a mean over chosen completion tokens (`nll_sum` over `nll_tokens`). `loss` is both
normalised on this batch alone: TRL's loss for the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from spindle.contracts.task import Objective, StepOutput

log = logging.getLogger("spindle")

DPOLossType = Literal["sigmoid", "ipo", "simpo"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "simpo")


@dataclass
class DPOLoss:
    loss: torch.Tensor  # scalar: mean pair loss + rpo_alpha x mean chosen-token NLL, on this batch
    pair_losses: torch.Tensor  # [B] differentiable per-pair preference loss
    nll_sum: torch.Tensor  # differentiable sum of -log p over the chosen completion tokens (0 without rpo_alpha)
    nll_tokens: torch.Tensor  # chosen completion tokens
    chosen_rewards: torch.Tensor  # [B] detached
    rejected_rewards: torch.Tensor  # [B] detached

    @property
    def pair_loss_sum(self) -> torch.Tensor:
        return self.pair_losses.sum()

    @property
    def pairs(self) -> int:
        return int(self.pair_losses.shape[0])

    def metrics(self) -> dict[str, float]:
        """The batch's means, as TRL logs them: rewards/chosen, rewards/rejected, margin, accuracy."""
        margin = self.chosen_rewards - self.rejected_rewards
        return {
            "rewards/chosen": self.chosen_rewards.mean().item(),
            "rewards/rejected": self.rejected_rewards.mean().item(),
            "margin": margin.mean().item(),
            "accuracy": (margin > 0).float().mean().item(),
        }


def check_dpo_settings(loss_type: str, beta: float, label_smoothing: float, gamma: float) -> None:
    """The settings' own rules (the config validates the same; a direct caller gets the same message)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo.loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"dpo.beta must be > 0; got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo.label_smoothing must be in [0, 0.5); got {label_smoothing}")
    if label_smoothing and loss_type == "ipo":
        raise ValueError("dpo.label_smoothing does not apply to loss_type ipo (a squared loss); set it to 0")
    if gamma and loss_type != "simpo":
        raise ValueError(f"dpo.gamma is simpo's target margin; loss_type {loss_type} does not use it: set it to 0")


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    rpo_alpha: float | None = None,
) -> DPOLoss:
    """The preference loss of B pairs from [B] summed log-probabilities and token counts (module doc)."""
    check_dpo_settings(loss_type, beta, label_smoothing, gamma)
    chosen_n = chosen_tokens.to(chosen_logps.dtype).clamp(min=1.0)
    rejected_n = rejected_tokens.to(rejected_logps.dtype).clamp(min=1.0)
    if loss_type == "simpo":
        chosen_scores, rejected_scores = chosen_logps / chosen_n, rejected_logps / rejected_n
        losses = _smoothed_sigmoid(beta * (chosen_scores - rejected_scores) - gamma, label_smoothing)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"dpo loss_type {loss_type} needs the reference model's log-probabilities")
        chosen_scores = chosen_logps - ref_chosen_logps
        rejected_scores = rejected_logps - ref_rejected_logps
        if loss_type == "sigmoid":
            losses = _smoothed_sigmoid(beta * (chosen_scores - rejected_scores), label_smoothing)
        else:  # ipo: the log-ratios per completion token (TRL's normalisation, confirmed with the IPO authors)
            losses = ((chosen_scores / chosen_n - rejected_scores / rejected_n) - 1 / (2 * beta)) ** 2
    nll_tokens = chosen_tokens.sum()
    nll_sum = -chosen_logps.sum() if rpo_alpha else chosen_logps.new_zeros(())
    loss = losses.mean()
    if rpo_alpha:
        loss = loss + rpo_alpha * nll_sum / nll_tokens.clamp(min=1)
    return DPOLoss(
        loss=loss,
        pair_losses=losses,
        nll_sum=nll_sum,
        nll_tokens=nll_tokens,
        chosen_rewards=(beta * chosen_scores).detach(),
        rejected_rewards=(beta * rejected_scores).detach(),
    )


class DPO(Objective):
    """`train.objective: dpo`: the preference loss above as a part of a language-model task (`dpo:` settings).

    Data: `data.path` holds preference lines in TRL's formats (`spindle.data.preference`), batched B chosen rows
    then B rejected rows, right-padded. Each step runs both through the policy for each completion token's
    log-probability (the task's `run_rows(log_probs=True)`: chunked from hidden states on Spindle's patched
    models), and through the reference under no_grad: `dpo.reference_model` (a frozen copy of that folder, sharded
    like the policy), else the starting policy (a LoRA run: the same model with its adapters switched off, no
    second copy; a full fine-tune: a frozen copy of `model.path`); `simpo` uses none. The loss unit is the pair:
    the trainer divides the summed pair losses by the global batch's pairs, so every layout gives the mean over
    the global batch (TRL's loss when one batch holds the step). A MoE adds `router_aux_loss_coef x` its router
    aux loss per pair, as TRL does when the model outputs router logits. Under Ulysses SP each rank runs its chunk
    of every row; the pairs' log-probabilities are summed over the SP ranks (differentiably), so every rank
    computes the whole pairs' loss and its chunk's share of the gradient."""

    name = "dpo"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.settings = cfg.dpo
        self.reference: tuple[Any, torch.nn.Module] | None = None  # (its task, the frozen copy); None: adapters off
        self._start: torch.nn.Module | None = None  # dpo.precompute_reference: the policy as loaded
        self.stats: Any = None

    def check_plan(self, family: Any, dims: Any) -> None:
        from spindle.config import ConfigError

        if family.kind not in ("causal_lm", "vlm", "omni"):
            raise ConfigError(
                f"train.objective=dpo: {family.name} is a {family.kind} model; DPO trains language, vision-language "
                "and omni families (DiTs: train.objective=diffusion_dpo)"
            )
        if self.settings.reference_model is not None:
            check_same_family(self.settings.reference_model, family)
        if self.settings.precompute_reference:
            check_reference_cache(self.cfg)

    def prepare(self, task: Any, model: torch.nn.Module) -> None:
        if self.settings.loss_type == "simpo":
            return  # reference-free
        if self.settings.precompute_reference:
            self._start = model  # the starting weights, before any restore: build_loader computes from them
            return

        if self.settings.reference_model is not None:
            self.reference = task.build_reference(self.settings.reference_model)
        elif self.cfg.train.lora is None:  # a full fine-tune: the starting weights, frozen beside the policy
            self.reference = task.build_reference(self.cfg.model.path)

    def build_loader(self, task: Any) -> Any:
        from functools import partial

        from spindle.data.preference import preference_pairs
        from spindle.train.tasks.base import resumable_loader

        data = self.cfg.data
        inputs = task.preference_inputs()  # text, or media in the prompts (vision-language / omni families)
        pairs, self.stats = preference_pairs(
            data.path, task.tokenizer, data.seq_len, self.settings.max_prompt_length, inputs.tokenize, inputs.media_ids
        )
        pad = task.tokenizer.pad_token_id if task.tokenizer.pad_token_id is not None else task.tokenizer.eos_token_id
        task._data_stats = {"rows": len(pairs), "pairs": len(pairs)}  # the run summary's epochs count pairs
        # under SP each rank holds an equal chunk of every row: batches padded to a multiple of parallel.sp
        collate = partial(inputs.collate, pad_id=pad, multiple=task.mesh.dims.sp)
        if not self.settings.precompute_reference:
            return resumable_loader(task, pairs, collate)
        table = self._reference_table(task, pairs, collate)
        return resumable_loader(task, list(zip(pairs, table, strict=True)), partial(collate_referenced, collate))

    def _reference_table(self, task: Any, pairs: list[Any], collate: Any) -> torch.Tensor:
        """Collective: every pair's reference log-probabilities [pairs, 2], read from the run's cache or computed
        now (each data-parallel rank a share, gathered) and cached."""
        from spindle.data.reference_cache import cache_path, read_cache, reference_settings, write_cache
        from spindle.distributed.mesh import is_main_process

        path = cache_path(self.cfg)
        if path.is_file():  # check_plan refused a stale one
            if is_main_process():
                log.info("dpo: reference log-probabilities of %d pairs read from %s", len(pairs), path)
            return read_cache(path, len(pairs))
        if self.settings.reference_model is not None:
            reference = task.build_reference(self.settings.reference_model)
        else:  # the starting weights: the policy as loaded (LoRA: its adapters off), before any step or restore
            reference = None if self.cfg.train.lora is not None else (task, self._start)
        assert self._start is not None, "prepare runs before build_loader"
        table = reference_log_prob_table(task, self._start, reference, pairs, collate, self.cfg.train.micro_batch_size)
        del reference  # a dpo.reference_model copy is freed before training starts
        if is_main_process():
            write_cache(path, table, reference_settings(self.cfg))
            log.info("dpo: reference log-probabilities of %d pairs computed and cached in %s", len(pairs), path)
        return table

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0]) // 2  # pairs

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepOutput:
        from spindle.contracts.task import Metric
        from spindle.train.objectives.logprobs import reference_log_probs, sequence_log_probs, sequence_parallel_sum

        s = self.settings
        run = task.run_rows(model, batch, log_probs=True)
        labels = run.rows["shift_labels"]  # under SP: this rank's chunk; the sums below are the whole rows'
        sums, tokens = (sequence_parallel_sum(v, task) for v in sequence_log_probs(run.log_probs, labels))
        ref_chosen = ref_rejected = None
        if "ref_logps" in batch:  # dpo.precompute_reference
            ref_chosen, ref_rejected = batch["ref_logps"].to(sums).chunk(2)
        elif s.loss_type != "simpo":
            with torch.no_grad():
                ref_sums, _ = sequence_log_probs(reference_log_probs(task, model, batch, self.reference), labels)
                ref_sums = sequence_parallel_sum(ref_sums, task)
            ref_chosen, ref_rejected = ref_sums.chunk(2)
        chosen, rejected = sums.chunk(2)
        chosen_n, rejected_n = tokens.chunk(2)
        out = dpo_loss(
            chosen,
            rejected,
            chosen_n,
            rejected_n,
            ref_chosen,
            ref_rejected,
            beta=s.beta,
            loss_type=s.loss_type,
            label_smoothing=s.label_smoothing,
            gamma=s.simpo_gamma if s.loss_type == "simpo" else 0.0,  # simpo without gamma: TRL's 0.5
            rpo_alpha=s.rpo_alpha,
        )
        pairs = out.pairs
        # The trainer divides by the global pairs. The RPO term is the micro-batch's mean chosen-token NLL, as TRL
        # computes it per device batch (a step of several micro-batches averages them, weighted by their pairs).
        loss_sum = out.pair_loss_sum
        if s.rpo_alpha:
            loss_sum = loss_sum + s.rpo_alpha * out.nll_sum / out.nll_tokens.clamp(min=1) * pairs
        metrics: dict[str, Any] = {k: Metric(v, "mean", "mean") for k, v in out.metrics().items()}
        aux = getattr(run.out, "aux_loss", None)
        if aux is not None:
            coef = float(model.config.get_text_config().router_aux_loss_coef)  # type: ignore[operator, union-attr]
            loss_sum = loss_sum + coef * aux.to(loss_sum) * pairs
            metrics.update(task.output_metrics(run.out, run.rows))
        # every SP rank computed the whole pairs' loss; the trainer sums the loss over them (a token loss's chunks)
        loss_sum = loss_sum / task.mesh.dims.sp
        return StepOutput(loss_sum.float(), pairs, run.tokens, metrics)


def check_same_family(path: str, family: Any) -> None:
    """`dpo.reference_model` is a transformers folder of the trained family (its config.json's model_type)."""
    import json
    from pathlib import Path

    from spindle.config import ConfigError

    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"dpo.reference_model: {path} has no config.json; give a transformers model folder")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in family.model_types:
        raise ConfigError(
            f"dpo.reference_model: {path} is a {model_type!r} model, not the trained family's "
            f"({', '.join(family.model_types)}); give a folder of the same family"
        )


def check_reference_cache(cfg: Any) -> None:
    """`dpo.precompute_reference`: a cache already in the run folder must be of this run's data, weights and
    settings (before launch: a stale one is refused naming what changed, never trained against)."""
    from spindle.config import ConfigError
    from spindle.data.reference_cache import cache_path, reference_settings, stale_keys

    path = cache_path(cfg)
    stale = stale_keys(path, reference_settings(cfg))
    if stale:
        raise ConfigError(
            f"dpo.precompute_reference: {path} holds reference log-probabilities computed for another "
            f"{', '.join(stale)}; delete it to compute them again (a full fine-tune's reference is then model.path) "
            "or give a fresh train.output_dir"
        )


def collate_referenced(collate: Any, items: list[tuple[Any, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of (pair, its cached reference log-probabilities [2]): `collate`'s rows plus `ref_logps` [2B],
    the chosen ones then the rejected ones as the rows are."""
    out: dict[str, torch.Tensor] = collate([pair for pair, _ in items])
    table = torch.stack([logps for _, logps in items])
    out["ref_logps"] = torch.cat([table[:, 0], table[:, 1]])
    return out


def reference_log_prob_table(
    task: Any, model: torch.nn.Module, reference: Any, pairs: list[Any], collate: Any, batch_size: int
) -> torch.Tensor:
    """Collective: the reference's summed log-probabilities of every pair's chosen and rejected completion
    [pairs, 2] (`reference` as `logprobs.reference_log_probs` takes it). Data-parallel rank r computes pairs
    r, r + dp, ... in batches of `batch_size` (every rank runs as many forwards: FSDP2 gathers in lockstep), and
    the shares are gathered so every rank holds the whole table."""
    import math

    import torch.distributed as dist

    from spindle.train.objectives.logprobs import reference_run, sequence_log_probs, sequence_parallel_sum

    rank, size = task.mesh.dp_rank, task.mesh.dims.dp_size
    mine = list(range(rank, len(pairs), size))
    forwards = math.ceil(math.ceil(len(pairs) / size) / batch_size)
    padded = mine + [mine[-1] if mine else 0] * (forwards * batch_size - len(mine))
    values: dict[int, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    try:
        for b in range(forwards):
            indices = padded[b * batch_size : (b + 1) * batch_size]
            batch = collate([pairs[i] for i in indices])
            with torch.no_grad():
                run = reference_run(task, model, batch, reference)  # under SP: this rank's chunk of the rows
            sums = sequence_parallel_sum(sequence_log_probs(run.log_probs, run.rows["shift_labels"])[0], task)
            chosen, rejected = sums.float().cpu().chunk(2)
            for i, c, r in zip(indices, chosen.tolist(), rejected.tolist(), strict=True):
                values[i] = (c, r)
    finally:
        model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, values)
        values = {i: v for share in shares for i, v in share.items()}
    return torch.tensor([values[i] for i in range(len(pairs))], dtype=torch.float32)
