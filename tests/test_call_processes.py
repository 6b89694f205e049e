"""The worker processes of `CallProcesses`: what crosses back from a worker that cannot be
pickled, and a worker outliving no parent. The functions called are this module's, loaded in
the workers by name (this module imports nothing heavy). Every wait is bounded, on a state."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.usercode.processes import CallProcesses, raised_in
from tests.processes import children

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 60.0  # how long a worker may take to be gone (a loaded machine reaps slowly)


class UnpicklableError(Exception):
    """An error that pickles, but does not unpickle (its constructor needs two arguments)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def raises_unpicklable() -> None:
    raise UnpicklableError("the scorer", "cannot read the answer")


def returns_a_lock() -> Any:
    return threading.Lock()


def adds(a: int, b: int) -> int:
    return a + b


def load(name: str) -> Any:
    """The loader of this module's function ``name``."""
    return globals()[name]


def _run(pool: CallProcesses, name: str, *args: Any) -> Any:
    return asyncio.run(pool.run(functools.partial(load, name), args, 30.0))


def test_what_does_not_pickle_comes_back_as_an_error_naming_it() -> None:
    """An error that cannot be rebuilt here arrives as a RuntimeError with its type and text,
    raised where the worker's function raised it; a result that cannot be sent, as a
    TypeError; the worker serves on."""
    before = children()
    pool = CallProcesses(1, "test worker")
    try:
        with pytest.raises(RuntimeError, match=r"UnpicklableError: the scorer: cannot read") as e:
            _run(pool, "raises_unpicklable")
        assert raised_in(e.value).name == "raises_unpicklable"
        with pytest.raises(TypeError, match=r"the call returned <class '_thread.lock'>"):
            _run(pool, "returns_a_lock")
        assert _run(pool, "adds", 2, 3) == 5
        assert len(children() - before) == 1  # one worker served every call
    finally:
        pool.close()
    assert children() <= before


# a parent whose worker, stuck in `hangs`, has written its process id to their shared stdout
PARENT = """
import asyncio, functools
from jax_agent_rl.usercode.processes import CallProcesses
from tests.test_call_processes import load
asyncio.run(CallProcesses(1, "orphan").run(functools.partial(load, "hangs"), (), 600.0))
"""


def hangs() -> None:
    print(os.getpid(), flush=True)
    while True:
        pass


def test_a_worker_ends_when_its_parent_is_killed() -> None:
    """A parent killed (SIGKILL: nothing of it runs) while its worker is stuck in a call: the
    worker's lifeline pipe closes, and it ends too (it would otherwise run for good)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        assert _alive(worker)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + BOUND_S
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an orphan's zombie, before init reaps it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_closed_pool_refuses_calls() -> None:
    pool = CallProcesses(1, "test worker")
    pool.close()
    with pytest.raises(RuntimeError, match="test worker: the pool is closed"):
        _run(pool, "adds", 1, 1)


def test_closing_ends_the_calls_in_flight_and_those_waiting() -> None:
    """Closed while a call is stuck in the only worker and another waits for it: both raise
    at once (the stuck one: its worker died), and no worker is left."""
    before = children()
    pool = CallProcesses(1, "test worker")

    async def go() -> list[Any]:
        stuck = asyncio.ensure_future(pool.run(functools.partial(load, "hangs"), (), 600.0))
        waiting = asyncio.ensure_future(pool.run(functools.partial(load, "adds"), (1, 2), 600.0))
        await asyncio.sleep(0)  # each runs to its first wait: the worker's answer, a worker
        pool.close()
        return await asyncio.gather(stuck, waiting, return_exceptions=True)

    stuck, waiting = asyncio.run(go())
    assert isinstance(stuck, RuntimeError) and "died during the call" in str(stuck)
    assert isinstance(waiting, RuntimeError) and "the pool is closed" in str(waiting)
    assert children() <= before
