"""Rewards: built-in answer checkers (math, GSM8K, format), user functions named in the config
(ours or verl's ``compute_score`` signature) and the choice of reward per ``data_source``."""

from jax_agent_rl.rewards.math import (
    extract_answer,
    format_reward,
    gsm8k_answer,
    gsm8k_reward,
    math_equal,
    math_reward,
)
from jax_agent_rl.rewards.registry import REWARDS, RewardFn, ScoreFn, load_reward, make_reward

__all__ = [
    "REWARDS",
    "RewardFn",
    "ScoreFn",
    "extract_answer",
    "format_reward",
    "gsm8k_answer",
    "gsm8k_reward",
    "load_reward",
    "make_reward",
    "math_equal",
    "math_reward",
]
