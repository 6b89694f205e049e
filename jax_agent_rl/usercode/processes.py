"""A bounded pool of worker processes for synchronous calls that a policy's text can keep
running for ever (`CallProcesses`): reasoning-gym's scorers and users' reward functions
(`jax_agent_rl.rewards`). sympy simplifying the derivative of a product of a dozen sines runs
for minutes; in a thread (`jax_agent_rl.usercode.threads`) such a call can only be abandoned, and
enough of them held every thread of the pool for the rest of the run.

A process can be stopped. A call past its timeout kills its worker, and the next call that
finds no idle worker starts one, so calls stuck for good never hold the pool's capacity. Each
worker is a fresh interpreter (``subprocess``: the JAX process is never forked, and
``__main__`` is not imported again), started when a call finds every live worker busy and
fewer than ``size`` of them, then kept for later calls. It sees this process's environment
and import path, with JAX on the CPU (``JAX_PLATFORMS=cpu``: a call that runs JAX code never
claims the accelerator, which the trainer holds). A call names its function by a loader: a
picklable function of no arguments that returns it (a module-level function, or a
`functools.partial` of one), called once per worker before the call's timeout starts, so
what it imports (reasoning-gym: about 1.5 s) is the worker's start-up, bounded by
``START_TIMEOUT_S``, not the call's time.

What a call raises reaches its caller (as `jax_agent_rl.usercode.threads` passes it on: a
`StopIteration`, or what is not an `Exception`, func_timeout's ``FunctionTimedOut`` say, as a
`RuntimeError` naming it: nothing but the call raises in its worker), with the worker's
traceback as a note and its innermost frame kept (`raised_in`); one that cannot be pickled
arrives as a `RuntimeError` with its type and message. A worker leads a process group: killing
it (past a timeout, at `CallProcesses.close`) kills what its calls started too (a reward that
runs the policy's code in a subprocess), and every descendant first: a worker is its
descendants' subreaper, so a process that left its group (``setsid``, a daemon's double fork)
is still found as one; a worker whose parent process is gone ends its descendants and its
group (its lifeline pipe closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from jax_agent_rl.usercode.threads import carried, error_text, wake

# the longest a worker may take to start and load a call's function (interpreter, imports);
# a user's reward module may load a model when imported
START_TIMEOUT_S = 300.0
_WORKER_FRAME = "jarl_worker_frame"  # the attribute of an error raised in a worker
_PR_SET_CHILD_SUBREAPER = 36  # prctl's option (linux/prctl.h)


class CallTimeoutError(TimeoutError):
    """A call past its timeout (its worker killed); not a `TimeoutError` the call raised."""


class CallProcesses:
    """At most ``size`` worker processes (named ``name`` in errors) running synchronous calls,
    one call at a time each, over every event loop of the process. A call waits for an idle
    worker, or starts one, before its timeout starts."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()  # every live worker, busy or idle
        self._idle: list[_Worker] = []
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False

    async def run(
        self,
        load: Callable[[], Callable[..., Any]],
        args: tuple[Any, ...],
        timeout_s: float,
        memory_mib: int | None = None,
    ) -> Any:
        """``load()(*args)`` in a worker (``load()`` once per worker, before the timeout
        starts); past ``timeout_s`` the worker is killed and `CallTimeoutError` raised. With
        ``memory_mib``, the call may grow the worker's address space by at most that much
        (past it, what allocates raises `MemoryError` in the call)."""
        request = pickle.dumps((pickle.dumps(load), args, memory_mib))  # (unpicklable: here)
        worker = await self._take()
        try:
            worker.connection.send_bytes(request)
            outcome = await worker.receive(START_TIMEOUT_S, f"{self.name} did not start")
            if outcome[0] == "started":
                outcome = await worker.receive(timeout_s)
        except BaseException:  # past its timeout, dead, or the caller cancelled: no reuse
            worker.kill()
            raise
        finally:
            self._give_back(worker)
        if outcome[0] == "raised":
            raise _rebuilt(*outcome[1:])
        return outcome[1]

    def close(self) -> None:
        """Kills every worker; calls in flight, those waiting for a worker and later ones
        raise `RuntimeError`."""
        with self._lock:
            self._closed = True
            busy = self._workers.difference(self._idle)
            idle, self._workers, self._idle = self._idle, set(), []
            waiting, self._waiting = self._waiting, []
        for worker in idle:
            worker.kill()
        for worker in busy:  # (its call sees the end of the connection, and closes it)
            worker.stop()
        for loop, freed in waiting:  # each finds the pool closed
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake, freed)

    async def _take(self) -> _Worker:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{self.name}: the pool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._workers) < self.size:
                    worker = _Worker.start()
                    self._workers.add(worker)
                    return worker
                freed: asyncio.Future[None] = loop.create_future()
                self._waiting.append((loop, freed))
            await freed

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if worker.alive and worker in self._workers:
                self._idle.append(worker)
            else:
                self._workers.discard(worker)
            waiting, self._waiting = self._waiting, []
        for loop, freed in waiting:  # each tries again; those no worker is free for wait on
            with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile)
                loop.call_soon_threadsafe(wake, freed)


