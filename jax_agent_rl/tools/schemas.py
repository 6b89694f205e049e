"""A tool's schema in OpenAI's function format, as verl validates it (pydantic): what a tools
file's ``schema`` override must be, and what verl's tool API (`jax_agent_rl.compat.verl.tools`)
builds its tools with."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class OpenAIFunctionPropertySchema(BaseModel):
    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={})
    )
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool's schema in OpenAI's function format, as verl validates it."""

    type: str
    function: OpenAIFunctionSchema
