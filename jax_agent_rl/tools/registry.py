"""The tool registry and the executor seam the agent loop calls tools through.

`ToolExecutor` is the seam: `LocalTools` runs a `ToolRegistry` in this process, the HTTP
client (`jax_agent_rl.tools.client`) reaches the same registry served elsewhere; the agent loop
cannot tell them apart. An executor turns every tool-level failure (bad arguments, unknown
tool, an exception, a timeout) into an error `ToolResult` the model reads; only a transport
failure (the tool server is gone) raises `ToolTransportError`, which ends the trajectory with
stop reason ``tool_error``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import logging
import numbers
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from pydantic import ValidationError

from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.console.visible import lone_surrogate
from jax_agent_rl.tools.base import (
    CallClock,
    FunctionTool,
    Tool,
    ToolArgumentError,
    ToolResult,
    validate_arguments,
)
from jax_agent_rl.tools.schemas import OpenAIFunctionToolSchema
from jax_agent_rl.usercode.load import import_named
from jax_agent_rl.usercode.threads import CALLER, abandoned, error_text, own_errors

# a tools file's other formats, by their one top-level key: the function that builds a `Tool`
# from an entry (where, entry); the verl wing registers verl's (``tools:``, `load_wing`)
_FORMATS: dict[str, Callable[[str, Any], Tool]] = {}


def register_tool_format(key: str, build: Callable[[str, Any], Tool]) -> None:
    """Reads a tools file whose one top-level key is ``key`` (a list) with ``build``."""
    _FORMATS[key] = build


_log = logging.getLogger(__name__)


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
        """The tools' schemas, by name; copies (what a caller changes is not the tools')."""
        return [copy.deepcopy(self._tools[n].schema) for n in self.names]

    @classmethod
    def from_yaml(cls, path: str | Path) -> ToolRegistry:
        """A tools file in either of two formats, told apart by its top level:

        - ours, a list of ``{class: "module:attr", config: {...}, schema: {...}}``: ``attr`` is
          a `Tool` instance (``config`` must then be empty; a verl ``@function_tool`` function
          is one) or a `Tool` subclass built with ``config`` as keyword arguments; ``schema``
          optionally replaces its schema (a function tool's names the function's parameters,
          every one it requires among them);
        - verl's, a mapping ``{tools: [{class_name: "pkg.mod.Class", config: {type: native,
          ...}, tool_schema: {...}}]}``: each class is a verl ``BaseTool``, built with
          ``config`` and ``tool_schema`` as verl builds it and run through verl's adapter (the
          verl wing's format, `jax_agent_rl.compat.verl.tools.verl_tool`).

        ``${...}`` interpolations resolve as in verl's loader (OmegaConf). Anything malformed
        is a ValueError naming the file, the entry and the key.
        """
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        if isinstance(data, list):
            return cls(_our_tool(f"{path}: entry {i}", e) for i, e in enumerate(data))
        if isinstance(data, dict) and set(data) == {"tools"} and isinstance(data["tools"], list):
            load_wing("verl")  # verl's format: its wing builds the entries
            build = _FORMATS["tools"]
            return cls(build(f"{path}: tools[{i}]", e) for i, e in enumerate(data["tools"]))
        if data == {}:
            return cls()
        raise ValueError(
            f"{path}: expected a list of tool entries (jax_agent_rl's format) or a mapping with "
            f"only a 'tools' list (verl's format); got {_shape(data)}"
        )


def _shape(data: Any) -> str:
    if isinstance(data, dict) and set(data) == {"tools"}:
        return f"'tools' holding {type(data['tools']).__name__}, not a list"
    return f"a mapping with keys {sorted(data)}" if isinstance(data, dict) else type(data).__name__


def schema_problems(e: ValidationError) -> str:
    """A schema's problems on one line: ``function.description: Field required; ...``."""
    return "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())


