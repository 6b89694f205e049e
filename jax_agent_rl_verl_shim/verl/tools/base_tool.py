"""``verl.tools.base_tool`` as verl tools import it."""

from jax_agent_rl.tools.verl import BaseTool, OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse"]