class _Worker:
    """One worker process: requests and outcomes over ``connection`` (a socket pair); it
    exits when ``lifeline`` (a pipe it reads, never written) closes."""

    def __init__(self, process: subprocess.Popen[bytes], connection: Connection, lifeline: int):
        self.process, self.connection, self.lifeline = process, connection, lifeline
        self.alive = True

    @classmethod
    def start(cls) -> _Worker:
        path = json.dumps([p for p in sys.path if isinstance(p, str)])  # (imports read no other)
        ours, theirs = socket.socketpair()
        life_read, life_write = os.pipe()
        with theirs:
            try:
                fds = (theirs.fileno(), life_read)
                process = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, path, *map(str, fds)],
                    stdin=subprocess.DEVNULL,
                    pass_fds=fds,
                    start_new_session=True,  # its own group: killed with what a call started
                    env=os.environ | {"JAX_PLATFORMS": "cpu"},  # (the accelerator is the trainer's)
                )
            except BaseException:
                ours.close()
                os.close(life_write)
                raise
            finally:
                os.close(life_read)
        return cls(process, Connection(ours.detach()), life_write)

    async def receive(self, timeout_s: float, late: str = "") -> tuple[Any, ...]:
        """The worker's next message, within ``timeout_s``: past it `CallTimeoutError`, or with
        ``late`` given a `RuntimeError` saying so; a `RuntimeError` if the worker died."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        fd = self.connection.fileno()
        loop.add_reader(fd, wake, readable)
        try:
            async with asyncio.timeout(timeout_s):
                await readable
        except TimeoutError:
            if late:
                raise RuntimeError(f"{late} within {timeout_s:g}s") from None
            raise CallTimeoutError(f"no answer within {timeout_s:g}s") from None
        finally:
            loop.remove_reader(fd)
        try:
            message: tuple[Any, ...] = self.connection.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(
                f"the worker process {self.process.pid} died during the call (exit status "
                f"{self.process.returncode})"
            ) from None
        return message

    def stop(self) -> None:
        """Ends the process and every process a call started there (its group, in which
        a reward running the policy's code with ``subprocess`` starts it: that code, left
        running, outlived the worker); its connection stays open, for the call in flight to
        read. (Before it is reaped its id is not reused.)"""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGSTOP)  # (none forks while they go)
            _kill_descendants(self.process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        """Ends the process and closes its connection and lifeline."""
        if not self.alive:
            return
        self.alive = False
        self.stop()
        self.connection.close()
        os.close(self.lifeline)


# a worker's start: this process's import path first (so it finds what this process imports,
# this module included), then `serve` on the socket and the lifeline
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from jax_agent_rl.usercode.processes import serve; serve(int(sys.argv[2]), int(sys.argv[3]))"
)


def serve(channel: int, lifeline: int) -> None:
    """A worker's loop: each request is a pickled (pickled loader, arguments); it answers
    ``("started",)`` once the loader's function is at hand, then ``("returned", value)`` or
    ``("raised", error, innermost frame, traceback text)`` (a loader that raises: that only)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops workers
    # what a call started and left (a daemon, a process that made a session of its own: out of
    # the group) becomes this process's child, not init's, so that `_kill_descendants` finds it
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    connection = Connection(channel)
    loaded: dict[bytes, Callable[..., Any]] = {}
    while True:
        try:
            request = connection.recv_bytes()
        except EOFError:
            return
        outcome = _answer(connection, request, loaded)
        try:
            connection.send(outcome)
        except Exception as e:  # a value that does not pickle (sent as nothing: it raised)
            connection.send(_raised(TypeError(f"the call returned {type(outcome[1])}: {e}")))


