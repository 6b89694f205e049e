"""``jarl view``: a run's traces as a self-contained HTML page, token by token, with what the
learner saw (role, rollout logprob, learner-vs-sampler ratio, advantage, staleness)."""

from jax_agent_rl.view.command import add_view_parser, serve, write_view
from jax_agent_rl.view.data import run_data
from jax_agent_rl.view.page import render_page

__all__ = ["add_view_parser", "render_page", "run_data", "serve", "write_view"]
