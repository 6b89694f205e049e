"""The event loop that environments' ``async`` methods run on (`EnvLoop`; the process's:
`ENV_LOOP`), in a thread of its own, apart from the rollout's.

An ``async`` environment method is user code, and may block its thread (a ``time.sleep``, a
synchronous client call with no timeout, inside ``async def``). On the rollout's event loop,
one that blocked held every episode's model turns, tool calls and the backend while it blocked,
and one that never returned hung the run: nothing on a blocked loop can stop it. So every
environment's async calls run on one loop of their own (one loop for all of them, so that the
instance a verl interaction shares across episodes always lives on the same loop), awaited from
the rollout's loop within the environment's timeout (`EnvLoop.run`). That timeout always ends
the call's wait; what a blocked thread runs cannot be stopped: a call that blocks the
environments' loop for good holds it for good, every later async environment call then ends at
its timeout (never started: not the policy's, its error naming the call that holds the loop),
so every episode fails and the run stops with that error rather than hanging.

The loop counts how long each call's synchronous code holds it (each step of its coroutine):
a call that times out while another call held the loop for most of its time is not blamed on
its own action (`EnvCallTimeoutError.blamed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import Any

from jax_agent_rl.usercode.threads import error_text, own_errors

THREAD = "jarl-env-loop"  # the name of the thread that runs the environments' loop


class EnvCallTimeoutError(TimeoutError):
    """A call past its timeout: ``blamed`` when it is its own doing (it held the loop itself,
    or ran with the loop free for it at least half its time), ``why`` says what held it."""

    def __init__(self, blamed: bool, why: str) -> None:
        super().__init__(why)
        self.blamed, self.why = blamed, why


class _Call:
    """One call's state: ``queued`` (the loop has not started it), ``running``, ``ended``, or
    ``given_up`` before it started (it never will)."""

    def __init__(self, name: str, coro: Coroutine[Any, Any, Any], held_before: float) -> None:
        self.name, self.coro, self.held_before = name, coro, held_before
        self.state = "queued"
        self.held_s = 0.0  # how long its own synchronous code held the loop
        self.task: asyncio.Task[Any] | None = None


Outcome = tuple[bool, Any, BaseException | None]  # a call's (cancelled, result, exception)


class _Timed(Coroutine[Any, Any, Any]):
    """``call``'s coroutine, each of its steps counted as the loop's holding (`EnvLoop`); its
    outcome passed to ``ended`` the moment it has one (not once its task's callbacks run,
    which code it left on the loop may hold up)."""

    def __init__(self, call: _Call, owner: EnvLoop, ended: Callable[[Outcome], None]) -> None:
        self.call, self.owner, self.ended = call, owner, ended
        self.inner = own_errors(call.coro)

    def send(self, value: Any) -> Any:
        return self._step(self.inner.send, value)

    def throw(self, typ: Any, val: Any = None, _tb: Any = None) -> Any:
        return self._step(self.inner.throw, typ if val is None else val)

    def _step(self, step: Callable[[Any], Any], arg: Any) -> Any:
        try:
            with self.owner.holding(self.call):
                return step(arg)
        except StopIteration as e:
            self.ended((False, e.value, None))
            raise
        except asyncio.CancelledError:
            raise  # (its task's callback says so)
        except BaseException as e:
            self.ended((False, None, e))
            raise

    def close(self) -> None:
        self.inner.close()

    def __await__(self) -> Generator[Any, None, Any]:  # (the ABC's; a task drives it by send)
        raise TypeError("a _Timed call is run as a task (EnvLoop.run), not awaited")


def _task(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
    """The environments' loop's task factory: a task an environment starts has what it raises
    that is no ``Exception`` made its error (`own_errors`), as its calls' have. A left task's
    ``SystemExit`` or ``KeyboardInterrupt`` was re-raised by asyncio out of ``run_forever``:
    the loop's thread ended, and every later call of every episode timed out against it."""
    if isinstance(coro, _Timed):  # a call's: `own_errors` already
        return asyncio.Task(coro, loop=loop, **kwargs)
    task = asyncio.Task(own_errors(coro), loop=loop, **kwargs)
    task.add_done_callback(_say_error)
    return task


