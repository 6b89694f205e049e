"""Tools: the @tool decorator, stateful tools, the registry and the executor seam."""

from jax_agent_rl.tools.base import FunctionTool, Tool, ToolArgumentError, ToolResult, tool
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolExecutor, ToolRegistry, ToolTransportError

__all__ = [
    "FunctionTool",
    "LocalTools",
    "Tool",
    "ToolArgumentError",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "ToolTransportError",
    "calculator",
    "tool",
]
