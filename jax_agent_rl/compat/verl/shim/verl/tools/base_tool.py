"""``verl.tools.base_tool`` as verl tools import it."""

from jax_agent_rl.compat.verl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse"]
