"""The tool registry and the executor seam the agent loop calls tools through.

`ToolExecutor` is the seam: `LocalTools` runs a `ToolRegistry` in this process, the HTTP
client (`jax_agent_rl.tools.server`) reaches the same registry served elsewhere; the agent loop
cannot tell them apart. An executor turns every tool-level failure (bad arguments, unknown
tool, an exception, a timeout) into an error `ToolResult` the model reads; only a transport
failure (the tool server is gone) raises `ToolTransportError`, which ends the trajectory with
stop reason ``tool_error``.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import yaml

from jax_agent_rl.tools.base import Tool, ToolArgumentError, ToolResult, validate_arguments


class ToolTransportError(RuntimeError):
    """The tool service could not be reached; the call's outcome is unknown."""


class ToolRegistry:
    """Tools by name."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, t: Tool) -> None:
        if t.name in self._tools:
            raise ValueError(f"tool {t.name!r} is registered twice")
        self._tools[t.name] = t

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [self._tools[n].schema for n in self.names]

    @classmethod
    def from_yaml(cls, path: str | Path) -> ToolRegistry:
        """A tools file: a list of ``{class: "module:attr", config: {...}, schema: {...}}``.

        ``attr`` is a `Tool` instance (``config`` must then be empty) or a `Tool` subclass
        built with ``config`` as keyword arguments; ``schema`` optionally replaces its schema.
        """
        entries = yaml.safe_load(Path(path).read_text()) or []
        if not isinstance(entries, list):
            raise ValueError(f"{path}: expected a list of tool entries")
        registry = cls()
        for i, entry in enumerate(entries):
            unknown = sorted(set(entry) - {"class", "config", "schema"})
            if unknown or "class" not in entry:
                raise ValueError(
                    f"{path}: entry {i}: keys must be class (required), config, schema; "
                    f"got unknown {unknown}"
                )
            module, _, attr = entry["class"].partition(":")
            obj = getattr(importlib.import_module(module), attr)
            config = entry.get("config") or {}
            if isinstance(obj, Tool):
                if config:
                    raise ValueError(f"{path}: entry {i}: {entry['class']} takes no config")
                instance = obj
            else:
                instance = obj(**config)
            if "schema" in entry:
                instance.schema = entry["schema"]
                instance.name = entry["schema"]["function"]["name"]
            registry.add(instance)
        return registry


class ToolExecutor(Protocol):
    """How the agent loop calls tools: per-trajectory sticky state, always released."""

    async def schemas(self) -> list[dict[str, Any]]: ...

    async def call(self, trajectory_id: str, name: str, arguments: Any) -> ToolResult: ...

    async def release(self, trajectory_id: str) -> None: ...


class LocalTools:
    """A `ToolExecutor` over a registry in this process, with a per-call timeout."""

    def __init__(self, registry: ToolRegistry, timeout_s: float = 30.0) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self._states: dict[str, dict[str, Any]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def schemas(self) -> list[dict[str, Any]]:
        return self.registry.schemas()

    async def call(self, trajectory_id: str, name: str, arguments: Any) -> ToolResult:
        if name not in self.registry:
            return ToolResult(
                f"error: unknown tool {name!r}; available: {self.registry.names}", error=True
            )
        t = self.registry.get(name)
        try:
            args = validate_arguments(t.schema, arguments)
        except ToolArgumentError as e:
            return ToolResult(f"error: bad arguments for {name}: {e}", error=True)
        try:
            state = await self._state(trajectory_id, t)
            return await asyncio.wait_for(t.execute(state, args), self.timeout_s)
        except TimeoutError:
            return ToolResult(f"error: {name} timed out after {self.timeout_s:g}s", error=True)
        except Exception as e:  # a tool bug is the model's observation, not a crash
            return ToolResult(f"error: {name} failed: {type(e).__name__}: {e}", error=True)

    async def _state(self, trajectory_id: str, t: Tool) -> Any:
        lock = self._locks.setdefault(trajectory_id, asyncio.Lock())
        async with lock:
            states = self._states.setdefault(trajectory_id, {})
            if t.name not in states:
                states[t.name] = await t.create(trajectory_id)
            return states[t.name]

    async def release(self, trajectory_id: str) -> None:
        states = self._states.pop(trajectory_id, {})
        self._locks.pop(trajectory_id, None)
        results = await asyncio.gather(
            *(self.registry.get(n).release(s) for n, s in states.items()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"releasing tool state of {trajectory_id} failed: {errors!r}")

    @property
    def open_trajectories(self) -> int:
        return len(self._states)
