"""The agent loop and trajectories (tool-call parsers: `jax_agent_rl.tokenization`)."""

from jax_agent_rl.agent.loop import (
    AGENT_LOOPS,
    AgentConfig,
    AgentContext,
    register_agent_loop,
    run_sample,
    run_single_turn,
    run_tool_agent,
)
from jax_agent_rl.agent.trajectory import STOP_REASONS, Sample, StopReason, Trajectory

__all__ = [
    "AGENT_LOOPS",
    "STOP_REASONS",
    "AgentConfig",
    "AgentContext",
    "Sample",
    "StopReason",
    "Trajectory",
    "register_agent_loop",
    "run_sample",
    "run_single_turn",
    "run_tool_agent",
]
