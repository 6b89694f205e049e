"""Tools: plain functions with a JSON schema from their type hints and docstring, and stateful
tools whose state lives for a whole trajectory.

``@tool`` turns a function (sync or async) into a `FunctionTool`; its schema comes from the
signature (types) and a Google-style docstring (description and ``Args:``). A sync function
runs in a thread of a bounded pool (`TOOL_THREADS`), never on the event loop nor in its default
executor. A stateful `Tool` has ``create`` (once per
trajectory, on first use, with the sample's create kwargs), ``execute`` (per call) and
``release`` (always, also when the trajectory fails); a tool holding resources of its own (a
process pool, a client) frees them in ``close``. Every call returns a `ToolResult`: the text
the model sees, a tool-level reward, whether the tool ends the trajectory, and whether it was
an error.

A tool whose calls share a few resources (a sandbox pool's workers) hands them out with a
`FairPool`: its waiting calls take turns by trajectory, and the time a call waits its turn is
not counted against the call's timeout (`CallClock`, which the executor runs each call under).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextvars
import dataclasses
import functools
import inspect
import re
import threading
import types
import typing
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from jax_agent_rl.usercode.threads import CallThreads

JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str
    reward: float = 0.0
    done: bool = False  # the trajectory ends after this call (stop reason tool_done)
    error: bool = False  # the call failed; the text says why, for the model to read


class ToolArgumentError(ValueError):
    """Arguments that do not fit the tool's schema (the message is shown to the model)."""


class Tool(abc.ABC):
    """One callable tool. A stateful tool overrides ``create`` and ``release``; its state is
    passed to every ``execute`` of the same trajectory."""

    name: str
    schema: dict[str, Any]  # OpenAI-style {"type": "function", "function": {...}}

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> Any:
        """Per-trajectory state, created on the trajectory's first call to this tool.

        ``create_kwargs`` come from the sample: its ``extra_info.tools_kwargs[<tool name>]
        ["create_kwargs"]`` (verl's dataset layout), none when it has none. A tool that takes
        none fails the call (an error the model reads) when a sample gives some.
        """
        del trajectory_id, create_kwargs
        return None

    @abc.abstractmethod
    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult: ...

    async def release(self, state: Any) -> None:
        """Frees the state; called once per trajectory that created it, whatever happened."""
        del state

    async def close(self) -> None:
        """Frees what the tool itself holds (processes, clients); called once, when its
        executor closes, after every trajectory's state was released."""
        return None  # a tool holds nothing by default


class CallClock:
    """The timeout of one tool call, which its executor (`LocalTools`) runs it under: the call
    fails with TimeoutError once it has run ``timeout_s`` seconds, not counting the time it
    waited its turn for a shared resource (`FairPool.acquire` stops the clock while it waits).
    One wait lasts at most ``max_wait_s`` seconds (TimeoutError, with `ran_out_waiting` set):
    no call waits forever, whatever holds the resource."""

    def __init__(self, timeout_s: float, max_wait_s: float) -> None:
        self.timeout_s, self.max_wait_s = timeout_s, max_wait_s
        self.ran_out_waiting = False  # the call timed out waiting its turn, before it ran
        self._timeout = asyncio.timeout_at(None)  # set on entry
        self._waits = 0  # waits in progress (a tool may wait in several tasks at once)
        self._left = timeout_s  # running time left when the clock stopped
        self._token: contextvars.Token[CallClock | None] | None = None

    async def __aenter__(self) -> CallClock:
        await self._timeout.__aenter__()
        self._timeout.reschedule(asyncio.get_running_loop().time() + self.timeout_s)
        self._token = _CLOCK.set(self)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._token is not None
        _CLOCK.reset(self._token)
        self._token = None
        await self._timeout.__aexit__(*exc)  # past the deadline: TimeoutError

    def _running(self) -> bool:
        """Whether the call still runs under this clock (not ended, not timed out)."""
        return self._token is not None and not self._timeout.expired()

    def stop(self) -> None:
        """A wait begins: the running time stops, the wait's bound starts."""
        self._waits += 1
        if self._waits == 1 and self._running():
            now, when = asyncio.get_running_loop().time(), self._timeout.when()
            assert when is not None
            self._left = when - now
            self._timeout.reschedule(now + self.max_wait_s)

    def restart(self) -> None:
        """A wait ends: the running time goes on from where it stopped."""
        self._waits -= 1
        if self._timeout.expired():
            self.ran_out_waiting = True
        elif self._waits == 0 and self._running():
            self._timeout.reschedule(asyncio.get_running_loop().time() + self._left)


