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

skyrl-gym environments are synchronous, and so is `SkyRLEnvironment`: the loop runs its calls
(making the environment and ``init``; ``step``; ``close``) in threads of the bounded pool, each
within ``env.step_timeout_s`` (`jax_agent_rl.envs.base.GuardedEnvironment`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, EnvFactory, EnvStep, checked_messages, checked_step
from jax_agent_rl.tokenization import Message


class SkyRLEnvironment:
    """One skyrl-gym ``Env`` (``init`` / ``step`` / ``close``) as a synchronous `Environment`
    (run in threads by the loop)."""

    turns: Literal["all", "text"] = "all"
    owns_reward = True

    def __init__(self, make: Callable[[], Any], name: str) -> None:
        self._make, self.name = make, name
        self._env: Any = None

    def reset(self, sample: Sample) -> list[Message]:
        self._env = self._make()
        out = self._env.init([dict(m) for m in sample.messages])
        if not (isinstance(out, tuple) and len(out) == 2):
            raise EnvError(f"{self.name}.init returned {type(out).__name__}, not (prompt, info)")
        return checked_messages(out[0], f"{self.name}.init", prompt=True)

    def step(self, text: str, messages: list[Message]) -> EnvStep:
        del messages  # a skyrl-gym environment keeps its own state
        return checked_step(self._env.step(text), self.name)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()


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
    env_class: str,
    make: Callable[..., Any],
    config: Mapping[str, Any],
    max_turns: int,
) -> EnvFactory:
    """Environments of ``env_class`` made by ``make(env_config=..., extras=...)``."""
    from omegaconf import DictConfig

    def factory(sample: Sample) -> SkyRLEnvironment:
        extras = skyrl_extras(sample, max_turns)
        build = functools.partial(make, env_config=DictConfig(dict(config)), extras=extras)
        return SkyRLEnvironment(build, env_class)

    return factory


def registered_skyrl_env(
    config: Mapping[str, Mapping[str, Any]], max_turns: int
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
        return skyrl_factory(name, make, config.get(name, {}), max_turns)

    return lookup
