"""verl's tool API: tools written for verl run here unchanged.

verl (``verl.tools``, checked against its main branch, 0.10.0.dev) declares tools in two
ways; both run here:

- a `BaseTool` subclass listed in verl's tools YAML (``tools: [{class_name: pkg.mod.Class,
  config: {type: native, ...}, tool_schema: {...}}]``), which `ToolRegistry.from_yaml` reads
  beside our own format (the verl wing registers `verl_tool` as its reader), each wrapped in
  `VerlTool`;
- a plain function decorated with `function_tool`, listed in our YAML format
  (``- class: my_tools:get_weather``; verl instead loads every decorated function of the file
  its ``function_tool_path`` names).

A tool module imports `BaseTool`, `ToolResponse`, `OpenAIFunctionToolSchema` and
`function_tool` from ``verl.tools.*`` unchanged: without verl installed, the `verl` shim
(`jax_agent_rl.compat.verl.shim`) serves these names from here; with verl installed, its own classes
run as well, since `VerlTool` only calls their methods.

`VerlTool` calls a tool as verl's tool agent loop does, with two differences. verl creates an
instance, executes one call and releases it for every call; here the instance lives for the
whole trajectory (created on its first call to the tool, released when it ends), so state
carries from call to call as the ``instance_id`` design intends (verl's gsm8k tool, written for
its older multi-turn rollout, counts on it). And ``execute`` gets no ``agent_data`` (verl's
loop state does not exist here). As in verl, ``create``'s response is not shown to the model,
``execute``'s metrics are dropped and ``calc_reward`` is never called by the loop (a tool calls
it from ``execute``, as verl's own tools do).

A sample's create kwargs travel as in verl: ``extra_info.tools_kwargs`` is ``{tool name:
{"create_kwargs": {...}}}`` and reaches that tool's ``create(create_kwargs={...})``
(`jax_agent_rl.tools.row_kwargs.create_kwargs_by_tool` reads it, for every tool).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ValidationError

from jax_agent_rl.tools.base import FunctionTool, Tool, ToolResult
from jax_agent_rl.tools.registry import entry_mapping, import_attr, schema_problems
from jax_agent_rl.tools.schemas import (
    OpenAIFunctionParametersSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
)

# verl's tool API (``verl.tools.base_tool``, ``.schemas``, ``.function_tool``), the schemas too
__all__ = [
    "BaseTool",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "VerlFunctionTool",
    "VerlTool",
    "function_tool",
    "response_text",
    "verl_tool",
]

# ----------------------------------------------------------------------------- verl's API


class OpenAIFunctionParsedSchema(BaseModel):
    """A tool call as parsed from the model's text: the arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A tool call with its arguments decoded."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """The call with its arguments decoded, and whether decoding failed (then the
        arguments are {}: not JSON, or JSON that is not an object)."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A tool call in OpenAI's chat format."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a verl tool returns: text (what the model reads), images or videos (refused here:
    the agent loop is text-only)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


class BaseTool:
    """verl's ``BaseTool``: built with the YAML entry's ``config`` and ``tool_schema``; a
    subclass implements ``execute`` and, for per-trajectory state, ``create`` and ``release``."""

    tool_schema: OpenAIFunctionToolSchema | None = None

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"{type(self).__name__}: no tool_schema in the YAML entry, and "
                "get_openai_tool_schema() gives none"
            )
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The tool's schema; a subclass whose YAML entry has none overrides this."""
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        del kwargs
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        del instance_id, kwargs
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del instance_id, kwargs


def function_tool(
    name: str | Callable[..., Any] | None = None,
    *,
    schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
) -> Any:
    """verl's decorator: ``@function_tool``, ``@function_tool("name")`` or
    ``@function_tool(schema={...})`` makes a `VerlFunctionTool` (still callable as the
    function). The schema comes from the type hints and the Google-style docstring unless
    ``schema`` gives it."""
    if callable(name):
        return VerlFunctionTool(name, None, schema)
    return lambda fn: VerlFunctionTool(fn, name, schema)


# ----------------------------------------------------------------------------- adapters


class VerlBaseTool(Protocol):
    """What `VerlTool` needs of a verl tool (ours or verl's own `BaseTool` subclasses)."""

    name: str
    tool_schema: Any  # an OpenAIFunctionToolSchema (pydantic), ours or verl's

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any: ...

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any: ...

    async def release(self, instance_id: str, **kwargs: Any) -> None: ...