# The clock of the tool call running in this context (set by `CallClock`, read by `FairPool`).
_CLOCK: contextvars.ContextVar[CallClock | None] = contextvars.ContextVar("_CLOCK", default=None)

T = TypeVar("T")


class FairPool(Generic[T]):
    """Interchangeable resources (a sandbox pool's workers) shared fairly by keys (one per
    trajectory).

    `acquire` takes a free resource at once when no call waits; otherwise the call waits its
    turn (its `CallClock` stopped meanwhile). A released resource goes to the waiting key that
    holds the fewest, among those to the one served longest ago (then to the one waiting
    longest), and each key's calls are served in their order: the turns go round the keys, so
    a key's backlog of calls delays another key's call by at most one release per resource,
    however many calls it queued first.

    Any event loop may acquire and any thread may release (a tool server's loop and the
    trainer's share a sandbox; a sandbox job's thread releases its worker): the state is
    behind a lock, and a resource goes to a call waiting on another loop through that loop's
    ``call_soon_threadsafe``. One handed to a call that gave up before it took it, or whose loop
    closed, comes back to the pool.
    """

    def __init__(self, items: Iterable[T]) -> None:
        self._lock = threading.Lock()
        self._free = list(items)
        self._queues: dict[Hashable, collections.deque[asyncio.Future[T]]] = {}  # by arrival
        self._held: collections.Counter[Hashable] = collections.Counter()
        self._served: dict[Hashable, int] = {}  # the turn each key was last served at
        self._turns = 0
        # granted to a waiting call, on their way to its loop: waiter -> (its key, the resource)
        self._handed: dict[asyncio.Future[T], tuple[Hashable, T]] = {}

    @property
    def waiting(self) -> int:
        """Calls waiting for a resource."""
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    async def acquire(self, key: Hashable) -> T:
        """A resource for a call of ``key``; give it back with `release`."""
        with self._lock:
            self._reclaim()
            if self._free and not self._queues:
                return self._grant(key, self._free.pop())
            waiter = asyncio.get_running_loop().create_future()
            self._queues.setdefault(key, collections.deque()).append(waiter)
        clock = _CLOCK.get()
        if clock is not None:
            clock.stop()
        try:
            return await waiter  # set by `_hand`, once `release` granted it
        except BaseException:
            with self._lock:
                handed = self._handed.pop(waiter, None)  # granted, not taken yet
                if handed is None and waiter.done() and not waiter.cancelled():
                    handed = (key, waiter.result())  # taken as the call gave up
                if handed is None:
                    self._forget(key, waiter)
            if handed is not None:
                self.release(key, handed[1])
            raise
        finally:
            if clock is not None:
                clock.restart()

    def release(self, key: Hashable, item: T) -> None:
        """Gives back a resource ``key`` acquired: to the next waiting call in turn, if any."""
        with self._lock:
            self._held[key] -= 1
            self._give(item)
            self._prune(key)

    def _give(self, item: T) -> None:
        """Grants ``item`` to the next waiting call in turn whose loop can take it, else frees
        it (the lock held)."""
        while self._queues:
            turn = min(self._queues, key=lambda k: (self._held[k], self._served.get(k, -1)))
            queue = self._queues[turn]
            waiter = queue.popleft()
            if not queue:
                del self._queues[turn]
            loop = waiter.get_loop()
            if not waiter.done() and not loop.is_closed():
                self._handed[waiter] = (turn, self._grant(turn, item))
                try:
                    loop.call_soon_threadsafe(self._hand, waiter)
                    return
                except RuntimeError:  # its loop closed meanwhile
                    del self._handed[waiter]
                    self._held[turn] -= 1
            self._prune(turn)
        self._free.append(item)

    def _hand(self, waiter: asyncio.Future[T]) -> None:
        """On the waiter's loop: the resource granted to it, unless its call gave up first."""
        with self._lock:
            handed = self._handed.pop(waiter, None)
        if handed is None:  # the call gave up, and gave it back
            return
        if waiter.done():  # cancelled after the grant: the call is going, the resource back
            self.release(*handed)
        else:
            waiter.set_result(handed[1])

    def _reclaim(self) -> None:
        """Takes back the resources granted to calls whose loop closed before they took them
        (the lock held)."""
        for waiter, (key, item) in list(self._handed.items()):
            if waiter.get_loop().is_closed():
                del self._handed[waiter]
                self._held[key] -= 1
                self._prune(key)
                self._give(item)

    def _grant(self, key: Hashable, item: T) -> T:
        self._held[key] += 1
        self._turns += 1
        self._served[key] = self._turns
        return item

    def _forget(self, key: Hashable, waiter: asyncio.Future[T]) -> None:
        """Drops a waiter whose call gave up before it was served."""
        queue = self._queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[key]
        self._prune(key)

    def _prune(self, key: Hashable) -> None:
        """Forgets a key that neither holds nor waits (a trajectory that ended)."""
        if self._held[key] <= 0 and key not in self._queues:
            self._held.pop(key, None)
            self._served.pop(key, None)


