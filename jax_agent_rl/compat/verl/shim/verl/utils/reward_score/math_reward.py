"""``verl.utils.reward_score.math_reward``: verl's MATH (Hendrycks) rule, the last ``\\boxed``."""

from jax_agent_rl.compat.verl.rules import math_score as compute_score

__all__ = ["compute_score"]
