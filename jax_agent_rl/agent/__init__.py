"""The agent loop and trajectories (tool-call parsers: `jax_agent_rl.tokenization`; the
sample a loop runs: `jax_agent_rl.data`)."""

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import (
    AGENT_LOOPS,
    register_agent_loop,
    run_sample,
    run_single_turn,
    run_tool_agent,
)
from jax_agent_rl.agent.trajectory import STOP_REASONS, StopReason, Trajectory

__all__ = [
    "AGENT_LOOPS",
    "STOP_REASONS",
    "AgentConfig",
    "AgentContext",
    "Episode",
    "StopReason",
    "Trajectory",
    "register_agent_loop",
    "run_sample",
    "run_single_turn",
    "run_tool_agent",
]