def _say_error(task: asyncio.Task[Any]) -> None:
    """A task's error is said now, on the loop, and taken. Left to asyncio it is logged when
    the task is collected, which may be inside another thread's ``ast.parse`` (formatting a
    traceback parses too, and Python 3.11's parser entered again from within itself raises
    SystemError there: seen under pytest after an environment's task exited)."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        print(
            f"jarl: a task an environment started on its loop raised {error_text(error)}",
            file=sys.stderr,
            flush=True,
        )


class EnvLoop:
    """An event loop in a daemon thread of its own, started at its first call (again in a
    forked child, which has no such thread), running environments' coroutines (`run`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self._held_s = 0.0  # how long calls' synchronous code held the loop, all told
        self._holder: _Call | None = None  # the call whose code runs on the loop now
        self._since = 0.0

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._loop, self._pid = asyncio.new_event_loop(), os.getpid()
                self._holder, self._held_s = None, 0.0
                self._loop.set_task_factory(_task)
                threading.Thread(target=self._loop.run_forever, name=THREAD, daemon=True).start()
            return self._loop

    @contextlib.contextmanager
    def holding(self, call: _Call) -> Iterator[None]:
        with self._lock:
            self._holder, self._since = call, time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                took = time.perf_counter() - self._since
                self._held_s += took
                call.held_s += took
                self._holder = None

    def _held(self, call: _Call | None = None) -> float:
        """Seconds the loop was held up to now: all told, or by ``call``'s code alone."""
        with self._lock:
            so_far = self._held_s if call is None else call.held_s
            holding = self._holder is not None and (call is None or call is self._holder)
            return so_far + (time.perf_counter() - self._since if holding else 0.0)

    def holder(self) -> str:
        """Which call's synchronous code holds the loop now, and since when."""
        with self._lock:
            if self._holder is None:  # (so code of no call's: a task or callback one left)
                return (
                    "no call's code holds it now (a task or callback an environment left "
                    "running may have)"
                )
            held = time.perf_counter() - self._since
            return (
                f"{self._holder.name} has held it for {held:.1f}s (its synchronous code: a "
                "time.sleep or a blocking call inside async def)"
            )

    async def run(self, name: str, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """``coro`` (the call ``name``) run on this loop and awaited here, what it raises raised
        as `own_errors` makes it; past ``timeout_s`` an `EnvCallTimeoutError`: cancelled there,
        given as long again to end, then abandoned (a call never started never starts).
        Cancelled here, it is cancelled there."""
        loop, here = self._started(), asyncio.get_running_loop()
        call = _Call(name, coro, self._held())
        ended: asyncio.Future[Any] = here.create_future()

        def settle(outcome: Outcome) -> None:
            cancelled, value, error = outcome
            if ended.done():
                return
            if cancelled:
                ended.cancel()
            elif error is not None:
                ended.set_exception(error)
            else:
                ended.set_result(value)

        def start() -> None:  # (on this loop)
            with self._lock:
                if call.state != "queued":
                    return
                call.state = "running"
            call.task = loop.create_task(_Timed(call, self, lambda out: _soon(here, settle, out)))
            call.task.add_done_callback(lambda task: _soon(here, settle, _outcome(task)))

        loop.call_soon_threadsafe(start)
        try:
            await asyncio.wait({ended}, timeout=timeout_s)
            if ended.done():
                return ended.result()
            raise self._timed_out(call, timeout_s)
        except asyncio.CancelledError:
            self._give_up(call, loop)
            raise
        except EnvCallTimeoutError:
            if self._give_up(call, loop):
                await asyncio.wait({ended}, timeout=timeout_s)  # (its grace)
            raise
        finally:
            ended.add_done_callback(_read)

    def _timed_out(self, call: _Call, timeout_s: float) -> EnvCallTimeoutError:
        with self._lock:
            state, holds = call.state, self._holder is call
        if state == "queued":
            why = f"the environments' event loop never started it: {self.holder()}"
            return EnvCallTimeoutError(False, why)
        others = self._held() - call.held_before - self._held(call)
        if holds:
            return EnvCallTimeoutError(
                True,
                "it blocks the environments' event loop itself: an async method must not block "
                "(make it synchronous: it then runs in a thread)",
            )
        if others <= timeout_s / 2:
            return EnvCallTimeoutError(True, "it was still running")
        return EnvCallTimeoutError(
            False,
            f"other calls' synchronous code held the environments' event loop for "
            f"{others:.1f}s of it: {self.holder()}",
        )

    def _give_up(self, call: _Call, loop: asyncio.AbstractEventLoop) -> bool:
        """Stops ``call``: one not started never starts (False); a running one is cancelled
        (True: it may be given its grace)."""
        with self._lock:
            queued = call.state == "queued"
            if queued:
                call.state = "given_up"
        if queued:
            call.coro.close()
            return False
        loop.call_soon_threadsafe(lambda: call.task.cancel() if call.task else None)
        return True


def _soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # (the caller's loop closed meanwhile)
        loop.call_soon_threadsafe(fn, *args)


def _outcome(task: asyncio.Task[Any]) -> Outcome:
    """A done task's (cancelled, result, exception), read where it ran."""
    if task.cancelled():
        return True, None, None
    error = task.exception()
    return False, None if error is not None else task.result(), error


def _read(ended: asyncio.Future[Any]) -> None:
    """Reads an abandoned call's outcome, so that asyncio does not report it as never read."""
    if not ended.cancelled():
        ended.exception()


ENV_LOOP = EnvLoop()  # the process's: every Environments' async calls run on it
