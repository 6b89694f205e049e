"""``verl.tools.schemas``: verl's pydantic schemas of tools, tool calls and tool responses."""

from jax_agent_rl.compat.verl.tools import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParametersSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]
