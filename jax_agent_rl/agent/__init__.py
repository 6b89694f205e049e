"""The agent loop, trajectories and tool-call parsers."""

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import (
    AGENT_LOOPS,
    register_agent_loop,
    run_sample,
    run_single_turn,
    run_tool_agent,
)
from jax_agent_rl.agent.parsers import ParsedCall, ToolCallParser, make_parser, register_parser
from jax_agent_rl.agent.trajectory import STOP_REASONS, StopReason, Trajectory

__all__ = [
    "AGENT_LOOPS",
    "STOP_REASONS",
    "AgentConfig",
    "AgentContext",
    "ParsedCall",
    "StopReason",
    "ToolCallParser",
    "Trajectory",
    "make_parser",
    "register_agent_loop",
    "register_parser",
    "run_sample",
    "run_single_turn",
    "run_tool_agent",
]