def _answer(
    connection: Connection, request: bytes, loaded: dict[bytes, Callable[..., Any]]
) -> tuple[Any, ...]:
    try:
        load, args, memory_mib = pickle.loads(request)
        if load not in loaded:
            loaded[load] = pickle.loads(load)()
        fn = loaded[load]
    except BaseException as e:
        return _raised(e)
    connection.send(("started",))
    try:
        with _address_space(memory_mib):
            result = fn(*args)
    except BaseException as e:
        return _raised(e)
    return ("returned", result)


@contextlib.contextmanager
def _address_space(memory_mib: int | None) -> Iterator[None]:
    """The worker's address space bounded, while it lasts, to ``memory_mib`` MiB past its size
    now (``RLIMIT_AS``; None: unbounded)."""
    if memory_mib is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    now = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    bound = now + (memory_mib << 20)
    unbounded = hard == resource.RLIM_INFINITY
    resource.setrlimit(resource.RLIMIT_AS, (bound if unbounded else min(bound, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _raised(error: BaseException) -> tuple[Any, ...]:
    """The message carrying ``error`` to the parent: the error itself if it pickles both ways,
    else a `RuntimeError` with its text."""
    error = carried(error)
    frames = traceback.extract_tb(error.__traceback__)
    where = (frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(error_text(error))
    return ("raised", error, where, text)


def _rebuilt(error: BaseException, where: tuple[str, int, str] | None, text: str) -> BaseException:
    """A worker's error as raised here: its worker traceback a note, its frame kept."""
    error.add_note(f"(raised in a worker process)\n{text.rstrip()}")
    if where is not None:
        setattr(error, _WORKER_FRAME, traceback.FrameSummary(*where))
    return error


def raised_in(error: BaseException) -> traceback.FrameSummary:
    """Where ``error`` was raised: the innermost frame of its traceback, or, for an error a
    call raised in a worker (`CallProcesses.run`), of the worker's."""
    frame = vars(error).get(_WORKER_FRAME)
    return frame if frame is not None else traceback.extract_tb(error.__traceback__)[-1]


def _exit_with_parent(lifeline: int) -> None:
    """Waits for the lifeline's end (the parent closed it, or is gone), then ends the worker's
    process group: the worker, a call it is running and what that call started."""
    while os.read(lifeline, 1):
        pass
    _kill_descendants(os.getpid())
    os.killpg(0, signal.SIGKILL)


def _kill_descendants(pid: int) -> None:
    """Kills every descendant of ``pid`` (a worker: a subreaper, its orphaned descendants are
    its children), the processes that left its group included, until none is left: a killed
    process's children become the worker's, found by the next look."""
    killed: set[int] = set()
    while True:  # (one killed and not yet dead, in uninterruptible sleep, is not waited on)
        found = set(_descendants(pid)) - killed
        if not found:
            return
        for descendant in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(descendant, signal.SIGKILL)
        killed |= found


def _descendants(pid: int) -> list[int]:
    """The live (not zombie) descendants of ``pid``, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # (gone meanwhile)
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found