def validate_arguments(schema: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """Checks arguments against the function schema's parameters; raises ToolArgumentError.

    Each value is checked for its ``type``, ``enum``, an array's ``items`` and an object's
    ``properties`` / ``required`` (nested ones too, named by their path, e.g. ``'opts.mode'``);
    a top-level argument the schema does not name is refused, a nested one only under
    ``additionalProperties: false``."""
    params = schema["function"].get("parameters", {})  # a function without parameters
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    props: dict[str, Any] = params.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolArgumentError(f"unknown argument(s) {unknown}; expected {sorted(props)}")
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        raise ToolArgumentError(f"missing required argument(s) {missing}")
    for name, value in arguments.items():
        _check_value(props[name], value, name)
    return arguments


def _check_value(schema: dict[str, Any], value: Any, where: str) -> None:
    """Raises ToolArgumentError naming ``where`` if ``value`` does not fit ``schema``."""
    want = schema.get("type")
    if want is not None and not _matches(want, value):
        raise ToolArgumentError(
            f"argument {where!r} must be of type {want}, got {type(value).__name__} {value!r}"
        )
    enum = schema.get("enum")
    if enum is not None and not any(_same(value, option) for option in enum):
        raise ToolArgumentError(f"argument {where!r} must be one of {enum}, got {value!r}")
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, dict):
        for i, item in enumerate(value):
            _check_value(items, item, f"{where}[{i}]")
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties", {})
        missing = [p for p in schema.get("required", []) if p not in value]
        if missing:
            raise ToolArgumentError(f"argument {where!r} misses required key(s) {missing}")
        if schema.get("additionalProperties") is False:
            unknown = sorted(set(value) - set(props))
            if unknown:
                raise ToolArgumentError(
                    f"argument {where!r} has unknown key(s) {unknown}; expected {sorted(props)}"
                )
        for key, item in value.items():
            if key in props:
                _check_value(props[key], item, f"{where}.{key}")


