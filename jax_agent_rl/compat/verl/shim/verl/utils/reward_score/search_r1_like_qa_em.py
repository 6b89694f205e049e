"""``verl.utils.reward_score.search_r1_like_qa_em``: verl's Search-R1 exact-match rule."""

from jax_agent_rl.compat.verl.rules import qa_em_score as compute_score

__all__ = ["compute_score"]
