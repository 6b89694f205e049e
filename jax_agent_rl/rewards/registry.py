"""Which reward scores a row, loaded once at startup from the config's data section.

A reward is named by a built-in name (`REWARDS`: ``math``, ``gsm8k``, ``format``) or by a user
function, ``package.module:function`` or ``path/to/file.py:function`` (verl's
``custom_reward_function.path`` / ``.name`` in one string). A user function is called in the
form its signature accepts:

- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called with
  keywords as verl calls it (any function that binds those four keywords, ``**kwargs`` too);
- else ours, ``fn(text, ground_truth)``, called positionally (verl's per-dataset scorers such as
  ``gsm8k.compute_score(solution_str, ground_truth)`` fit it).

It returns a number, or (as verl allows) a dict whose ``score`` is the number; the other keys
of such a dict are not recorded. Anything else, and a reward that is not finite, is an error
naming the config key. A row is scored by ``data.rewards_by_source[row.data_source]`` when its
source is listed there, else, for a reasoning-gym row (source ``reasoning_gym/<task>``), by its
task's own scorer (the ``reasoning_gym`` reward), else by ``data.reward``.

The name ``judge`` asks a model instead (`jax_agent_rl.rewards.judge`, set up by
``data.judge``). Rewards are awaited (`Scorer`), so that a step's judge requests are sent
together.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from jax_agent_rl.config import ConfigError, DataSection
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.rewards.math import format_reward, gsm8k_reward, math_reward
from jax_agent_rl.user_code import load_function

RewardFn = Callable[[str, Any], float]  # ours: (final answer text, ground truth) -> reward
# every loaded reward: (data_source, final answer text, ground truth, extra_info) -> reward
ScoreFn = Callable[[str, str, Any, dict[str, Any]], float]

REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "format": lambda text, _truth: format_reward(text),
}

JUDGE = "judge"  # the reward name that asks a model (data.judge)

_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a reward scores: a trajectory's final answer ``text`` with its row's
    ``data_source``, ``prompt`` (the last user message), ``ground_truth`` and ``extra_info``."""

    data_source: str
    prompt: str
    text: str
    ground_truth: Any
    extra: dict[str, Any]


Scorer = Callable[[Answer], Awaitable[float]]  # the reward of one answer, awaited
JudgeFn = Scorer  # a judge (`rewards.judge.Judge`): scores an answer, never raises


def uses_judge(data: DataSection) -> bool:
    """Whether a row may be scored by the judge (``judge`` named as a reward)."""
    return JUDGE in (data.reward, *data.rewards_by_source.values())


def make_reward(data: DataSection, judge: JudgeFn | None = None) -> Scorer:
    """The reward of every row: its source's entry in ``data.rewards_by_source``, else the
    ``reasoning_gym`` reward for reasoning-gym rows, else ``data.reward``. Every named reward
    is loaded and checked here, before anything runs; rows whose reward is ``judge`` go to
    ``judge`` (required when `uses_judge`; without it, this only checks the names)."""
    default = _load(data.reward, "data.reward", judge)
    by_source = {
        source: _load(spec, f"data.rewards_by_source.{source}", judge)
        for source, spec in data.rewards_by_source.items()
    }

    generated = _load("reasoning_gym", "reasoning_gym", judge)

    async def score(answer: Answer) -> float:
        fn = by_source.get(answer.data_source)
        if fn is None:
            is_generated = answer.data_source.startswith(reasoning_gym.SOURCE_PREFIX)
            fn = generated if is_generated else default
        return await fn(answer)

    return score


def _load(spec: str, key: str, judge: JudgeFn | None) -> Scorer:
    """The awaited reward ``spec`` names: the judge, or `load_reward`'s function."""
    if spec == JUDGE:
        return judge or _no_judge
    fn = load_reward(spec, key)

    async def rule(a: Answer) -> float:
        return fn(a.data_source, a.text, a.ground_truth, a.extra)

    return rule


async def _no_judge(answer: Answer) -> float:
    raise RuntimeError(f"row of {answer.data_source!r} names the judge, and none was built")


def load_reward(spec: str, key: str) -> ScoreFn:
    """The reward ``spec`` names (see the module docstring); errors name ``key``."""
    if spec == "reasoning_gym":
        return reasoning_gym.score
    if spec in REWARDS:
        builtin = REWARDS[spec]
        return lambda _source, text, truth, _extra: builtin(text, truth)
    if ":" not in spec:
        raise ConfigError(
            f"{key}={spec!r} is not a reward; built in: {sorted([*REWARDS, 'reasoning_gym'])}, "
            f"{JUDGE!r} (a model, data.judge), or a user function as module:function or "
            "path/to/file.py:function"
        )
    return _adapt(load_function(spec, key), spec, key)


def _adapt(fn: Callable[..., Any], spec: str, key: str) -> ScoreFn:
    """``fn`` called in the form its signature accepts, its result checked."""
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}={spec!r}: a reward must be a plain function, not async")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: cannot read its signature: {e}") from e

    def checked(result: Any) -> float:
        return _score(result, spec, key)

    if _binds(signature, **dict.fromkeys(_VERL_ARGS)):
        return lambda source, text, truth, extra: checked(
            fn(data_source=source, solution_str=text, ground_truth=truth, extra_info=extra)
        )
    if _binds(signature, None, None):
        return lambda _source, text, truth, _extra: checked(fn(text, truth))
    raise ConfigError(
        f"{key}={spec!r}: its signature {signature} is neither (text, ground_truth) nor verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info)"
    )


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _score(result: Any, spec: str, key: str) -> float:
    """A user reward's result as a finite float: a number, or a dict's ``score``."""
    value = result
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(
                f"{key}={spec!r} returned a dict without a 'score' key (keys: {list(result)})"
            )
        value = result["score"]
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(
            f"{key}={spec!r} returned {value!r}; a reward returns a finite number or a dict "
            "whose 'score' is one"
        )
    return float(value)
