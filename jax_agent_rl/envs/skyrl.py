"""skyrl-gym environments, unchanged, as `Environment` s (the ``envs`` extra: skyrl-gym 0.4.0).

A row's ``env_class`` names a skyrl-gym environment as SkyRL's generator names it: an id
registered with ``skyrl_gym.register`` (its built-ins: ``gsm8k``, ``gsm8k_multi_turn``,
``aime``, ...; a user's, registered by the module ``env.classes`` imports) or, through
``env.classes``, a class (``module:Class`` or ``path/to/file.py:Class``). The environment is
made as SkyRL makes it, ``make(env_class, env_config=..., extras=...)`` with the row's
``reward_spec`` (and ``reward_model``, which some built-ins read), ``extra_info``,
``data_source`` and ``max_turns`` (``agent.max_turns``) as extras and ``env.config.<env_class>``
as its config. It answers every model turn (``turns="all"``: it parses the model's actions
itself) and owns the episode's reward: the sum of its step rewards. Its ``init`` may rewrite the
prompt; its ``postprocessed_action`` (SkyRL re-tokenizes the turn with it) is not applied: the
trajectory keeps the tokens the model sampled.

skyrl-gym environments are synchronous: ``init``, ``step`` and ``close`` run in a thread of their
own, each within ``env.step_timeout_s`` (past it the episode ends with ``env_error``; a thread
stuck inside an environment cannot be stopped, only abandoned: a daemon thread, it does not hold
up the process's exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, EnvFactory, EnvStep, checked_messages, checked_step
from jax_agent_rl.tokenization import Message


class SkyRLEnvironment:
    """One skyrl-gym ``Env`` (``init`` / ``step`` / ``close``) as an `Environment`."""

    turns: Literal["all", "text"] = "all"
    owns_reward = True

    def __init__(self, make: Callable[[], Any], name: str, timeout_s: float) -> None:
        self._make, self.name, self.timeout_s = make, name, timeout_s
        self._env: Any = None

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wait_for(in_daemon_thread(fn, *args), self.timeout_s)
        except TimeoutError as e:
            raise EnvError(f"{self.name}.{what} took longer than {self.timeout_s}s") from e
        except EnvError:
            raise
        except Exception as e:
            raise EnvError(f"{self.name}.{what} raised {type(e).__name__}: {e}") from e

    async def reset(self, sample: Sample) -> list[Message]:
        self._env = await self._call("__init__", self._make)
        out = await self._call("init", self._env.init, [dict(m) for m in sample.messages])
        if not (isinstance(out, tuple) and len(out) == 2):
            raise EnvError(f"{self.name}.init returned {type(out).__name__}, not (prompt, info)")
        return checked_messages(out[0], f"{self.name}.init", prompt=True)

    async def step(self, text: str, messages: list[Message]) -> EnvStep:
        del messages  # a skyrl-gym environment keeps its own state
        return checked_step(await self._call("step", self._env.step, text), self.name)

    async def close(self) -> None:
        if self._env is not None:
            await self._call("close", self._env.close)


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a thread of its own that never holds up the interpreter's exit (an
    environment stuck past its timeout is abandoned, not joined, as the default executor's
    threads would be when the event loop closes)."""
    loop = asyncio.get_running_loop()
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
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="skyrl-env", daemon=True).start()
    return future


def skyrl_extras(sample: Sample, max_turns: int) -> dict[str, Any]:
    """The ``extras`` SkyRL's generator passes an environment: the row's columns besides its
    prompt, and ``max_turns``."""
    reward_spec = {"method": "rule", "ground_truth": sample.ground_truth}
    return {
        "reward_spec": reward_spec,
        "reward_model": reward_spec,
        "extra_info": dict(sample.extra),
        "data_source": sample.data_source,
        "max_turns": max_turns,
    }


def skyrl_factory(
    env_class: str,
    make: Callable[..., Any],
    config: Mapping[str, Any],
    max_turns: int,
    timeout_s: float,
) -> EnvFactory:
    """Environments of ``env_class`` made by ``make(env_config=..., extras=...)``."""
    from omegaconf import DictConfig

    def factory(sample: Sample) -> SkyRLEnvironment:
        extras = skyrl_extras(sample, max_turns)
        build = functools.partial(make, env_config=DictConfig(dict(config)), extras=extras)
        return SkyRLEnvironment(build, env_class, timeout_s)

    return factory


def registered_skyrl_env(
    config: Mapping[str, Mapping[str, Any]], max_turns: int, timeout_s: float
) -> Callable[[str], EnvFactory | None]:
    """A lookup of skyrl-gym's registered ids (None when ``name`` is not one, or skyrl-gym is
    not installed)."""

    def lookup(name: str) -> EnvFactory | None:
        try:
            import skyrl_gym
        except ImportError:
            return None
        if name not in skyrl_gym.registry:
            return None
        make = functools.partial(skyrl_gym.make, name)
        return skyrl_factory(name, make, config.get(name, {}), max_turns, timeout_s)

    return lookup
