"""Post-training objectives as pure loss functions on log-probability (or score) tensors, one module each.

`dpo` (sigmoid / ipo / simpo preference losses), `reward` (Bradley-Terry loss of a scalar head), `grpo`
(group-relative advantages and the clipped policy objective), and `logprobs` (the per-token log-probabilities
they all start from). Nothing here builds a model, reads data or knows the layout: a training task computes the
tensors and plugs the loss in. Each loss is the one TRL 1.16 computes (tests/train/test_objectives.py compares
them with TRL's own code) and says how it splits into a sum over units, so that the trainer's global
normalisation (`spindle.contracts.task`) gives the same step on every layout.
"""
