"""``verl.utils.reward_score.math_dapo``: verl's DAPO rule (``Answer:`` line or ``\\boxed``)."""

from jax_agent_rl.compat.verl.rules import dapo_score as compute_score

__all__ = ["compute_score"]