def _schema_dict(schema: Any) -> dict[str, Any]:
    """The schema as the chat template sees it (verl dumps it the same way)."""
    return dict(schema.model_dump(exclude_unset=True, exclude_none=True))


def response_text(response: Any) -> str:
    """The text of what a verl tool returned: a ToolResponse (ours or verl's), a str, or a
    dict (JSON); anything else as ``str``. Images and videos are refused."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return json.dumps(response, ensure_ascii=False)
    if isinstance(response, BaseModel) and {"text", "image", "video"} <= set(
        type(response).model_fields
    ):
        if getattr(response, "image", None) or getattr(response, "video", None):
            raise ValueError("the tool returned images or videos; the agent loop is text-only")
        return str(getattr(response, "text", None) or "")
    return str(response)


class VerlTool(Tool):
    """A verl `BaseTool` (a `VerlBaseTool`) as our `Tool`: its state is the instance id."""

    def __init__(self, tool: VerlBaseTool) -> None:
        self.tool = tool
        self.name = tool.name
        self.schema = _schema_dict(tool.tool_schema)

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> Any:
        """``create(create_kwargs=...)`` as verl's agent loop calls it; returns the instance id
        (verl returns ``(instance_id, ToolResponse)``, verl before 0.5 the id alone)."""
        del trajectory_id
        created = await self.tool.create(create_kwargs=create_kwargs)
        return created[0] if isinstance(created, tuple) else created

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        out = await self.tool.execute(state, arguments)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(
                f"{type(self.tool).__name__}.execute must return (response, reward, metrics), "
                f"got {type(out).__name__}"
            )
        response, reward, _ = out
        return ToolResult(response_text(response), reward=float(reward or 0.0))

    async def release(self, state: Any) -> None:
        await self.tool.release(state)


class VerlFunctionTool(FunctionTool):
    """A function decorated with verl's `function_tool`; its return value is read as verl
    reads it: a ToolResponse, a str, a dict (JSON), or a tuple ``(response, reward)`` /
    ``(response, reward, metrics)`` (metrics dropped)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
    ) -> None:
        given = None
        if schema is not None:
            given = _schema_dict(OpenAIFunctionToolSchema.model_validate(schema))
            tool_name = name or fn.__name__
            if given["function"]["name"] != tool_name:
                raise ValueError(
                    f"function_tool {tool_name!r}: the schema names it "
                    f"{given['function']['name']!r}"
                )
        super().__init__(fn, name, given)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del state
        out = await self.call(arguments)
        if not isinstance(out, tuple):
            return ToolResult(response_text(out))
        if not 1 <= len(out) <= 3:
            raise TypeError(
                f"{self.name} returned a tuple of {len(out)}; expected (response,), "
                "(response, reward) or (response, reward, metrics)"
            )
        reward = out[1] if len(out) > 1 else None
        return ToolResult(response_text(out[0]), reward=float(reward or 0.0))


def verl_tool(where: str, entry: Any) -> Tool:
    """One entry of verl's format (see `ToolRegistry.from_yaml`)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
    if unknown or "class_name" not in entry:
        raise ValueError(
            f"{where}: keys must be class_name (required), config, tool_schema; "
            f"got unknown {unknown}"
        )
    module, _, attr = str(entry["class_name"]).rpartition(".")
    if not module:
        raise ValueError(f"{where}: class_name must be 'pkg.module.Class', got {attr!r}")
    where = f"{where} ({entry['class_name']})"
    config = entry_mapping(where, entry, "config")
    if config.get("type") != "native":
        raise ValueError(
            f"{where}: config.type must be 'native' (verl's MCP tools are not supported), "
            f"got {config.get('type')!r}"
        )
    tool_cls = import_attr(where, "class_name", module, attr)
    raw = entry.get("tool_schema")
    try:
        schema = None if raw is None else OpenAIFunctionToolSchema.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{where}: tool_schema: {schema_problems(e)}") from e
    try:
        return VerlTool(tool_cls(config=config, tool_schema=schema))  # as verl builds it
    except Exception as e:
        e.add_note(f"while building {where}")
        raise
