"""Where a harness of the OpenAI endpoint runs (`run_harness`) and when it is stopped
(`held_too_long`, `jax_agent_rl.agent.openai_endpoint`).

A harness is user code, and it reads the policy's text: it may await for ever, loop without
asking, or block its thread (a ``time.sleep``, a synchronous client, code of the model's run
in-process). On the rollout's event loop, one that blocked held every episode and the backend
itself, and nothing on that loop could stop it. So each harness runs in a thread of its own,
in an event loop of its own (a synchronous harness is called there, whole); its requests reach
the endpoint over loopback as ever, and ``run_tool`` runs on the rollout's loop. Stopping it
cancels its tasks in its loop; one that does not end within its grace (a thread blocked in C,
a loop that never awaits) cannot be stopped, only abandoned: its episode ends all the same,
and its thread (a daemon: it does not hold up the interpreter's exit) stays until its call
returns. At most `MAX_STUCK` harness threads may so outlive their episodes at once; past it,
an episode's harness is not started (``harness_error``, its error says why), so a harness that
blocks for good stops the run (every episode failed) rather than leaking a thread per episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from jax_agent_rl.agent.openai_requests import Harness, HarnessTask
from jax_agent_rl.usercode.threads import carried, own_errors

if TYPE_CHECKING:
    from jax_agent_rl.agent.trajectory import StopReason, Trajectory

MAX_STUCK = 32  # harness threads running past their episodes' end, at most (module docstring)


class HarnessThreads:
    """The count of harness threads that outlived their episodes (`MAX_STUCK` at most)."""

    def __init__(self, max_stuck: int) -> None:
        self.max_stuck = max_stuck
        self._lock = threading.Lock()
        self.stuck = 0

    def refuse_if_full(self) -> None:
        with self._lock:
            if self.stuck >= self.max_stuck:
                raise RuntimeError(
                    f"{self.stuck} harness threads are still running past their episodes' end "
                    "(harnesses' or react_agent graphs', blocked: a time.sleep, a synchronous "
                    "call, code that never awaits); no more start until they return"
                )

    def add(self, n: int) -> None:
        with self._lock:
            self.stuck += n


THREADS = HarnessThreads(MAX_STUCK)


class _Bridge:
    """The harness's ``run_tool`` awaited from its own loop and run in the rollout's ``loop``
    (`call`); `cancel_left`, on the rollout's loop, cancels every call still running there at
    once, as the harness ends: cancelled one by one as its loop closes, a call waiting for the
    trajectory's tool slot could take it from a cancelled one and run before its own turn."""

    def __init__(
        self, run_tool: Callable[[dict[str, Any]], Awaitable[str]], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.run_tool, self.loop = run_tool, loop
        self.left: set[asyncio.Task[str]] = set()  # (touched on the rollout's loop only)

    async def _there(self, tool_call: dict[str, Any]) -> str:
        task = asyncio.current_task()
        assert task is not None
        self.left.add(task)
        try:
            return await self.run_tool(tool_call)
        finally:
            self.left.discard(task)

    async def call(self, tool_call: dict[str, Any]) -> str:
        there = self._there(tool_call)
        try:
            future = asyncio.run_coroutine_threadsafe(there, self.loop)
        except RuntimeError:  # the rollout's loop closed
            there.close()
            raise
        return await asyncio.wrap_future(future)

    def cancel_left(self) -> None:
        for task in self.left:
            task.cancel()


def _cancel_all() -> None:
    for task in asyncio.all_tasks():
        task.cancel()


class _Run:
    """One harness's thread: it runs the harness (`work`) and settles ``finished`` on the
    rollout's ``loop``; `stop` asks it to end, counting it in `THREADS` until it does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_end: Callable[[], None]) -> None:
        self.loop, self.own, self.on_end = loop, asyncio.new_event_loop(), on_end
        self.finished: asyncio.Future[None] = loop.create_future()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._ended = self._stuck = False

    def work(self, call: Callable[[], Any]) -> None:
        error: BaseException | None = None
        with asyncio.Runner(loop_factory=lambda: self.own) as runner:
            runner.get_loop()
            asyncio.set_event_loop(self.own)
            try:
                result = call()  # (a synchronous harness runs here, whole)
                if inspect.iscoroutine(result) and self.stopping.is_set():
                    result.close()  # (stopped before it started)
                elif inspect.isawaitable(result) and not self.stopping.is_set():
                    runner.run(_awaited(result))
            except asyncio.CancelledError:
                if not self.stopping.is_set():  # (its own, with no one cancelling it)
                    error = RuntimeError("the harness raised CancelledError")
            except BaseException as e:
                error = carried(e)
            finally:  # (before the runner cancels the tasks it left, one by one)
                with contextlib.suppress(RuntimeError):  # the rollout's loop closed
                    self.loop.call_soon_threadsafe(self.on_end)
        with self._lock:
            self._ended = True
            if self._stuck:
                THREADS.add(-1)
        with contextlib.suppress(RuntimeError):  # the rollout's loop closed meanwhile
            self.loop.call_soon_threadsafe(self._settle, error)

    def stop(self) -> None:
        self.on_end()  # (on the rollout's loop)
        self.stopping.set()
        with contextlib.suppress(RuntimeError):  # (closed: it has ended)
            self.own.call_soon_threadsafe(_cancel_all)
        with self._lock:
            if not self._ended:
                self._stuck = True
                THREADS.add(1)

    def _settle(self, error: BaseException | None) -> None:
        if self.finished.done():
            return
        if error is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(error)


async def _awaited(result: Awaitable[Any]) -> None:
    await own_errors(result)


async def run_harness(harness: Harness, task: HarnessTask) -> None:
    """``harness(task)`` in a thread and event loop of its own (`run_apart`), ``task.run_tool``
    run on this loop."""
    bridge = _Bridge(task.run_tool, asyncio.get_running_loop())
    task = dataclasses.replace(task, run_tool=bridge.call)
    await run_apart(functools.partial(harness, task), bridge.cancel_left)


def _nothing() -> None:
    pass


async def run_apart(call: Callable[[], Any], on_end: Callable[[], None] = _nothing) -> None:
    """``call()`` (a harness, or a ``react_agent`` graph's run, and what it returns awaited) in
    a thread and event loop of its own (see the module docstring); what it raises, raised here
    as `own_errors` makes it. Cancelled, it cancels the call's tasks and waits for its thread
    to end; cancelled again (its grace passed), it leaves the thread running, counted in
    `THREADS` until it ends. ``on_end()`` runs on this loop as the call ends or is stopped,
    before its loop cancels what it left."""
    THREADS.refuse_if_full()
    run = _Run(asyncio.get_running_loop(), on_end)
    threading.Thread(target=run.work, args=(call,), name="jarl-harness", daemon=True).start()
    try:
        await asyncio.shield(run.finished)
    except asyncio.CancelledError:
        run.stop()
        with contextlib.suppress(Exception):  # (cancelled again: abandoned, still counted)
            await asyncio.shield(run.finished)
        raise


async def held_too_long(idle: asyncio.Event, asked: asyncio.Event, timeout_s: float) -> None:
    """Returns once the harness has held its episode ``timeout_s`` on end without a request in
    progress: ``idle`` is set while none is, ``asked`` is set as one starts."""
    while True:
        await idle.wait()
        if not idle.is_set():
            continue  # (a request started before this woke)
        asked.clear()
        try:
            await asyncio.wait_for(asked.wait(), timeout_s)
        except TimeoutError:
            return


class Watched(Protocol):
    """What `nothing_left` watches of an endpoint session (`openai_endpoint.Session`)."""

    ended: asyncio.Event  # its episode ended
    idle: asyncio.Event  # set while no request of the harness is in progress
    asked: asyncio.Event  # set as a request starts
    asked_after_end: asyncio.Event  # a request came after the episode ended
    stop: StopReason | None
    traj: Trajectory


async def nothing_left(
    session: Watched, done: asyncio.Event, timeout_s: float, after_end_s: float
) -> None:
    """Sets ``done`` once the harness has nothing left to do, to cancel it (`run_harness`):
    its episode ended and it asked on (a request answered 409, a ``run_tool`` refused), or it
    ended ``after_end_s`` (``AFTER_END_S``) ago and the harness has not returned (it awaits
    what never comes: a reply it missed, a queue no one fills); the episode keeps how it ended.
    Or the harness held its live episode ``timeout_s`` (``agent.harness_timeout_s``) without a
    request in progress (it awaits for ever, loops without asking, blocks its thread): the
    episode ends there as a harness's failure does, ``harness_error`` before any model turn,
    else ``caused_error``."""
    ended = asyncio.ensure_future(session.ended.wait())
    held = asyncio.ensure_future(held_too_long(session.idle, session.asked, timeout_s))
    try:
        await asyncio.wait({ended, held}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        held.cancel()
    if session.stop is None:
        session.stop = "caused_error" if session.traj.num_turns else "harness_error"
        session.traj.add_error(
            f"the harness held its episode past agent.harness_timeout_s={timeout_s:g}s without "
            "a request (it awaited, looped or blocked its thread): stopped"
        )
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(session.asked_after_end.wait(), after_end_s)
    done.set()
