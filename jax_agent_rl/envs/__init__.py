"""Environments: what answers a model turn when a tool does not (see `jax_agent_rl.envs.base`).

`make_environments` assembles a run's from its ``env`` section: the built-in ones
(`built_in_environments`: ``guess_number``, `jax_agent_rl.envs.guess`), skyrl-gym environments
(`jax_agent_rl.envs.skyrl`) by a row's ``env_class``, verl interactions
by its ``interaction_kwargs`` (``env.interaction_config``, read by the verl wing:
`jax_agent_rl.compat.verl.interaction`, registered with `register_interactions`), and a user's
own. Task
generators with their own scorers (reasoning-gym) are data, not environments:
`jax_agent_rl.data.reasoning_gym`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jax_agent_rl.config import ConfigError, EnvSection
from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import (
    ENV_THREAD,
    EnvError,
    EnvFactory,
    Environment,
    Environments,
    EnvStep,
    EnvStepError,
    NamedEnvironment,
    checked_messages,
    checked_step,
)
from jax_agent_rl.envs.skyrl import registered_skyrl_env, skyrl_factory
from jax_agent_rl.usercode.load import import_module, load_function
from jax_agent_rl.usercode.threads import CallThreads

# env.interaction_config's reader: the file -> the environment of a row's interaction; the verl
# wing registers verl's interaction config (`load_wing`)
ReadInteractions = Callable[[str], Callable[[Sample], NamedEnvironment]]
_INTERACTIONS: list[ReadInteractions] = []

__all__ = [
    "EnvError",
    "EnvFactory",
    "EnvStep",
    "EnvStepError",
    "Environment",
    "Environments",
    "checked_messages",
    "checked_step",
    "make_environments",
    "register_interactions",
]


def register_interactions(read: ReadInteractions) -> None:
    """Reads ``env.interaction_config`` with ``read`` (the verl wing's)."""
    _INTERACTIONS[:] = [read]


def make_environments(env: EnvSection, max_turns: int) -> Environments:
    """The environments ``env`` configures, each class loaded (and the interaction YAML read)
    here, before anything runs, after the modules of ``env.imports`` (which may register
    skyrl-gym ids); ``max_turns`` is what skyrl-gym environments are told."""
    for i, spec in enumerate(env.imports):
        import_module(spec, f"env.imports[{i}]")
    built_in = built_in_environments()
    shadowed = sorted(set(env.classes) & set(built_in))
    if shadowed:
        raise ConfigError(f"env.classes: {shadowed} are built-in environments; use other names")
    classes: dict[str, EnvFactory] = {
        **built_in,
        **{name: _factory(name, spec, env, max_turns) for name, spec in env.classes.items()},
    }
    unknown = sorted(set(env.config) - set(classes) - _skyrl_ids())
    if unknown:
        raise ConfigError(
            f"env.config names {unknown}, which are neither in env.classes nor skyrl-gym ids"
        )
    interaction = None
    if env.interaction_config:
        load_wing("verl")  # verl's interaction config
        (read,) = _INTERACTIONS
        interaction = read(env.interaction_config)
    lookup = registered_skyrl_env(env, max_turns)
    threads = CallThreads(env.max_threads, ENV_THREAD)
    return Environments(classes, lookup, interaction, env.step_timeout_s, threads)


def built_in_environments() -> dict[str, EnvFactory]:
    """env_class -> the environments that ship with the package (imported here, so that
    ``python -m jax_agent_rl.envs.guess`` runs its module once)."""
    from jax_agent_rl.envs.guess import ENV_CLASS, GuessNumber

    return {ENV_CLASS: GuessNumber}


def _factory(name: str, spec: str, env: EnvSection, max_turns: int) -> EnvFactory:
    """``env.classes.<name>``: a skyrl-gym environment class (it has a synchronous ``step``
    and an ``init``), or a function of the sample returning an `Environment` (whose methods
    may be synchronous too: they then run in threads)."""
    key = f"env.classes.{name}"
    made = load_function(spec, key, "class or function")
    step = getattr(made, "step", None)
    if inspect.isclass(made) and callable(step) and not inspect.iscoroutinefunction(step):
        if not callable(getattr(made, "init", None)):
            raise ConfigError(f"{key}={spec!r}: a class with step() but no init() (skyrl-gym's)")
        return skyrl_factory(name, spec, False, env, max_turns)

    def factory(sample: Sample) -> Environment:
        try:
            environment: Any = made(sample)
        except Exception as e:
            raise EnvError(f"{key}={spec!r} raised making the environment: {e!r}") from e
        return environment

    return factory


def _skyrl_ids() -> set[str]:
    try:
        import skyrl_gym
    except ImportError:
        return set()
    return set(skyrl_gym.registry)
