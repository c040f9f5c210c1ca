"""Rewards for online post-training, one interface for both model kinds: a function in a file or module, a
reward-model folder (language models), an HTTP scorer, or a built-in (JPEG (in)compressibility, CLIP score),
weighted and combined per sample (`load_rewards` -> `RewardSet`)."""

from spindle.train.rewards.combine import Reward, RewardError, RewardScores, RewardSet
from spindle.train.rewards.load import load_rewards

__all__ = [
    "Reward",
    "RewardError",
    "RewardScores",
    "RewardSet",
    "load_rewards",
]
