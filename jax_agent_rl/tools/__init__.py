"""Tools: the @tool decorator, stateful tools, the registry and the executor seam.

Tools written for verl import its API (``BaseTool``, ``ToolResponse``, ``function_tool``, ...)
from ``verl.tools.*`` as they do in verl; the verl wing implements it
(`jax_agent_rl.compat.verl.tools`), and its `verl` shim (`jax_agent_rl.compat.verl.shim`) serves
it under verl's names when verl is not installed.
"""

from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.base import (
    FunctionTool,
    Tool,
    ToolArgumentError,
    ToolExecutor,
    ToolResult,
    tool,
)
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry, ToolTransportError
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox, PythonTool
from jax_agent_rl.tools.search import SearchTool

__all__ = [
    "FunctionTool",
    "HttpTools",
    "Limits",
    "LocalTools",
    "PythonSandbox",
    "PythonTool",
    "SearchTool",
    "Tool",
    "ToolArgumentError",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "ToolTransportError",
    "calculator",
    "create_app",
    "tool",
]
