"""skyrl-gym environments, unchanged, as `Environment` s (the ``envs`` extra: skyrl-gym 0.4.0).

A row's ``env_class`` names a skyrl-gym environment as SkyRL's generator names it: an id
registered with ``skyrl_gym.register`` (its built-ins: ``gsm8k``, ``gsm8k_multi_turn``,
``aime``, ...; a user's, registered by a module ``env.imports`` imports) or, through
``env.classes``, a class (``module:Class`` or ``path/to/file.py:Class``). The environment is
made as SkyRL makes it, ``make(env_class, env_config=..., extras=...)`` with the row's
columns besides its prompt and env_class (``reward_spec``, ``extra_info``, ``db_id``, ...:
`skyrl_extras`) and ``max_turns`` (``agent.max_turns``) as extras and
``env.config.<env_class>`` as its config. It answers every model turn (``turns="all"``: it
parses the model's actions itself) and owns the episode's reward: the sum of its step rewards.
Its ``init`` may rewrite the prompt; its ``postprocessed_action`` (SkyRL re-tokenizes the
turn with it) is not applied: the trajectory keeps the tokens the model sampled.

Each episode's environment lives in a process of its own (`SkyRLEnvironment`): skyrl-gym runs
what the model writes inside the calling process (``text2sql`` runs its SQL there and renders
whatever rows come back: ``SELECT zeroblob(100000000)`` is an 800M-character observation, 2.5
GB), and Python cannot stop a thread. The process is forked from a forkserver that has
skyrl-gym imported (never from the trainer, which holds JAX) and runs
`jax_agent_rl.usercode.env_process`; it may grow its address space by ``env.memory_limit_mib`` past
what it starts with (``RLIMIT_AS``; a MemoryError the environment catches counts too), is
killed, with what it started, when a call passes ``env.step_timeout_s``, and is reaped when
the episode closes: an environment out of memory or time ends its own episode
(``env_error``), never the trainer. Its answers come back as JSON, at most
`REPLY_MAX_BYTES`, and are checked here.

skyrl-gym's built-ins that run the model's code outside any sandbox (`UNSANDBOXED`) are refused
when a row's env_class finds them in skyrl-gym's registry; naming such a class in
``env.classes`` runs it anyway, at the user's own risk.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

from jax_agent_rl.config import EnvSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, EnvFactory, EnvStep, checked_messages, checked_step
from jax_agent_rl.tokenization import Message
from jax_agent_rl.usercode.env_process import Recipe, serve

# the most bytes one answer of an environment's process may carry back (the loop keeps at most
# agent.max_observation_chars characters of a step's messages; a larger answer is an env_error)
REPLY_MAX_BYTES = 64 << 20
# skyrl-gym built-in entry points that run the model's code outside any sandbox, and how
# (skyrl-gym 0.4.0's registry; its other built-ins, aime, gsm8k, gsm8k_multi_turn, text2sql
# and search, run none: text2sql runs the model's SQL in a transaction it rolls back)
UNSANDBOXED = {
    "skyrl_gym.envs.searchcode.env:SearchCodeEnv": "subprocess.run(['python', '-c', code]) "
    "as the trainer's user, with its network and files",
    "skyrl_gym.envs.lcb.env:LCBEnv": "exec() in a process whose 'reliability_guard' is, in its "
    "own words, not a security sandbox",
}


class SkyRLEnvironment:
    """One skyrl-gym ``Env`` (``init`` / ``step`` / ``close``) in a process of its own (see
    the module docstring), as a synchronous `Environment` (run in threads by the loop)."""

    turns: Literal["all", "text"] = "all"
    owns_reward = True

    def __init__(self, recipe: Recipe, name: str, timeout_s: float, memory_limit_mib: int):
        self.recipe, self.name = recipe, name
        self.timeout_s, self.memory_limit_mib = timeout_s, memory_limit_mib
        self._process: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one call at a time; close kills a call in flight
        self._gone = False  # the process was killed (or died)

    def reset(self, sample: Sample) -> list[Message]:
        with self._lock:  # (a close meanwhile, the loop's after reset took too long, kills it)
            if self._gone:  # (the loop closes an episode whose reset took too long)
                raise EnvError(f"{self.name}.init: the episode was closed before it started")
            ours, theirs = multiprocessing.Pipe()
            context, lifeline, _ = _context()
            args = (theirs, lifeline, self.recipe, self.name, self.memory_limit_mib)
            process = context.Process(target=serve, args=args, daemon=True)
            process.start()
            theirs.close()
            self._process, self._conn = process, ours
        prompt = self._call("init", [dict(m) for m in sample.messages])
        return checked_messages(prompt, f"{self.name}.init", prompt=True)

    def step(self, text: str, messages: list[Message]) -> EnvStep:
        del messages  # a skyrl-gym environment keeps its own state
        return checked_step(self._call("step", text), self.name)

    def close(self) -> None:
        if not self._lock.acquire(blocking=False):  # a call is stuck, or reset is starting
            self._kill()  # the process: the stuck call (or reset's init) then finds it gone
            return
        self._lock.release()
        try:
            if not self._gone and self._process is not None:
                self._call("close", None)
        finally:
            self._kill()  # (before reset: a reset after it finds the episode closed)
            if self._conn is not None:
                self._conn.close()

    def _call(self, what: str, arg: Any) -> Any:
        """``what`` done by the environment's process; an `EnvError` if it fails, takes longer
        than the timeout (the process is killed then) or dies (out of memory)."""
        assert self._conn is not None
        with self._lock:
            if self._gone:  # (killed; or closed while reset started it: it goes now)
                self._kill()
                raise EnvError(f"{self.name}.{what}: its process is gone")
            try:
                self._conn.send((what, arg))
                if not self._conn.poll(self.timeout_s):
                    self._kill()
                    raise EnvError(
                        f"{self.name}.{what} took longer than env.step_timeout_s="
                        f"{self.timeout_s}s: its process was killed"
                    )
                status, out = json.loads(self._conn.recv_bytes(REPLY_MAX_BYTES))
            except (OSError, EOFError, ValueError) as e:
                self._kill()
                raise EnvError(self._death(what, e)) from None
        if status != "ok":
            raise EnvError(out)
        return out

    def _death(self, what: str, e: BaseException) -> str:
        if isinstance(e, OSError) and "bad message length" in str(e):
            return f"{self.name}.{what} answered more than {REPLY_MAX_BYTES} bytes"
        code = self._process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
        return (
            f"{self.name}.{what}: its process died ({how}): out of memory past "
            f"env.memory_limit_mib={self.memory_limit_mib}, or broken"
        )

    def _kill(self) -> None:
        """The process (and what it started: its session) killed and reaped; none started
        later (`_call` refuses)."""
        self._gone = True
        process = self._process  # (None: reset has not started it; its init is then refused)
        if process is None:
            return
        if process.exitcode is None:
            for kill in (os.killpg, os.kill):  # before its setsid, killpg finds no group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(process.pid, signal.SIGKILL)
        process.join()


_CONTEXT_LOCK = threading.Lock()


def _context() -> tuple[Any, Connection, Connection]:
    """`_made_context`, made once: episodes reset in threads, and two threads making it at once
    got two lifelines, one of which (not cached) closed as its caller returned, ending the
    processes started with it mid-episode."""
    with _CONTEXT_LOCK:
        return _made_context()


@functools.cache
def _made_context() -> tuple[Any, Connection, Connection]:
    """The forkserver episodes' processes fork from, with skyrl-gym and omegaconf imported
    once, and the lifeline each of them holds. (Python 3.11's forkserver preloads neither
    ``__main__`` nor the trainer's ``sys.path``: each process imports the main module, as
    multiprocessing's spawn does, and the process side of this adapter,
    `jax_agent_rl.usercode.env_process`, from the trainer's path.)"""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["skyrl_gym", "omegaconf"])
    # every episode's process holds the first end of a pipe; the second, never written to,
    # lives as long as the trainer (in this cache): its end (the trainer's, killed outright
    # too) ends them. (The forkserver runs on while any of its processes does, so their
    # parent's end cannot tell them.)
    return context, *multiprocessing.Pipe(duplex=False)


def skyrl_extras(sample: Sample, max_turns: int) -> dict[str, Any]:
    """The ``extras`` SkyRL's generator passes an environment: the row's columns besides its
    prompt and env_class (its dataset's ``env_extras``: ``reward_spec``, ``extra_info``,
    ``data_source``, ``db_id``, ...), copied, with ``max_turns`` set. A row in verl's layout
    gets ``reward_spec`` from its ground truth (``method: rule``); ``reward_model``, which
    some built-ins read, is ``reward_spec``."""
    extras = copy.deepcopy(sample.columns)
    extras.setdefault("reward_spec", {"method": "rule", "ground_truth": sample.ground_truth})
    extras["reward_model"] = extras["reward_spec"]
    extras["extra_info"] = copy.deepcopy(sample.extra)
    extras["data_source"] = sample.data_source
    extras["max_turns"] = max_turns
    return extras


def skyrl_factory(
    env_class: str, source: str, registered: bool, env: EnvSection, max_turns: int
) -> EnvFactory:
    """Environments of ``env_class``: ``source`` (a registered id, or an ``env.classes``
    spec) made in a process per episode with ``env``'s settings."""

    def factory(sample: Sample) -> SkyRLEnvironment:
        config = dict(env.config.get(env_class, {}))
        recipe = Recipe(
            tuple(env.imports), source, registered, config, skyrl_extras(sample, max_turns)
        )
        return SkyRLEnvironment(recipe, env_class, env.step_timeout_s, env.memory_limit_mib)

    return factory


def registered_skyrl_env(env: EnvSection, max_turns: int) -> Callable[[str], EnvFactory | None]:
    """A lookup of skyrl-gym's registered ids (None when ``name`` is not one, or skyrl-gym is
    not installed; a `KeyError` saying why for a built-in of `UNSANDBOXED`)."""

    def lookup(name: str) -> EnvFactory | None:
        try:
            import skyrl_gym
        except ImportError:
            return None
        if name not in skyrl_gym.registry:
            return None
        why = UNSANDBOXED.get(str(skyrl_gym.registry[name].entry_point))
        if why:
            raise KeyError(
                f"env_class {name!r} refused: skyrl-gym's built-in runs the model's code outside "
                f"any sandbox ({why}); to run it anyway, at your own risk, name its class "
                f"({skyrl_gym.registry[name].entry_point}) in env.classes"
            )
        return skyrl_factory(name, name, True, env, max_turns)

    return lookup
