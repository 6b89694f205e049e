"""``verl.utils.reward_score``: verl's rule-based scorers (`jax_agent_rl.compat.verl.rules`),
``default_compute_score`` routing a row by its ``data_source`` as verl does."""

from jax_agent_rl.compat.verl.rules import default_compute_score

__all__ = ["default_compute_score"]
