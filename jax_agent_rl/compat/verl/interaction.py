"""verl's interactions (a simulated user answering the policy between turns) as `Environment` s.

verl reads them from an interaction config YAML (``actor_rollout_ref.rollout.multi_turn.
interaction_config_path``; here ``env.interaction_config``)::

    interaction:
      - name: gsm8k                      # rows pick it: extra_info.interaction_kwargs.name
        class_name: my_pkg.interactions.Gsm8kInteraction   # or path/to/file.py:Gsm8kInteraction
        config: {}                       # passed to the constructor, with "name" added

and a row opts in with ``extra_info.interaction_kwargs`` (``name`` plus whatever the class's
``start_interaction`` takes, e.g. ``ground_truth``). The class has verl's ``BaseInteraction``
methods, called as verl's tool agent loop calls them: ``__init__(config)`` once per name;
``await start_interaction(instance_id, **interaction_kwargs)`` when an episode starts;
``await generate_response(instance_id, messages, **interaction_kwargs)`` after each model turn
without tool calls (``turns="text"``), returning ``(should_terminate_sequence, response_text,
turn_score, metrics)``: the text is the next user message, the score the turn's reward;
``await finalize_interaction(instance_id)`` when it ends. As in verl, the episode's reward is the
row's reward function's (``owns_reward=False``); the turn scores are its turn rewards.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from jax_agent_rl.config import ConfigError
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, EnvStep, checked_step
from jax_agent_rl.tokenization import Message
from jax_agent_rl.usercode.load import import_named, load_function
from jax_agent_rl.usercode.threads import error_text

_METHODS = ("start_interaction", "generate_response", "finalize_interaction")


class BaseInteraction:
    """verl's ``BaseInteraction``, for interaction classes to subclass (``verl.interactions.
    base`` in the `verl` shim): ``config`` as the YAML entry gives it, ``name`` from it. A
    subclass implements ``generate_response``; the other methods do nothing by default."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        del kwargs
        return instance_id or str(uuid.uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """``(should_terminate_sequence, response_text, turn_score, metrics)`` after a model
        turn."""
        del instance_id, messages, kwargs
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response")

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        del instance_id, kwargs
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        del instance_id, kwargs


class InteractionEnvironment:
    """One episode of a verl interaction (shared by every episode that names it, each under its
    own instance id, as in verl)."""

    turns: Literal["all", "text"] = "text"
    owns_reward = False

    def __init__(self, interaction: Any, name: str) -> None:
        self.interaction, self.name = interaction, name
        self.instance_id = ""
        self.kwargs: dict[str, Any] = {}
        self.started = False

    async def _call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        """The interaction's method ``what`` (within the loop's timeout on the whole call)."""
        try:
            return await getattr(self.interaction, what)(*args, **kwargs)
        except Exception as e:
            raise EnvError(f"interaction {self.name!r}: {what} raised {error_text(e)}") from e

    async def reset(self, sample: Sample) -> list[Message]:
        self.instance_id = sample.uid
        self.kwargs = dict(sample.extra["interaction_kwargs"])
        await self._call("start_interaction", self.instance_id, **self.kwargs)
        self.started = True
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[Message]) -> EnvStep:
        del text  # the interaction reads the conversation, which ends with it
        out = await self._call("generate_response", self.instance_id, messages, **self.kwargs)
        if not (isinstance(out, tuple | list) and len(out) == 4):
            raise EnvError(
                f"interaction {self.name!r}: generate_response returned {out!r:.80}; expected "
                "(should_terminate_sequence, response, score, metrics)"
            )
        terminate, response, score, _metrics = out
        observations = [{"role": "user", "content": response}]
        step = {"observations": observations, "reward": score, "done": terminate}
        return checked_step(step, f"interaction {self.name!r}")

    async def close(self) -> None:
        if self.started:
            await self._call("finalize_interaction", self.instance_id)


def load_interactions(path: str, key: str = "env.interaction_config") -> dict[str, Any]:
    """The interactions of a verl interaction config YAML, one instance per name; a
    `ConfigError` naming ``key`` and what is wrong otherwise (a FIFO or a device, whose read
    would block the run's start for ever, is no YAML file)."""
    if Path(path).exists() and not Path(path).is_file():
        raise ConfigError(f"{key}={path!r}: not a regular file: name a YAML file")
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{key}={path!r}: cannot read it: {e}") from e
    except RecursionError:  # (the YAML reader recurses once per level)
        raise ConfigError(f"{key}={path!r}: cannot read it: nested too deep") from None
    entries = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}={path!r}: expected a mapping with a non-empty 'interaction' list")
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{key}={path!r}: interaction {i}"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(f"{where}: expected a mapping with a string class_name")
        class_name = entry["class_name"]
        name = entry.get("name") or class_name.rsplit(".", 1)[-1].lower()
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where} ({name}): config must be a mapping")
        if name in out:
            raise ConfigError(f"{where}: the name {name!r} repeats")
        cls = _load_class(class_name, f"{where} ({name}) class_name")
        missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
        if missing:
            raise ConfigError(f"{where}: {class_name} lacks verl's interaction methods {missing}")
        out[name] = cls({**config, "name": name})
    return out


def _load_class(spec: str, key: str) -> Any:
    """``module.Class`` (verl's spelling), ``module:Class`` or ``path/to/file.py:Class``."""
    if ":" in spec:
        return load_function(spec, key)
    module, _, name = spec.rpartition(".")
    try:
        return getattr(import_named(module, key), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: cannot import it: {e}") from e


def interaction_factory(
    interactions: Mapping[str, Any],
) -> Callable[[Sample], InteractionEnvironment]:
    """Episodes of the interaction a row's ``extra_info.interaction_kwargs.name`` names."""

    def factory(sample: Sample) -> InteractionEnvironment:
        kwargs = sample.extra.get("interaction_kwargs")
        name = kwargs.get("name") if isinstance(kwargs, Mapping) else None
        if not isinstance(name, str) or name not in interactions:
            raise EnvError(
                f"row {sample.uid}: extra_info.interaction_kwargs.name is {name!r}; configured "
                f"interactions: {sorted(interactions)}"
            )
        return InteractionEnvironment(interactions[name], name)

    return factory
