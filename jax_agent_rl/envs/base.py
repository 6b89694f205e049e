"""The environment seam: what answers a model turn when a tool does not.

An `Environment` is one episode's counterpart, made per trajectory from its `Sample` and driven
by the tool loop between model turns (`jax_agent_rl.agent.loop`):

- ``env.reset(sample)`` returns the messages the episode starts from (the sample's, or what the
  environment makes of them, as SkyRL's ``init`` may);
- after each model turn it answers, ``env.step(text, messages)`` (the turn's text, the
  conversation so far) returns an `EnvStep`: messages the model reads next (appended as a
  chat-template delta with mask 0, exactly as a tool observation is), a reward for that turn
  (kept in ``Trajectory.turn_rewards``), whether the episode is over and, optionally, whether
  it succeeded (``success``: the episode's success is then this, not ``data.success_reward``);
- ``env.close()`` runs once, however the episode ended.

Each method is ``async`` (run on the environments' own event loop, in a thread of its own,
`jax_agent_rl.envs.env_loop`) or synchronous (run in a thread of a bounded pool,
`jax_agent_rl.usercode.threads.CallThreads`). Two properties say how it
shares the loop: ``turns`` is ``"all"`` when it answers every model turn (it parses the model's
actions itself, as skyrl-gym environments do) and ``"text"`` when it answers only turns without
tool calls (the tools answer the others, as verl's interactions do); ``owns_reward`` is True
when the episode's reward is the sum of its step rewards (SkyRL) rather than the row's reward
function's score (verl: the step rewards are turn scores the reward function may read as
``extra_info["tool_rewards"]``).

`Environments` picks the environment of a sample: its ``env_class`` (SkyRL's column) names an
entry of ``env.classes`` or, when that is empty, a skyrl-gym registered id (`skyrl_env`);
``extra_info.interaction_kwargs.name`` (verl's) names an interaction of ``env.interaction_config``
(the verl wing's, `jax_agent_rl.compat.verl.interaction`). The loop calls every environment
through `GuardedEnvironment`: whatever an environment does wrong (raises, returns a malformed
step, takes longer than ``env.step_timeout_s``; every answer is checked, `checked_step`, whoever
made the environment) ends that trajectory: a failed ``step`` with stop reason ``caused_error``
(`EnvStepError`: the policy's action made it fail, trained on as a wrong answer), a failed
``reset`` or ``close`` or a call held up by others with ``env_error`` (`EnvError`), counted
and not trained on; an environment that never says done is ended by the loop's budgets
(``agent.max_turns``...).

A limit of Python is worked around rather than removed: a thread stuck inside an environment
cannot be stopped, only abandoned. A synchronous call stuck for good keeps its place in the pool
until it returns, so environments stuck for good hold at most ``env.max_threads`` threads, and
once every thread is held the calls waiting for one time out. An ``async`` call past its
timeout is cancelled, and abandoned if it does not end at that; one that blocks its thread (a
``time.sleep``, a synchronous request) holds the environments' loop, never the rollout's: its
own call ends at its timeout (the policy's, as any step past it), and the others on that loop
that it held end at theirs as not the policy's (`EnvBusyError`, naming it); one that blocks for
good holds that loop for good, so every later async call ends so, and the run stops (every
episode failed) with that error rather than hanging. The fix then is to make the method
synchronous, so that it runs in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import numbers
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, cast

import numpy as np

from jax_agent_rl.config import EnvSection
from jax_agent_rl.console.visible import lone_surrogate
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.env_loop import ENV_LOOP, EnvCallTimeoutError, EnvLoop
from jax_agent_rl.rewards.registry import RewardError, checked_reward
from jax_agent_rl.tokenization import Message
from jax_agent_rl.usercode.threads import CallThreads, error_text

OBSERVATION_ROLES = ("user", "tool", "system")


class EnvError(RuntimeError):
    """An environment failed (raised, hung, or returned something malformed): its episode ends
    with stop reason ``env_error``."""


class EnvStepError(EnvError):
    """An environment's ``step`` failed on the policy's action (raised, ran past its timeout,
    answered malformed): its episode ends ``caused_error``, trained on as a wrong answer (see
    `GuardedEnvironment.step`)."""


class EnvBusyError(EnvError):
    """A call past its timeout for want of a place to run, which says nothing of its arguments
    (``env_error``): a synchronous one that waited for an environment thread the whole time, an
    async one that the environments' event loop never started, or that other calls held that
    loop from for most of its time (`jax_agent_rl.envs.env_loop`)."""


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model turn."""

    observations: list[Message]  # what the model reads next (empty: nothing)
    reward: float = 0.0
    done: bool = False
    success: bool | None = None  # whether the episode succeeded (None: not said here)


class Environment(Protocol):
    """One episode's environment (see the module docstring): as the loop sees it; a user's
    may have synchronous methods instead (`GuardedEnvironment` runs them in threads)."""

    turns: Literal["all", "text"]
    owns_reward: bool

    async def reset(self, sample: Sample) -> list[Message]: ...

    async def step(self, text: str, messages: list[Message]) -> EnvStep:
        """Answers the model turn ``text``; ``messages`` is the conversation so far, ending
        with that turn (and holding the tool turns between the environment's)."""
        ...

    async def close(self) -> None: ...


