"""The process side of `jax_agent_rl.envs.skyrl`: what runs in an episode's own process,
making its skyrl-gym environment and answering the trainer's calls.

It is kept out of the ``envs`` package so that the process imports neither that package nor
JAX: the forkserver it forks from has skyrl-gym imported, and the process imports this module
from the trainer's ``sys.path`` (the forkserver's own may find another copy of the package).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

from jax_agent_rl.usercode.load import import_module, load_function
from jax_agent_rl.usercode.threads import carried, error_text

STEP_KEYS = ("observations", "reward", "done", "success")  # what the trainer reads of a step


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an episode's process makes its environment: ``env.imports`` imported, then
    ``source`` (a registered id, or an ``env.classes`` spec) made with ``config`` and
    ``extras`` (pickled to the process: a row's columns may hold NumPy arrays)."""

    imports: tuple[str, ...]
    source: str
    registered: bool
    config: dict[str, Any]
    extras: dict[str, Any]


def serve(
    conn: Connection, lifeline: Connection, recipe: Recipe, name: str, memory_limit_mib: int
) -> None:
    """An episode's process: makes the environment and answers the trainer's calls (init,
    step, close) with JSON ``[status, value]`` until close, or until the trainer is gone (its
    end of ``lifeline`` closed: the process then kills its session, a stuck call and all).
    Its address space may grow by ``memory_limit_mib`` past what it starts with; a call in
    which a `MemoryError` was raised answers an error, even if the environment caught it."""
    os.setsid()  # its own session, so that killing it kills what it starts
    # it may start processes (lcb does, with multiprocessing): forked from it (it holds no
    # JAX), in its session and its memory bound, they go with it
    multiprocessing.current_process().daemon = False
    multiprocessing.set_start_method("fork", force=True)
    threading.Thread(target=_end_with_the_trainer, args=(lifeline,), daemon=True).start()
    start = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = start + (memory_limit_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.settrace(_watch)  # this thread's calls, and those of the threads the environment starts
    threading.settrace(_watch)
    env: Any = None
    while True:
        try:
            what, arg = conn.recv()
        except (EOFError, OSError):
            return
        _OUT_OF_MEMORY.clear()
        try:
            if what == "init":
                env = _made(recipe)
            reply = _answer(what, env, arg, name)
            if _OUT_OF_MEMORY.is_set():  # (skyrl-gym's text2sql catches it: an empty answer)
                raise MemoryError
            answer = json.dumps(["ok", reply], default=_plain).encode()
        except MemoryError:
            answer = json.dumps(
                ["error", f"{name}.{what} ran out of env.memory_limit_mib={memory_limit_mib}"]
            ).encode()
        except RefusedAnswerError as e:
            answer = json.dumps(["error", str(e)]).encode()
        except BaseException as e:  # (what is not an `Exception` too: the environment's own)
            said = error_text(carried(e))  # (func_timeout's: "its process died ... memory")
            answer = json.dumps(["error", f"{name}.{what} raised {said}"]).encode()
        conn.send_bytes(answer)
        if what == "close":
            return


def _end_with_the_trainer(lifeline: Connection) -> None:
    """Waits for the trainer to be gone (nothing is ever sent on ``lifeline``: it ends when the
    trainer does, killed outright too), then kills this process's session."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os.killpg(0, signal.SIGKILL)


class RefusedAnswerError(Exception):
    """An answer of the environment's that is not what skyrl-gym's interface says."""


def _answer(what: str, env: Any, arg: Any, name: str) -> Any:
    """The environment's answer to ``what``, as the trainer checks it (the prompt ``init``
    returns; the keys of a step it reads)."""
    if what == "init":
        out = env.init(arg)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise RefusedAnswerError(
                f"{name}.init returned {type(out).__name__}, not (prompt, info)"
            )
        return out[0]
    if what == "step":
        raw = env.step(arg)
        if not isinstance(raw, Mapping):
            raise RefusedAnswerError(
                f"{name}.step returned {type(raw).__name__}; expected a mapping with "
                "observations, reward, done"
            )
        return {k: raw[k] for k in STEP_KEYS if k in raw}
    if env is not None:
        env.close()
    return None


def _plain(value: Any) -> Any:
    """A NumPy scalar (a reward, a done flag) as the Python value it stands for."""
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


_OUT_OF_MEMORY = threading.Event()  # a MemoryError was raised in this call, caught or not


def _watch(frame: FrameType, event: str, arg: Any) -> Any:
    """A trace function that sees every exception raised in a Python frame (none of its
    lines), so that a MemoryError an environment catches still ends its episode."""
    frame.f_trace_lines = False
    if event == "exception" and issubclass(arg[0], MemoryError):
        _OUT_OF_MEMORY.set()
    return _watch


def _made(recipe: Recipe) -> Any:
    """The environment ``recipe`` says, made in the episode's process."""
    from omegaconf import DictConfig

    for i, spec in enumerate(recipe.imports):
        import_module(spec, f"env.imports[{i}]")
    if recipe.registered:
        import skyrl_gym

        make: Callable[..., Any] = functools.partial(skyrl_gym.make, recipe.source)
    else:
        make = load_function(recipe.source, "env.classes", "class")
    return make(env_config=DictConfig(recipe.config), extras=recipe.extras)
