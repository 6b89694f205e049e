"""verl's tool API: tools written for verl run here unchanged.

verl (``verl.tools``, checked against its main branch, 0.10.0.dev) declares tools in two
ways; both run here:

- a `BaseTool` subclass listed in verl's tools YAML (``tools: [{class_name: pkg.mod.Class,
  config: {type: native, ...}, tool_schema: {...}}]``), which `ToolRegistry.from_yaml` reads
  beside our own format and wraps in `VerlTool`;
- a plain function decorated with `function_tool`, listed in our YAML format
  (``- class: my_tools:get_weather``; verl instead loads every decorated function of the file
  its ``function_tool_path`` names).

A tool module imports `BaseTool`, `ToolResponse`, `OpenAIFunctionToolSchema` and
`function_tool` from ``verl.tools.*`` unchanged: without verl installed, the `verl` shim
(`jax_agent_rl_verl_shim`) serves these names from here; with verl installed, its own classes
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
(`create_kwargs_by_tool` reads it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from jax_agent_rl.tools.base import FunctionTool, Tool, ToolResult

# ----------------------------------------------------------------------------- verl's API


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


# ----------------------------------------------------------------------------- dataset rows

TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def create_kwargs_by_tool(extra_info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tool's create kwargs from a dataset row's ``extra_info["tools_kwargs"]`` (verl's
    layout: ``{tool name: {"create_kwargs": {...}}}``); {} when the row has none.

    verl's tool agent loop reads ``create_kwargs`` only. The other keys verl's data scripts
    write (``execute_kwargs``, ``calc_reward_kwargs``, ``release_kwargs``) are accepted when
    empty and refused otherwise, since nothing would read them; so is any other key or shape.
    """
    tools_kwargs = extra_info.get("tools_kwargs") or {}
    where = "extra_info.tools_kwargs"
    if not isinstance(tools_kwargs, Mapping):
        raise ValueError(f"{where} must map tool names to dicts, got {type(tools_kwargs).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for tool, entry in tools_kwargs.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}[{tool!r}] must be a dict, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(TOOLS_KWARGS_KEYS))
        if unknown:
            raise ValueError(
                f"{where}[{tool!r}]: unknown key(s) {unknown}; allowed: {TOOLS_KWARGS_KEYS}"
            )
        unread = sorted(k for k in TOOLS_KWARGS_KEYS[1:] if entry.get(k))
        if unread:
            raise ValueError(
                f"{where}[{tool!r}]: {unread} are not read (verl's tool agent loop reads only "
                "create_kwargs); pass what the tool needs in create_kwargs"
            )
        create = entry.get("create_kwargs") or {}
        if not isinstance(create, Mapping):
            raise ValueError(
                f"{where}[{tool!r}]['create_kwargs'] must be a dict, got {type(create).__name__}"
            )
        out[str(tool)] = dict(create)
    return out