def import_attr(where: str, key: str, module: str, attr: str) -> Any:
    try:
        return getattr(import_named(module, f"{where}: {key}"), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: {key}: cannot import {attr!r} from {module!r}: {e}") from e


def entry_mapping(where: str, entry: Any, key: str) -> dict[str, Any]:
    value = entry.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _our_tool(where: str, entry: Any) -> Tool:
    """One entry of our format (see `ToolRegistry.from_yaml`)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - {"class", "config", "schema"})
    if unknown or "class" not in entry:
        raise ValueError(
            f"{where}: keys must be class (required), config, schema; got unknown {unknown}"
        )
    module, _, attr = str(entry["class"]).partition(":")
    if not (module and attr):
        raise ValueError(f"{where}: class must be 'module:attr', got {entry['class']!r}")
    obj = import_attr(where, "class", module, attr)
    config = entry_mapping(where, entry, "config")
    if isinstance(obj, Tool):
        if config:
            raise ValueError(f"{where}: config: {entry['class']} is a tool, not a class to build")
        # a copy to take the schema: the module's instance is every other registry's too (the
        # demo's shortened calculator schema once became the process's calculator schema)
        instance = copy.copy(obj) if "schema" in entry else obj
    else:
        try:
            instance = obj(**config)
        except (TypeError, ValueError) as e:  # a setting it does not take, or out of its range
            raise ValueError(f"{where}: config: {e}") from e
    if "schema" in entry:
        try:
            OpenAIFunctionToolSchema.model_validate(entry["schema"])
        except ValidationError as e:
            raise ValueError(f"{where}: schema: {schema_problems(e)}") from e
        if isinstance(instance, FunctionTool):
            _fits_function(where, instance, entry["schema"])
        instance.schema = entry["schema"]
        instance.name = entry["schema"]["function"]["name"]
    return instance


def _fits_function(where: str, t: FunctionTool, schema: dict[str, Any]) -> None:
    """A function tool's schema override names the function's own parameters, all it
    requires among them: else every call would fail on its arguments, each an error the
    model reads and none the user sees."""
    properties = (schema["function"].get("parameters") or {}).get("properties") or {}
    signature = inspect.signature(t.fn)
    try:
        signature.bind(**dict.fromkeys(properties))
    except TypeError as e:
        raise ValueError(
            f"{where}: schema: its parameters {sorted(properties)} do not fit "
            f"{t.fn.__name__}{signature} ({e})"
        ) from None


def _checked(name: str, result: Any) -> ToolResult:
    """``result`` as plain values (text, a float reward, bool flags), else the call's error
    result: NumPy's ``float32`` reward or ``bool_`` done flag (a tool's comparisons give them)
    does not serialize, and the tool server's answer to a batch of several trajectories' calls
    broke off at one, ending every sibling's episode (tool_error); text holding a lone
    surrogate (``os.listdir``'s undecodable byte) ended its episode in the tokenizer."""
    if not isinstance(result, ToolResult):
        why = f"a {type(result).__name__}, not a ToolResult"
        return ToolResult(f"error: {name} returned {why}", error=True)
    flags = (result.done, result.error)
    if not isinstance(result.text, str):
        why = f"text that is a {type(result.text).__name__}, not a string"
    elif not isinstance(result.reward, (numbers.Real, np.bool_)):
        why = f"a reward that is a {type(result.reward).__name__}, not a number"
    elif not all(isinstance(f, (bool, np.bool_)) for f in flags):
        why = f"done and error flags of types {[type(f).__name__ for f in flags]}, not bools"
    elif (where := lone_surrogate(result.text)) is not None:
        why = f"text holding a lone surrogate {where}: not text"
    else:
        return ToolResult(result.text, float(result.reward), bool(flags[0]), bool(flags[1]))
    return ToolResult(f"error: {name} returned {why}", error=True)


@dataclasses.dataclass
class _Trajectory:
    """One open trajectory: its tools' states (created on first use) and its calls running."""

    states: dict[str, Any] = dataclasses.field(default_factory=dict)
    creating: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    in_flight: int = 0


class LocalTools:
    """A `ToolExecutor` over a registry in this process, with a per-call timeout.

    A call fails (an error result) once it has run ``timeout_s`` seconds, the creation of its
    trajectory's state included (one that ignores its cancellation is abandoned after as long
    again, `_ending`). The time it waits
    its turn for a resource its tool shares (a sandbox pool's worker, `FairPool`) is not
    counted: that wait depends on the other trajectories' calls, not on this call, and the
    pool's turns bound it; one wait past ``max_wait_s`` fails the call all the same, before it
    ran (`CallClock`).

    Trajectory state is bounded for clients that never release it (they crashed, or forgot):

    - ``idle_timeout_s``: a trajectory whose last call ended that many seconds ago (by
      ``clock``) is expired: its state goes through each tool's own ``release``, as on an
      explicit release, and counts in `expired`. A trajectory with a call in flight is never
      expired. Expiry runs at the start of every call and in `expire_idle` (the tool server
      sweeps with it), so it follows ``clock`` alone, never a timer. A trajectory that calls
      again after it expired starts from fresh state, like a new one.
    - ``max_trajectories``: at most this many trajectories hold state at once. A call that
      would open one more, with none idle long enough to expire, gets an error result naming
      the cap, and the trajectory goes on (its next call may find room). Evicting the least
      recently used trajectory instead would silently reset a live trajectory's state (a
      sandbox's files, a counter) mid-rollout, so that the model reads a wrong observation
      that is not marked as an error; a refusal is visible to the model and in metrics. Set
      the cap above the number of trajectories a rollout runs at once.

    ``None`` for either leaves it unbounded (in process, the agent loop always releases).
    """

    def __init__(
        self,
        registry: ToolRegistry,
        timeout_s: float = 30.0,
        idle_timeout_s: float | None = None,
        max_trajectories: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_wait_s: float = 600.0,
    ) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.idle_timeout_s = idle_timeout_s
        self.max_trajectories = max_trajectories
        self.clock = clock
        self._open: dict[str, _Trajectory] = {}
        self._idle_since: dict[str, float] = {}  # no call in flight; oldest first
        self._expired = 0
        self._keys = object()  # (a trajectory's key in a shared pool: with its id, `CALLER`)

    async def schemas(self) -> list[dict[str, Any]]:
        return self.registry.schemas()

    async def call(
        self,
        trajectory_id: str,
        name: str,
        arguments: Any,
        create_kwargs: Mapping[str, Any] | None = None,
    ) -> ToolResult:
        if name not in self.registry:
            # (a name is the model's text: echoed whole, a 1 MB name made a 1 MB answer)
            shown = repr(name) if len(name) <= 100 else f"{name[:100]!r}... ({len(name)} chars)"
            return ToolResult(
                f"error: unknown tool {shown}; available: {self.registry.names}", error=True
            )
        t = self.registry.get(name)
        try:
            args = validate_arguments(t.schema, arguments)
        except ToolArgumentError as e:
            return ToolResult(f"error: bad arguments for {name}: {e}", error=True)
        await self.expire_idle()
        trajectory = self._enter(trajectory_id)
        if trajectory is None:
            return ToolResult(
                f"error: no room for trajectory {trajectory_id!r}: {len(self._open)} "
                f"trajectories already hold tool state (max_trajectories="
                f"{self.max_trajectories}); retry after others end",
                error=True,
            )
        caller = CALLER.set((self._keys, trajectory_id))  # (its synchronous calls' threads)
        try:
            run = self._run(trajectory, trajectory_id, t, create_kwargs or {}, args)
            return _checked(name, await self._timed(t, run))
        except Exception as e:  # a tool bug is the model's observation, not a crash
            # (a lone surrogate in its words, a file name's undecodable byte: written escaped)
            why = error_text(e).encode("utf-8", "backslashreplace").decode("utf-8")
            return ToolResult(f"error: {name} failed: {why}", error=True)
        finally:
            CALLER.reset(caller)
            self._leave(trajectory, trajectory_id)

    async def _run(
        self,
        trajectory: _Trajectory,
        trajectory_id: str,
        t: Tool,
        create_kwargs: Mapping[str, Any],
        args: dict[str, Any],
    ) -> ToolResult:
        """The call: ``t``'s state in ``trajectory`` (`_state`), then its execution."""
        state = await self._state(trajectory, trajectory_id, t, create_kwargs)
        return await t.execute(state, args)

    async def _timed(self, t: Tool, run: Coroutine[Any, Any, ToolResult]) -> ToolResult:
        """``run`` (``t``'s call) under a `CallClock`: past it, the call's error result."""
        clock = CallClock(self.timeout_s, self.max_wait_s)
        try:
            async with clock:
                return await _ending(run, self.timeout_s)
        except TimeoutError:
            if clock.ran_out_waiting:
                return ToolResult(
                    f"error: {t.name} did not run: it waited over {self.max_wait_s:g}s for its "
                    "turn (max_wait_s)",
                    error=True,
                )
            return ToolResult(f"error: {t.name} timed out after {self.timeout_s:g}s", error=True)

    def _enter(self, trajectory_id: str) -> _Trajectory | None:
        """Marks a call in flight, opening the trajectory if there is room (else None)."""
        trajectory = self._open.get(trajectory_id)
        if trajectory is None:
            if self.max_trajectories is not None and len(self._open) >= self.max_trajectories:
                return None
            trajectory = self._open[trajectory_id] = _Trajectory()
        trajectory.in_flight += 1
        self._idle_since.pop(trajectory_id, None)
        return trajectory

    def _leave(self, trajectory: _Trajectory, trajectory_id: str) -> None:
        """Ends a call; the trajectory is idle from now once its last call ends (unless it was
        released meanwhile)."""
        trajectory.in_flight -= 1
        if trajectory.in_flight == 0 and self._open.get(trajectory_id) is trajectory:
            self._idle_since[trajectory_id] = self.clock()

    async def _state(
        self,
        trajectory: _Trajectory,
        trajectory_id: str,
        t: Tool,
        create_kwargs: Mapping[str, Any],
    ) -> Any:
        """``t``'s state in ``trajectory``, created on first use. A trajectory released while
        its state was being created (a client's release crossing its call) has no owner left
        to release that state: it is released here, and the call fails."""
        async with trajectory.creating:
            if t.name not in trajectory.states:
                state = await t.create(trajectory_id, **create_kwargs)
                if self._open.get(trajectory_id) is not trajectory:
                    await t.release(state)
                    raise RuntimeError(
                        f"trajectory {trajectory_id!r} was released while this call created its "
                        "state (released too)"
                    )
                trajectory.states[t.name] = state
            return trajectory.states[t.name]

    async def expire_idle(self) -> None:
        """Releases every trajectory idle for ``idle_timeout_s`` or longer. A tool whose
        release fails is logged; it stops neither the others nor the call that expired it."""
        if self.idle_timeout_s is None:
            return
        expired: list[tuple[str, _Trajectory]] = []
        now = self.clock()
        for trajectory_id, since in self._idle_since.items():  # oldest first
            if now - since < self.idle_timeout_s:
                break
            expired.append((trajectory_id, self._open.pop(trajectory_id)))
        for trajectory_id, _ in expired:
            del self._idle_since[trajectory_id]
        self._expired += len(expired)
        results = await asyncio.gather(
            *(self._release_states(i, trajectory) for i, trajectory in expired),
            return_exceptions=True,
        )
        for failure in results:
            if isinstance(failure, BaseException):
                _log.warning("expiring idle tool state: %s", failure)

    async def release(self, trajectory_id: str) -> None:
        self._idle_since.pop(trajectory_id, None)
        trajectory = self._open.pop(trajectory_id, None)
        if trajectory is not None:
            await self._release_states(trajectory_id, trajectory)

    async def _release_states(self, trajectory_id: str, trajectory: _Trajectory) -> None:
        results = await asyncio.gather(
            *(self.registry.get(n).release(s) for n, s in trajectory.states.items()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"releasing tool state of {trajectory_id} failed: {errors!r}")

    def counters(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        """Releases every trajectory still open, then closes every tool (`Tool.close`); a
        failure stops none of the others and is raised at the end."""
        open_ids = list(self._open)
        released = await asyncio.gather(
            *(self.release(i) for i in open_ids), return_exceptions=True
        )
        tools = [self.registry.get(n) for n in self.registry.names]
        closed = await asyncio.gather(*(t.close() for t in tools), return_exceptions=True)
        errors = [r for r in [*released, *closed] if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"closing the tools failed: {errors!r}")

    @property
    def open_trajectories(self) -> int:
        return len(self._open)

    @property
    def expired(self) -> int:
        """How many trajectories were released for being idle too long."""
        return self._expired


async def _ending(call: Coroutine[Any, Any, ToolResult], grace_s: float) -> ToolResult:
    """``call`` in a task of its own, cancelled with its caller (past its `CallClock`), then
    given ``grace_s`` to end and abandoned if it has not: a tool whose retry loop catches
    every exception, the cancellation too, would otherwise hold its trajectory, and the step,
    for as long as it ran (and its late result would be taken)."""
    task = asyncio.ensure_future(own_errors(call))  # (what it raises: its error)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task}, timeout=grace_s)
        task.add_done_callback(abandoned)
        raise
