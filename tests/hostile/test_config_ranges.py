"""A number a setting takes past what the run can use: each is refused as the config loads,
naming the key and its range, where before it was taken and broke the run later, silently or
in a traceback.

- ``data.success_reward`` at or below ``data.judge.fallback``: every answer that broke the
  judge counted as a success in ``jarl eval``; now refused where the judge scores answers.
- ``data.judge.fallback`` below -MAX_ABS_REWARD: every answer that broke the judge failed the
  reward check and ended untrained, escaping the penalty; ``data.overlong_penalty`` past it
  made rewards -inf in float32. Both are now refused by their ranges.
- A timeout set to mean "never" (``env.step_timeout_s=1e300``) was taken, and every skyrl-gym
  episode then ended with an OverflowError (a pipe's poll takes at most 2**31 ms, 24.8 days),
  naming no setting; ``env.memory_limit_mib=10000000000000`` was taken, and every episode's
  process died at its start (setrlimit overflowed) with an error blaming memory. Each timeout
  is now at most 1e6 s and the memory bound at most 1e9 MiB, refused past that naming the key.
- ``agent.harness_timeout_s`` of 0, below it, NaN, infinite, past 1e6 s or no number is
  refused naming the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.agent.context import AgentConfig
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.envs import skyrl
from jax_agent_rl.rewards import MAX_ABS_REWARD, RewardError, checked_reward
from jax_agent_rl.rl import core
from tests.hostile.test_skyrl_isolation import _pids_envs, _pids_sample


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


@pytest.mark.parametrize(
    "setting",
    [
        "env.step_timeout_s=1e300",
        "env.step_timeout_s=3e6",
        "data.reward_timeout_s=1e300",
        "tools.timeout_s=1e300",
        "data.judge.timeout_s=1e300",
        "env.memory_limit_mib=10000000000000",
    ],
)
def test_a_bound_past_what_its_wait_or_limit_takes_is_refused(setting: str) -> None:
    key = setting.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=.*: expected in .*1e\+0[69]\]$"):
        load_config(None, ["model.path=m", "data.train=t.jsonl", setting])


def test_a_timeout_and_memory_bound_at_their_largest_still_run_an_episode(tmp_path: Path) -> None:
    """The largest timeout and memory bound taken still let an episode run (before, past 24.8
    days a poll raised OverflowError; past 2**43 MiB the process died at its start)."""
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.train=t.jsonl",
            "env.step_timeout_s=1e6",
            "env.memory_limit_mib=1000000000",
        ],
    )
    envs = _pids_envs(tmp_path, cfg.env.step_timeout_s)
    sample = _pids_sample(tmp_path / "long", "plain")
    env = envs.factory("pids")(sample)
    assert isinstance(env, skyrl.SkyRLEnvironment)
    env.memory_limit_mib = cfg.env.memory_limit_mib
    try:
        env.reset(sample)
        assert env.step("move", []).reward == 1.0
    finally:
        env.close()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e7", "soon"])
def test_a_harness_timeout_outside_its_range_is_a_config_error(value: str) -> None:
    refused = r"agent\.harness_timeout_s=.*: expected (in|a number|a finite number in)"
    with pytest.raises(ConfigError, match=refused):
        load_config(
            None, ["model.path=m", "data.train=t.jsonl", f"agent.harness_timeout_s={value}"]
        )
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "agent.harness_timeout_s=30"])
    assert AgentConfig.of(cfg.agent).harness_timeout_s == 30.0  # (read by openai_agent)
    assert AgentConfig().harness_timeout_s == 300.0
