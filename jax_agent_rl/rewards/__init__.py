"""Reward functions and their registry. A reward function takes the trajectory's final
assistant text and the sample's ground truth and returns a float."""

from collections.abc import Callable
from typing import Any

from jax_agent_rl.rewards.math import extract_answer, format_reward, math_equal, math_reward

RewardFn = Callable[[str, Any], float]

REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "format": lambda text, truth: format_reward(text),
}


def register_reward(name: str, fn: RewardFn) -> None:
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}")
    return REWARDS[name]


__all__ = [
    "REWARDS",
    "RewardFn",
    "extract_answer",
    "format_reward",
    "get_reward",
    "math_equal",
    "math_reward",
    "register_reward",
]
