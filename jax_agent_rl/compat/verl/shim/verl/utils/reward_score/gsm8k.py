"""``verl.utils.reward_score.gsm8k``: verl's GSM8K rule (``#### N``, strict or flexible)."""

from jax_agent_rl.compat.verl.rules import gsm8k_answer as extract_solution
from jax_agent_rl.compat.verl.rules import gsm8k_score as compute_score

__all__ = ["compute_score", "extract_solution"]
