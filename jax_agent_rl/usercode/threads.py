"""A bounded pool of daemon threads for synchronous calls made from the event loop
(`CallThreads`): environments' synchronous methods (`jax_agent_rl.envs`), tools, and the
built-in reward rules (`jax_agent_rl.rewards`), one pool per use.

A thread stuck inside a call cannot be stopped, only abandoned: the caller's timeout
(``asyncio.wait_for``) cancels the wait, and the thread keeps its place in the pool until the
call returns. So calls stuck for good hold at most ``size`` threads, and once every thread is
held the calls waiting for one time out. (Calls that a policy's text can keep running for
good, reasoning-gym's scorers and users' reward functions, run in worker processes instead,
which can be stopped: `jax_agent_rl.usercode.processes`.) What a call raises reaches its caller; a
`StopIteration`, a ``sys.exit()`` or anything else that is not an `Exception` as a
`RuntimeError` naming it (`carried`); `error_text` writes what a call raised, in one line
that never raises in turn.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


def error_text(error: BaseException) -> str:
    """``Type: message`` of ``error``, also when its ``__str__`` itself fails (a library's
    exception formatting a value it holds): writing what went wrong must not raise in turn."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return f"{type(error).__name__} (its message cannot be written)"


# the key the synchronous calls made in this context count against in a pool with a bound per
# key (`CallThreads`): an executor's tool call sets it to its trajectory's (None: no key)
CALLER: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("CALLER", default=None)


class CallThreads:
    """At most ``size`` threads (named ``name``) running synchronous calls at once, over every
    event loop of the process (daemon threads: one stuck past its timeout does not hold up the
    interpreter's exit). A call waits for a free thread within its own timeout.

    With ``per_key``, the calls made under one key (`CALLER`: a trajectory's tool calls) hold
    at most that many threads at once, those abandoned past their timeout included: a call of
    a key holding as many waits for one of them. A policy's calls that hang a tool for good
    (a query that runs for ever) then hold at most ``per_key`` threads of their episode's,
    where before one episode's turns of such calls held the whole pool, and every sibling's
    call of every synchronous tool timed out waiting for a thread.

    With ``per_kind``, the calls of one kind (`run`'s ``kind``: a tool's name) hold at most that
    many threads at once, abandoned ones included: one tool whose calls take long (a cost that
    grows with its input) across many episodes held the whole pool, and every other tool's
    calls timed out waiting."""

    def __init__(
        self, size: int, name: str, per_key: int | None = None, per_kind: int | None = None
    ) -> None:
        self.size, self.name, self.per_key, self.per_kind = size, name, per_key, per_kind
        self._lock = threading.Lock()
        self._busy = 0
        self._held: collections.Counter[Hashable] = collections.Counter()  # threads by key
        self._kinds: collections.Counter[Hashable] = collections.Counter()  # threads by kind
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def busy(self) -> int:
        """Threads running a call now (those abandoned past their timeout included)."""
        return self._busy

    async def run(self, fn: Callable[..., Any], *args: Any, kind: Hashable = None) -> Any:
        """``fn(*args)`` in a thread of the pool, counted against the key `CALLER` holds and
        its ``kind``; cancelled (timed out), the thread is abandoned and keeps its place until
        ``fn`` returns."""
        loop = asyncio.get_running_loop()
        key = CALLER.get() if self.per_key is not None else None
        kind = kind if self.per_kind is not None else None
        await self._take(loop, key, kind)
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():  # abandoned after its timeout
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def work() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:
                result, error = None, carried(e)
            self._give_back(key, kind)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, result, error)

        try:
            threading.Thread(target=work, name=self.name, daemon=True).start()
        except BaseException:
            self._give_back(key, kind)
            raise
        return await future

    async def _take(
        self, loop: asyncio.AbstractEventLoop, key: Hashable | None, kind: Hashable | None
    ) -> None:
        while True:
            with self._lock:
                mine = self._held[key] if key is not None else 0
                kin = self._kinds[kind] if kind is not None else 0
                if (
                    self._busy < self.size
                    and (self.per_key is None or mine < self.per_key)
                    and (self.per_kind is None or kin < self.per_kind)
                ):
                    self._busy += 1
                    if key is not None:
                        self._held[key] += 1
                    if kind is not None:
                        self._kinds[kind] += 1
                    return
                freed: asyncio.Future[None] = loop.create_future()
                self._waiting.append((loop, freed))
            await freed

    def _give_back(self, key: Hashable | None, kind: Hashable | None) -> None:
        with self._lock:
            self._busy -= 1
            for counter, held in ((self._held, key), (self._kinds, kind)):
                if held is not None:
                    counter[held] -= 1
                    if not counter[held]:
                        del counter[held]
            waiting, self._waiting = self._waiting, []
        for loop, freed in waiting:  # each tries again; those a thread is not freed for wait on
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake, freed)


def carried(error: BaseException) -> BaseException:
    """``error`` as the caller receives it: an `Exception` as it is; a `StopIteration` (which
    a future refuses to hold: the caller would wait out its timeout) or anything that is not an
    `Exception` becomes a `RuntimeError` naming it, with its traceback, as Python turns a
    generator's `StopIteration`. What is not an `Exception` is the call's own doing here: a
    ``sys.exit()`` (which in a thread ends only the thread), a library's timeout that derives
    from `BaseException` (func_timeout's ``FunctionTimedOut``, which a reward or a tool raises
    on an answer it gave up on), a ``KeyboardInterrupt`` or an asyncio ``CancelledError`` it
    raised itself (no signal reaches a worker thread or a worker process's call): as it was,
    it ended the caller's whole run, or cancelled its step."""
    if isinstance(error, Exception) and not isinstance(error, StopIteration):
        return error
    said = error_text(error).removesuffix(": ")  # (its traceback: the cause's)
    carried = RuntimeError(f"the call raised {said}")
    carried.__cause__ = error
    return carried.with_traceback(error.__traceback__)


async def own_errors(call: Awaitable[T]) -> T:
    """``call`` (user code: an async tool, environment method or harness) awaited, what it
    raises that is not an `Exception` made its error as `carried` makes it, but for this
    task's own cancellation (a timeout's too), which passes on. A ``SystemExit`` (argparse
    reading a policy's arguments) or a ``KeyboardInterrupt`` raised in a task ends the event
    loop itself, asyncio re-raising them out of it: the whole run; an asyncio
    `CancelledError` the call raised on its own, with no one cancelling it, cancelled its
    caller, the episode and with it the step."""
    try:
        return await call
    except BaseException as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling() > 0:
            raise
        error = carried(e)  # (an Exception: itself; else a RuntimeError naming it)
    raise error


async def until_set(call: Awaitable[Any], stop: asyncio.Event, grace_s: float) -> None:
    """``call`` awaited until it ends, or, once ``stop`` is set, cancelled: given ``grace_s``
    to end, then abandoned (`abandoned`). What it raises, it raises here; stopped, it raises
    nothing. Cancelled itself, it cancels ``call`` the same way."""
    task = asyncio.ensure_future(call)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=grace_s)
            task.add_done_callback(abandoned)
    if task.done() and not task.cancelled():  # (abandoned past its grace: still running)
        task.result()


def wake(freed: asyncio.Future[None]) -> None:
    if not freed.done():
        freed.set_result(None)


def abandoned(task: asyncio.Future[Any]) -> None:
    """Done-callback of a call given up on (past its timeout, after its cancellation's
    grace): reads its outcome, so that asyncio does not report it as never read."""
    if not task.cancelled():
        task.exception()
