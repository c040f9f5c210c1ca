"""Diffusion-DPO (Wallace et al. 2023) in its flow-matching form, as pure functions.

A preference pair (chosen, rejected) for one prompt is noised with the same noise and the same sigma;
each member's error is the per-sample mean squared error of the velocity prediction against the
flow-matching target (noise - x0). With the policy's errors e and the reference's e_ref:

    inside = -beta / 2 * ((e_chosen - e_ref_chosen) - (e_rejected - e_ref_rejected))
    loss   = -log sigmoid(inside)

`inside` is the pair's implicit reward margin (the chosen sample's implicit reward -beta/2 * (e - e_ref)
minus the rejected one's); the implicit accuracy is the fraction of pairs where it is positive.

Same noise and sigma for both members: the task draws them from two generators made with the same key
(`pair_generators`), so each member's `training_inputs` draws the same sigma and noise as the other's
(equal latent shapes: the members of a pair share a bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spindle.contracts.task import Objective, StepOutput


@dataclass(frozen=True)
class DiffusionDpoLoss:
    """Per pair ([P]): `loss`; `margin`, the implicit reward margin (the term inside the sigmoid);
    `accurate`, 1.0 where the margin is positive (the implicit accuracy's numerator)."""

    loss: torch.Tensor
    margin: torch.Tensor
    accurate: torch.Tensor


def per_sample_error(pred: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample ([B]) in float32, over the elements `loss_mask` keeps (all without one)."""
    squared = F.mse_loss(pred.float(), target.float(), reduction="none")
    if loss_mask is None:
        return squared.flatten(1).mean(1)
    mask = loss_mask.to(squared).expand_as(squared)
    return (squared * mask).flatten(1).sum(1) / mask.flatten(1).sum(1)


def diffusion_dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DiffusionDpoLoss:
    """The loss of each pair from the per-sample errors ([P] each, `per_sample_error`) of the policy and of
    the reference on the pair's chosen and rejected members (the reference's carry no gradient)."""
    shapes = {tuple(t.shape) for t in (chosen, rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or chosen.ndim != 1:
        raise ValueError(f"the four per-pair errors must be vectors of one length; got shapes {sorted(shapes)}")
    margin = -0.5 * beta * ((chosen - ref_chosen.detach()) - (rejected - ref_rejected.detach()))
    return DiffusionDpoLoss(loss=-F.logsigmoid(margin), margin=margin.detach(), accurate=(margin.detach() > 0).float())


def pair_generators(
    make: Callable[[int, int, int], torch.Generator], seed: int, step: int, pair_indices: Sequence[int]
) -> tuple[list[torch.Generator], list[torch.Generator]]:
    """Two lists of per-sample generators for the chosen and the rejected members, made with the same key
    (seed, step, pair index) by `make` (the trainer's per-sample generator): each member draws the same
    sigma and noise as the other, and any layout draws what one process draws."""
    return [make(seed, step, int(i)) for i in pair_indices], [make(seed, step, int(i)) for i in pair_indices]


def is_edit_family(family: Any) -> bool:
    """An image family whose requests take images: its pairs' "image" is the edit's source(s)."""
    return bool(family.inference_spec().media == "image" and family.options.images[1] > 0)


class DiffusionDPO(Objective):
    """`train.objective: diffusion_dpo` for every DiT family: the loss above as a part of the flow-matching task
    (`diffusion_dpo:` settings).

    Data: `data.path` is a pairs JSONL (`spindle.data.media_pairs`); a micro-batch of P pairs is one media batch
    of the P chosen then the P rejected samples, each carrying its pair's index, so the task's `training_inputs`
    (conditions, per-sample generators keyed on (seed, step, index)) gives both members of a pair the same noise
    and sigma (`pair_generators`' rule) in one forward of 2P samples. The reference is the starting weights: a LoRA
    run's policy with its adapters switched off (no second copy), a full fine-tune's frozen copy of the starting
    transformer sharded like the policy (`FlowMatchingTask.build_reference`); it runs under no_grad on the same
    inputs. The loss unit is the pair: the trainer divides the summed pair losses by the global batch's pairs.
    Metrics (means over pairs): `implicit_accuracy`, the share of pairs whose chosen member the policy prefers
    more than the reference does; `reward_margin`, the mean implicit reward margin (the term inside the sigmoid,
    0 at the start)."""

    name = "diffusion_dpo"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.beta = float(cfg.diffusion_dpo.beta)
        self.reference: torch.nn.Module | None = None  # None: a LoRA run's policy with its adapters off

    def check_plan(self, family: Any, dims: Any) -> None:
        from spindle.config import ConfigError

        data = self.cfg.data
        refused = {
            "data.sources": "give the pairs as one JSONL file in data.path",
            "data.control_dir": 'give each pair its conditioning image as "image" in the pairs file',
        }
        for key, fix in refused.items():
            if getattr(data, key.split(".")[1]):
                raise ConfigError(f"train.objective=diffusion_dpo does not take {key}: {fix}")
        from spindle.data.media_pairs import read_pairs  # every line in the family's form, before launch

        path = Path(data.path).expanduser()
        _, errors = read_pairs(path, is_edit_family(family)) if path.is_file() else ([], [])
        if errors:
            from spindle.data.text import bad_lines_message

            raise ConfigError(bad_lines_message(data.path, errors))

    def check_data(self) -> None:
        from spindle.data.media_pairs import media_pairs

        # with a precomputed cache the media is never decoded (the cache is checked against the pairs when read);
        # read as an edit family's (a list of images allowed: check_plan read each line in the family's form)
        media_pairs(self.cfg.data, self.cfg.train.seed, check=self.cfg.data.precomputed is None, edit=True)

    def prepare(self, task: Any, model: torch.nn.Module) -> None:
        if self.cfg.train.lora is None:  # a full fine-tune: the starting weights, frozen beside the policy
            self.reference = task.build_reference()

    def build_loader(self, task: Any) -> Any:
        from spindle.data.media_pairs import collate_media_pairs, media_pairs
        from spindle.train.tasks.base import resumable_loader

        cfg = self.cfg
        pairs = media_pairs(  # decoded once by check_data
            cfg.data,
            cfg.train.seed,
            check=False,
            grid=lambda: task.family.condition_model_cls().pixel_grid(cfg.model.path),
            global_batch_size=cfg.train.global_batch_size,
            sequence_split=cfg.parallel.sp * cfg.parallel.ring,
            edit=is_edit_family(task.family),
        )
        task._data_stats = pairs.stats
        if cfg.data.precomputed is None:
            return resumable_loader(task, pairs, collate_media_pairs, order=pairs.order)
        from spindle.data.captions import CaptionPolicy
        from spindle.data.media_pairs import CachedPairs, collate_cached_pairs
        from spindle.data.precomputed import CachedConditions, cache_settings
        from spindle.train.tasks.flow_matching import condition_dtype

        settings = cache_settings(
            cfg, task.family.name, condition_dtype(task.precision), task.family.condition_model_cls().encoding_version
        )
        captions = CaptionPolicy(cfg.train.seed, cfg.data.caption_dropout, cfg.data.caption_prefix)
        cached = CachedConditions(cfg.data.precomputed, settings, pairs.members().samples, captions)
        return resumable_loader(task, CachedPairs(cached, len(pairs)), collate_cached_pairs, order=pairs.order)

    def loss_units(self, batch: dict[str, Any]) -> int:
        return len(batch["index"]) // 2  # pairs

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, Any], step: int) -> StepOutput:
        from spindle.contracts.task import Metric

        inputs = task.training_inputs(model, batch, step)
        with task._autocast():
            errors = self._errors(task, model, inputs)
            with torch.no_grad():
                if self.reference is None:
                    from spindle.train.lora import adapters_disabled

                    with adapters_disabled(model):
                        ref_errors = self._errors(task, model, inputs)
                else:
                    ref_errors = self._errors(task, self.reference, inputs)
        (chosen, rejected), (ref_chosen, ref_rejected) = errors.chunk(2), ref_errors.chunk(2)
        out = diffusion_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta)
        metrics = {
            "implicit_accuracy": Metric(out.accurate.mean(), "mean", "mean"),
            "reward_margin": Metric(out.margin.mean(), "mean", "mean"),
        }
        return StepOutput(out.loss.sum(), inputs.samples, inputs.tokens_per_sample * inputs.samples, metrics)

    @staticmethod
    def _errors(task: Any, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        pred = model(**inputs.model_inputs, return_dict=False)[0]
        pred = task.condition.target_prediction(pred, inputs.target)
        return per_sample_error(pred, inputs.target, inputs.loss_mask)
