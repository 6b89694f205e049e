"""Reward rules a wing registers (`jax_agent_rl.config.wings`): built-in names a config may give
``data.reward`` (`register_reward`; verl's ``verl_gsm8k`` ...), and the rule of the data sources
a wing knows (`register_source_rule`): what scores those rows with ``data.reward`` unset, and
what the reward of such a row reads, the whole response (`reads_whole_response`, as verl's
reward managers decode it) rather than the last assistant message."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# a built-in rule: (text, ground truth) -> a number, or a dict whose "score" is one
RewardFn = Callable[[str, Any], Any]


@dataclasses.dataclass(frozen=True)
class SourceRule:
    """The rule of the data sources ``knows`` accepts: ``score(data_source, text, ground_truth,
    extra_info)`` (a number, or a dict whose "score" is one); ``what`` names it in messages."""

    what: str
    knows: Callable[[str], bool]
    score: Callable[[str, str, Any, dict[str, Any]], Any]


REWARDS: dict[str, RewardFn] = {}  # the built-in names, the core's and the wings'
_SOURCE_RULES: list[SourceRule] = []


def register_reward(name: str, fn: RewardFn) -> None:
    """Adds the built-in reward ``name``; a name taken by another function is refused."""
    if REWARDS.get(name, fn) is not fn:
        raise ValueError(f"reward {name!r} is registered already")
    REWARDS[name] = fn


def register_source_rule(rule: SourceRule) -> None:
    """Adds ``rule`` (once)."""
    if rule not in _SOURCE_RULES:
        _SOURCE_RULES.append(rule)


def source_rule(data_source: str) -> SourceRule | None:
    """The registered rule that knows ``data_source``, if one does."""
    return next((r for r in _SOURCE_RULES if r.knows(data_source)), None)


def reads_whole_response(data_source: str) -> bool:
    """Whether a row of ``data_source`` is scored on its whole response (a registered rule
    knows its source) rather than on its last assistant message."""
    return source_rule(data_source) is not None
