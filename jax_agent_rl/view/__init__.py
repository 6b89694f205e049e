"""``jarl view``: a run's traces as a self-contained HTML page, token by token, with what the
learner saw (role, rollout logprob, learner-vs-sampler ratio, advantage, staleness)."""

from jax_agent_rl.view.command import serve, write_view
from jax_agent_rl.view.data import run_data
from jax_agent_rl.view.page import render_page

__all__ = ["render_page", "run_data", "serve", "write_view"]