class NamedEnvironment(Environment, Protocol):
    """An environment with a name its failures give (a verl interaction's)."""

    name: str


# one fresh environment per episode: an Environment, or one whose methods are synchronous
EnvFactory = Callable[[Sample], Any]
ENV_THREAD = "env-call"  # the name of the threads that run environments' synchronous calls


class Environments:
    """Which environment plays a sample (None: the plain tool loop). ``classes`` maps a row's
    ``env_class`` to a factory; ``lookup`` finds the factory of a name ``classes`` lacks (or
    None); ``interaction`` makes the environment of rows with verl's ``interaction_kwargs``.
    Each environment made is called through `GuardedEnvironment`: every call within
    ``step_timeout_s``, synchronous ones in the ``threads`` pool, async ones on ``loop``."""

    def __init__(
        self,
        classes: Mapping[str, EnvFactory] | None = None,
        lookup: Callable[[str], EnvFactory | None] | None = None,
        interaction: Callable[[Sample], NamedEnvironment] | None = None,
        step_timeout_s: float = 60.0,
        threads: CallThreads | None = None,
        loop: EnvLoop = ENV_LOOP,
    ) -> None:
        self.classes = dict(classes or {})
        self.lookup = lookup
        self.interaction = interaction
        self.step_timeout_s = step_timeout_s
        self.threads = threads or CallThreads(EnvSection().max_threads, ENV_THREAD)
        self.loop = loop

    def factory(self, env_class: str) -> EnvFactory:
        """The factory of ``env_class``; a `KeyError` naming the known ones if there is none."""
        found = self.classes.get(env_class) or (self.lookup(env_class) if self.lookup else None)
        if found is None:
            raise KeyError(
                f"unknown env_class {env_class!r}; configured (env.classes): "
                f"{sorted(self.classes)}"
                + (
                    "; nor a registered skyrl-gym environment (a module of yours that "
                    "registers it: name it in env.imports)"
                    if self.lookup
                    else ""
                )
            )
        return found

    def plays(self, sample: Sample) -> bool:
        """Whether an environment plays ``sample``."""
        return bool(sample.env_class) or self._interacts(sample)

    def _interacts(self, sample: Sample) -> bool:
        return self.interaction is not None and "interaction_kwargs" in sample.extra

    def make(self, sample: Sample) -> Environment | None:
        """A fresh environment for one episode of ``sample``, guarded (None: none plays it)."""
        if sample.env_class:
            made = checked_environment(self.factory(sample.env_class)(sample), sample.env_class)
            name = sample.env_class
        elif self._interacts(sample):
            assert self.interaction is not None
            made = self.interaction(sample)
            name = f"interaction {made.name!r}"
        else:
            return None
        return GuardedEnvironment(made, name, self.step_timeout_s, self.threads, self.loop)


def checked_environment(env: Any, name: str) -> Environment:
    """``env`` if it has what the loop reads of an `Environment` (its methods async or
    synchronous), else an `EnvError`."""
    methods = ("reset", "step", "close")
    lacking = [m for m in methods if not callable(getattr(env, m, None))]
    turns, owns = getattr(env, "turns", None), getattr(env, "owns_reward", None)
    if lacking or turns not in ("all", "text") or not isinstance(owns, bool):
        raise EnvError(
            f"env_class {name!r} made {type(env).__name__}, not an Environment: it needs "
            f"methods {methods} (lacking {lacking}), turns 'all' or 'text' (got {turns!r}) and "
            f"a bool owns_reward (got {owns!r})"
        )
    return cast(Environment, env)


def checked_step(raw: Any, owner: str) -> EnvStep:
    """``raw`` (an `EnvStep`, or a mapping with ``observations``, ``reward``, ``done`` and
    optionally ``success``, as skyrl-gym returns) as a checked `EnvStep` (``done`` and
    ``success`` may be NumPy bools); an `EnvError` saying what is wrong otherwise."""
    if isinstance(raw, EnvStep):
        observations, reward, done, success = raw.observations, raw.reward, raw.done, raw.success
    elif isinstance(raw, Mapping):
        missing = {"observations", "reward", "done"} - set(raw)
        if missing:
            raise EnvError(f"{owner}.step returned a mapping without {sorted(missing)}")
        observations, reward, done = raw["observations"], raw["reward"], raw["done"]
        success = raw.get("success")
    else:
        raise EnvError(
            f"{owner}.step returned {type(raw).__name__}; expected a mapping with "
            "observations, reward, done"
        )
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvError(f"{owner}.step returned reward {reward!r:.60}; expected a number")
    try:
        reward = checked_reward(reward, f"{owner}.step")
    except RewardError as e:
        raise EnvError(str(e)) from e
    done, success = _plain(done), _plain(success)  # (np.array_equal gives a NumPy bool)
    if not isinstance(done, bool):
        raise EnvError(f"{owner}.step returned done {done!r}; expected True or False")
    if success is not None and not isinstance(success, bool):
        raise EnvError(f"{owner}.step returned success {success!r:.40}; expected a bool or None")
    return EnvStep(checked_messages(observations, owner), float(reward), done, success)


