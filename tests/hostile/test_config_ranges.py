"""A number a setting takes past what the run can use: each is refused as the config loads,
naming the key and its range, where before it was taken and broke the run later, silently or
in a traceback.

- ``data.success_reward`` at or below ``data.judge.fallback``: every answer that broke the
  judge counted as a success in ``jarl eval``; now refused where the judge scores answers.
- ``data.judge.fallback`` below -MAX_ABS_REWARD: every answer that broke the judge failed the
  reward check and ended untrained, escaping the penalty; ``data.overlong_penalty`` past it
  made rewards -inf in float32. Both are now refused by their ranges."""

from __future__ import annotations

import numpy as np
import pytest

from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.rewards import MAX_ABS_REWARD, RewardError, checked_reward
from jax_agent_rl.rl import core


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.reward=judge", "data.success_reward=0"],
        ["data.reward=judge", "data.success_reward=-0.5", "data.judge.fallback=-0.5"],
        ["data.rewards_by_source={qa: judge}", "data.success_reward=-1"],
    ],
)
def test_a_success_threshold_a_failed_judge_call_reaches_is_refused(
    overrides: list[str],
) -> None:
    """A judge call that fails (no score in the judge's answer, an error, a timeout) scores
    ``data.judge.fallback``; a success threshold at or below it made every answer that broke
    the judge a success in ``jarl eval``'s figures."""
    with pytest.raises(ConfigError, match=r"data\.success_reward=.* at most data\.judge"):
        load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])


def test_a_success_threshold_below_the_fallback_is_kept_without_a_judge() -> None:
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "data.success_reward=0"])
    assert cfg.data.success_reward == 0


def test_a_judge_fallback_no_reward_check_takes_is_refused() -> None:
    """A fallback below -MAX_ABS_REWARD failed every episode's reward check: each answer that
    broke the judge ended ``reward_error``, untrained, so it escaped the penalty of a wrong
    answer instead of taking the fallback the run asked for."""
    assert checked_reward(-MAX_ABS_REWARD, "a fallback at the bound") == -MAX_ABS_REWARD
    with pytest.raises(RewardError):
        checked_reward(-2 * MAX_ABS_REWARD, "a fallback past the bound")
    refused = r"data\.judge\.fallback=-2000000\.0: expected in \[-1e\+06, 0\]"
    with pytest.raises(ConfigError, match=refused):
        load_config(None, ["model.path=m", "data.train=t.jsonl", "data.judge.fallback=-2e6"])
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "data.judge.fallback=-1e6"])
    assert cfg.data.judge.fallback == -MAX_ABS_REWARD


def test_an_overlong_penalty_past_the_reward_bound_is_refused() -> None:
    """DAPO's overlong penalty is added to rewards after their check, in float32: a factor of
    1e39 made an overlong answer's reward -inf and its group's advantages NaN."""
    with np.errstate(over="ignore"):  # the overflow shown
        penalty = core.overlong_penalty(np.array([8]), 8, 4, 1e39)
    assert not np.isfinite(np.asarray(penalty, np.float32)).all()  # what it would have added
    with pytest.raises(
        ConfigError, match=r"data\.overlong_penalty=1e\+39: expected in \[0, 1e\+06\]"
    ):
        load_config(None, ["model.path=m", "data.train=t.jsonl", "data.overlong_penalty=1e39"])
    at_bound = ["model.path=m", "data.train=t.jsonl", "data.overlong_penalty=1e6"]
    assert load_config(None, at_bound).data.overlong_penalty == MAX_ABS_REWARD