def _same(value: Any, option: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, as Python's ``True == 1`` would have it."""
    if isinstance(value, bool) or isinstance(option, bool):
        return value is option
    if isinstance(value, int | float) and isinstance(option, int | float):
        return bool(value == option)
    return type(value) is type(option) and bool(value == option)


def _matches(json_type: str | list[str], value: Any) -> bool:
    if isinstance(json_type, list):
        return any(_matches(t, value) for t in json_type)
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    checks: dict[str, Any] = {
        "string": str,
        "boolean": bool,
        "array": list,
        "object": dict,
        "null": type(None),
    }
    return isinstance(value, checks[json_type]) if json_type in checks else True


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint in JSON_TYPES:
        return {"type": JSON_TYPES[hint]}
    if origin in (list, tuple):
        (item, *_) = typing.get_args(hint) or (Any,)
        return {"type": "array", "items": _json_type(item) if item is not Any else {}}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {**_json_type(type(values[0])), "enum": values}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0])
    raise TypeError(f"type {hint!r} has no JSON schema mapping; use str, int, float, bool, list")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google style: the text before ``Args:`` is the description; ``name: text`` lines after."""
    doc = inspect.cleandoc(doc or "")
    parts = re.split(r"^\s*Args:\s*$", doc, maxsplit=1, flags=re.MULTILINE)
    description = re.split(r"^\s*(Returns|Raises):\s*$", parts[0], flags=re.MULTILINE)[0].strip()
    args: dict[str, str] = {}
    if len(parts) == 2:
        body = re.split(r"^\s*(Returns|Raises):\s*$", parts[1], flags=re.MULTILINE)[0]
        current = None
        for line in body.splitlines():
            m = re.match(r"^\s*(\w+)(?:\s*\(.*?\))?:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """OpenAI-style function schema from type hints and a Google-style docstring."""
    hints = typing.get_type_hints(fn)
    description, arg_docs = _parse_docstring(fn.__doc__ or "")
    properties: dict[str, Any] = {}
    required = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {pname!r} needs a type hint")
        prop = _json_type(hints[pname])
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    if not description:
        raise TypeError(f"tool {fn.__name__}: the docstring must describe the tool")
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# The threads of synchronous function tools, every registry's of the process: a call past its
# timeout is abandoned with its thread (a thread cannot be stopped), which keeps its place
# until the call returns. Calls stuck for good so hold this pool at most, never the event
# loop's default executor, which the learner's steps and the judge wait on; one trajectory's
# calls hold at most TOOL_THREADS_PER_TRAJECTORY of its threads (agent.max_parallel_tool_calls'
# default), abandoned ones included, so that one episode's calls stuck for good never hold
# the threads its siblings' calls wait for (`CallThreads`'s ``per_key``); and one tool's calls
# hold at most TOOL_THREADS_PER_TOOL of them, so the other tools' calls always find a quarter
# (``per_kind``: one tool whose cost grows with its input held all 32 over many episodes).
TOOL_THREADS_PER_TRAJECTORY = 4
TOOL_THREADS_PER_TOOL = 24
TOOL_THREADS = CallThreads(
    32, "tool-call", per_key=TOOL_THREADS_PER_TRAJECTORY, per_kind=TOOL_THREADS_PER_TOOL
)


class FunctionTool(Tool):
    """A stateless tool around one function; its return value becomes the result text (or a
    returned `ToolResult` is used as is). ``schema`` replaces the one inferred from ``fn``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        schema: dict[str, Any] | None = None,
    ) -> None:
        self.fn = fn
        self.schema = schema or function_schema(fn, name)
        self.name = self.schema["function"]["name"]
        self._is_async = inspect.iscoroutinefunction(fn)

    async def call(self, arguments: dict[str, Any]) -> Any:
        """What the function returns for ``arguments`` (a sync one runs in a thread of
        `TOOL_THREADS`)."""
        if self._is_async:
            return await typing.cast(Callable[..., Awaitable[Any]], self.fn)(**arguments)
        call = functools.partial(self.fn, **arguments)
        run = contextvars.copy_context().run  # (as to_thread)
        return await TOOL_THREADS.run(run, call, kind=("tool", self.name))

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del state
        out = await self.call(arguments)
        return out if isinstance(out, ToolResult) else ToolResult(text=str(out))


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: ``@tool`` or ``@tool(name="...")`` makes a `FunctionTool`."""
    if fn is None:
        return lambda f: FunctionTool(f, name)
    return FunctionTool(fn, name)


class ToolExecutor(Protocol):
    """How the agent loop calls tools: per-trajectory sticky state, always released.

    ``create_kwargs`` are the sample's for tool ``name`` (see `Tool.create`); a call passes
    them every time and they are used when the call creates the tool's state for the
    trajectory. ``close`` frees the executor's own resources (clients, the tools' processes)
    once the run is over. ``counters`` are running totals the executor keeps of itself, by
    metric name (Ray's tool servers: restarts, re-sent calls); none for one process or server.
    """

    async def schemas(self) -> list[dict[str, Any]]: ...

    async def call(
        self,
        trajectory_id: str,
        name: str,
        arguments: Any,
        create_kwargs: Mapping[str, Any] | None = None,
    ) -> ToolResult: ...

    async def release(self, trajectory_id: str) -> None: ...

    async def close(self) -> None: ...

    def counters(self) -> dict[str, float]: ...