def _plain(flag: Any) -> Any:
    """A NumPy bool as the Python bool it stands for; anything else as it is."""
    return bool(flag) if isinstance(flag, np.bool_) else flag


def checked_messages(messages: Any, owner: str, prompt: bool = False) -> list[Message]:
    """``messages`` as a list of chat messages {role, content: str} with a role an environment
    may speak in (user, tool, system; a ``prompt``'s may hold assistant turns too, and may not
    be empty); an `EnvError` otherwise."""
    roles = (*OBSERVATION_ROLES, "assistant") if prompt else OBSERVATION_ROLES
    what = "prompt" if prompt else "observations"
    if not isinstance(messages, list) or (prompt and not messages):
        raise EnvError(f"{owner} returned {what} {messages!r:.80}; expected a list of messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise EnvError(f"{owner}: {what} message {i} is {type(m).__name__}, not a message")
        role, content = m.get("role"), m.get("content")
        if role not in roles or not isinstance(content, str):
            raise EnvError(
                f"{owner}: {what} message {i} must have a role in {roles} and string content, "
                f"got role {role!r:.40} and content {type(content).__name__}"
            )
        where = lone_surrogate(content)  # (the tokenizer cannot take one, nor a trace file)
        if where is not None:
            raise EnvError(f"{owner}: {what} message {i} holds a lone surrogate {where}: not text")
        out.append({"role": role, "content": content})
    return out


class GuardedEnvironment:
    """An `Environment` as the loop calls it (see the module docstring): ``name`` says which
    in errors."""

    def __init__(
        self, env: Any, name: str, timeout_s: float, threads: CallThreads, loop: EnvLoop
    ) -> None:
        self.env, self.name, self.timeout_s = env, name, timeout_s
        self.threads, self.loop = threads, loop
        self.turns: Literal["all", "text"] = env.turns
        self.owns_reward: bool = env.owns_reward

    async def _call(self, what: str, *args: Any) -> Any:
        """The environment's ``what(*args)``, its failures as `EnvError`: past the timeout, an
        `EnvBusyError` when the call was held up by others. A ``TimeoutError`` the method
        raises itself (its own ``asyncio.wait_for`` around a request, say) is its failure like
        any other, not this call's timeout."""
        method = getattr(self.env, what)
        started = threading.Event()  # (a synchronous call: once a thread runs it)

        def begun(*args: Any) -> Any:
            started.set()
            try:
                return method(*args)
            except TimeoutError as e:  # its own, told apart from `wait_for`'s below
                raise EnvError(f"{self.name}.{what} raised {error_text(e)}") from e

        try:
            if inspect.iscoroutinefunction(method):
                call = f"{self.name}.{what}"
                return await self.loop.run(call, self._own(what, method(*args)), self.timeout_s)
            return await asyncio.wait_for(self.threads.run(begun, *args), self.timeout_s)
        except EnvCallTimeoutError as e:
            raise (EnvError if e.blamed else EnvBusyError)(
                f"{self.name}.{what} took longer than env.step_timeout_s={self.timeout_s}s "
                f"({e.why})"
            ) from e
        except TimeoutError as e:
            held = self.threads.busy
            raise (EnvError if started.is_set() else EnvBusyError)(
                f"{self.name}.{what} took longer than env.step_timeout_s={self.timeout_s}s "
                f"({held} of env.max_threads={self.threads.size} environment threads busy)"
            ) from e
        except EnvError:  # the adapters' own checks name the environment
            raise
        except Exception as e:
            raise EnvError(f"{self.name}.{what} raised {error_text(e)}") from e

    async def _own(self, what: str, coro: Any) -> Any:
        """``coro``, a ``TimeoutError`` of its own an `EnvError` (see `_call`)."""
        try:
            return await coro
        except TimeoutError as e:
            raise EnvError(f"{self.name}.{what} raised {error_text(e)}") from e

    async def reset(self, sample: Sample) -> list[Message]:
        return checked_messages(await self._call("reset", sample), self.name, prompt=True)

    async def step(self, text: str, messages: list[Message]) -> EnvStep:
        """The environment's checked answer to the policy's action ``text``. Its failure here
        is an `EnvStepError`, the policy's: the action is the one thing that changed since
        the environment's last good answer, a stateful environment cannot be stepped again to
        tell a transient failure from its action's, and an episode ended untrained
        (``env_error``) takes none of the negative advantage a wrong answer takes in its
        group, so a policy that learns to make the step raise or hang escapes being wrong.
        Not the policy's: a call held up by others (`EnvBusyError`), and ``reset`` and
        ``close`` (no action of its own: ``env_error``)."""
        try:
            return checked_step(await self._call("step", text, messages), self.name)
        except EnvBusyError:
            raise
        except EnvError as e:
            raise EnvStepError(str(e)) from e

    async def close(self) -> None:
        await self._call("close")
