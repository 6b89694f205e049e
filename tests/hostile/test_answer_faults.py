"""A policy's answer that makes what scores it fail is a wrong answer, never a way out of one.

- A reward that raised or ran past ``data.reward_timeout_s`` on the policy's answer ended that
  episode ``reward_error``: dropped from its group, it took none of the negative advantage a
  wrong answer takes, so a policy that made the reward raise or hang escaped being wrong. Now
  a reward failing on the answer twice, and scoring the row's own answer (the ground truth
  written out), scores the answer 0 as a wrong answer, trained on (`rewards.AnswerFaultError`,
  ``rewards/answer_faults``); a reward failing on every text stays ``reward_error`` and still
  stops a run whose every episode hits it; one failing once is not the answer's fault.
- An environment's step that raised, hung or answered malformed on the policy's action ended
  the episode ``env_error``, untrained: the same escape. Now it ends ``caused_error``,
  trained, outcome 0 (or the environment's reward so far, when lower); a reset's failure, and
  a call that never got a thread, stay ``env_error``; a rollout whose every episode so ended
  stops."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import run_episode
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.config import load_config
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import Environment, Environments, EnvStep
from jax_agent_rl.rewards import Answer, AnswerFaultError, RewardError, make_reward
from jax_agent_rl.rewards.registry import _Sync
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.episodes import episode_metrics, raise_if_all_failed, stop_warning
from jax_agent_rl.train.rollout_score import score_episodes
from jax_agent_rl.usercode.processes import CallProcesses
from jax_agent_rl.usercode.threads import CallThreads

HERE = "tests.hostile.test_answer_faults"


def picky(text: str, ground_truth: Any) -> float:
    """A user's reward that the policy's text can break: it raises on an answer that is not a
    number (``float`` of it), and hangs on one naming ``hang`` (as a scorer that evaluates
    the answer can be kept running)."""
    if "hang" in text:
        threading.Event().wait()  # for ever: the worker is killed past the timeout
    return float(float(text) == float(ground_truth))


def broken(text: str, ground_truth: Any) -> float:
    """A user's reward that fails on every text (its service is down)."""
    del text, ground_truth
    raise ConnectionError("the scoring service refused the connection")


_CALLS: dict[str, int] = {}


def flaky(text: str, ground_truth: Any) -> float:
    """A user's reward whose first call on each text fails (a flaky service), in one worker."""
    _CALLS[text] = _CALLS.get(text, 0) + 1
    if _CALLS[text] == 1:
        raise ConnectionError(f"reset by peer (worker {os.getpid()})")
    return float(text == str(ground_truth))


def _group(texts: list[str]) -> list[Trajectory]:
    group = []
    for i, text in enumerate(texts):
        traj = Trajectory(uid=f"r/s1a0/{i}", group_id="r", prompt_ids=[1])
        traj.messages = [{"role": "assistant", "content": text}]
        group.append(traj)
    return group


def _scored(reward: str, texts: list[str], tokenizer: Tokenizer, truth: Any = "4") -> list[Episode]:
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", f"data.reward={HERE}:{reward}",
         "data.reward_workers=2", "data.reward_timeout_s=0.5"],
    )  # fmt: skip
    sample = Sample("r", [{"role": "user", "content": "2+2?"}], truth, data_source="s")
    group = _group(texts)

    async def go() -> list[list[Episode]]:
        with make_reward(cfg.data) as score:
            return await score_episodes(
                [group], [sample], score, 0.0, tokenizer, success_reward=1.0
            )

    (scored,) = asyncio.run(go())
    return scored


def test_an_answer_that_makes_the_reward_raise_or_hang_is_a_wrong_answer(
    tokenizer: Tokenizer,
) -> None:
    group = _scored("picky", ["four", "hang on", "5", "4"], tokenizer)
    raised, hung, wrong, right = group
    # (before: both ended reward_error, untrained: no negative advantage for either)
    for traj in (raised, hung):
        assert (traj.stop_reason, traj.trainable, traj.reward, traj.success) == (
            "eos", True, 0.0, False
        )  # fmt: skip
        assert "failed on the answer twice" in str(traj.answer_fault)
        assert "scored the row's own answer ('4')" in str(traj.answer_fault)
        assert "data_source 's'" in str(traj.answer_fault)
    assert "ValueError: could not convert string to float: 'four'" in str(raised.answer_fault)
    assert "data.reward_timeout_s=0.5s" in str(hung.answer_fault)
    assert (wrong.reward, wrong.answer_fault, right.reward, right.success) == (0.0, None, 1.0, True)
    metrics = episode_metrics(group)
    assert metrics["rewards/answer_faults"] == 0.5 and metrics["untrainable"] == 0.0
    assert stop_warning(metrics, group) is None  # half: no warning yet
    mostly = _scored("picky", ["four", "five", "4"], tokenizer)
    line = stop_warning(episode_metrics(mostly), mostly)
    assert line is not None and line.startswith(
        "WARNING: the policy's text made 67% of episodes fail"
    )


def test_a_reward_that_fails_on_every_text_is_still_the_rewards_error(
    tokenizer: Tokenizer,
) -> None:
    group = _scored("broken", ["4", "four"], tokenizer)
    for traj in group:
        assert (traj.stop_reason, traj.trainable, traj.answer_fault) == (
            "reward_error", False, None
        )  # fmt: skip
        assert "ConnectionError: the scoring service refused the connection" in str(traj.error)
    with pytest.raises(RuntimeError, match="all 2 trajectories of the rollout failed"):
        raise_if_all_failed(group)


def test_a_ground_truth_no_text_answers_leaves_the_error_the_rewards(
    tokenizer: Tokenizer,
) -> None:
    # (a list: no probe, so no telling the answer's fault from the reward's)
    (traj,) = _scored("picky", ["four"], tokenizer, truth=["4", "four"])
    assert traj.stop_reason == "reward_error" and traj.answer_fault is None


def test_a_failure_that_does_not_repeat_is_not_the_answers() -> None:
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", f"data.reward={HERE}:flaky",
         "data.reward_workers=1"],
    )  # fmt: skip
    with make_reward(cfg.data) as score:
        answer = Answer("s", "", "4", "4", {})
        assert asyncio.run(score(answer)) == 1.0  # failed once, scored on the second call


def test_a_rule_in_a_thread_that_the_answer_fails_or_hangs_is_the_answers_fault() -> None:
    release = threading.Event()

    def rule(source: str, text: str, truth: Any, extra: dict[str, Any]) -> float:
        del source, extra
        if text == "hang":
            release.wait()  # (a thread is abandoned past the timeout; released at the end)
        return float(int(text) == truth)

    sync = _Sync(CallThreads(4, "test-reward"), CallProcesses(1, "unused"), 0.5, None)
    scorer = sync.in_thread(rule, "data.reward='rule'")
    with pytest.raises(AnswerFaultError, match=r"ValueError: invalid literal for int\(\)"):
        asyncio.run(scorer(Answer("s", "", "four", 4, {})))
    with pytest.raises(AnswerFaultError, match=r"took longer than data\.reward_timeout_s=0\.5s"):
        asyncio.run(scorer(Answer("s", "", "hang", 4, {})))
    assert asyncio.run(scorer(Answer("s", "", "4", 4, {}))) == 1.0
    with pytest.raises(RewardError):  # (a bool ground truth: no text answers it)
        asyncio.run(scorer(Answer("s", "", "hang", True, {})))
    release.set()


_HELD = threading.Event()  # the fragile environment's "hold" steps wait on it


class Fragile:
    """A skyrl-style environment (synchronous, owns the reward) that parses the action as a
    number: 1 for "4", 0 for another number; it raises on what is not one, hangs on "hold"
    (until the test releases it), and fails to reset a prompt saying "no reset"."""

    turns, owns_reward = "all", True

    def reset(self, sample: Sample) -> list[dict[str, str]]:
        if sample.messages[-1]["content"] == "no reset":
            raise ConnectionError("the environment's container did not start")
        return sample.messages

    def step(self, text: str, messages: list[dict[str, str]]) -> EnvStep:
        del messages
        if text == "hold":
            _HELD.wait()
        return EnvStep([], 0.5 if text == "half" else float(float(text) == 4), text != "half")

    def close(self) -> None:
        pass


def _played(
    envs: Environments,
    tokenizer: Tokenizer,
    backend: EmbeddedBackend,
    actions: list[str],
    prompt: str = "2+2?",
) -> Episode:
    """One episode of ``Fragile`` whose policy's actions are ``actions``, one a turn, scored."""

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        assert env is not None
        for action in actions:
            step = await env.step(action, [])
            traj.add_env_step(step.reward, [], step.success)
            if step.done:
                return "env_done"
        return "max_turns"

    async def go() -> Episode:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(
            backend, tokenizer, tools, make_parser("hermes"), AgentConfig(), envs=envs
        )
        sample = Sample("e", [{"role": "user", "content": prompt}], "4", env_class="fragile")
        traj = await run_episode(sample, ctx, play, drives_envs=True)
        cfg = load_config(None, ["model.path=m", "data.train=t.jsonl"])
        with make_reward(cfg.data) as score:
            ((scored,),) = await score_episodes(
                [[traj]], [sample], score, 0.0, tokenizer, success_reward=1.0
            )
        return scored

    return asyncio.run(go())


def test_an_environment_step_failing_on_the_action_is_a_wrong_answer(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    envs = Environments(
        {"fragile": lambda _: Fragile()}, step_timeout_s=0.5, threads=CallThreads(1, "env")
    )
    right = _played(envs, tokenizer, backend, ["4"])
    assert (right.stop_reason, right.reward, right.success) == ("env_done", 1.0, True)
    # (before: env_error, untrained: no negative advantage for either)
    raised = _played(envs, tokenizer, backend, ["four"])
    assert (raised.stop_reason, raised.trainable, raised.reward, raised.success) == (
        "caused_error", True, 0.0, False
    )  # fmt: skip
    assert "fragile.step raised ValueError: could not convert string to float" in str(raised.error)
    half = _played(envs, tokenizer, backend, ["half", "four"])  # (0.5 so far: not kept)
    assert (half.stop_reason, half.reward) == ("caused_error", 0.0)
    hung = _played(envs, tokenizer, backend, ["hold"])  # (holds the one thread till released)
    assert (hung.stop_reason, hung.trainable, hung.reward) == ("caused_error", True, 0.0)
    assert "took longer than env.step_timeout_s=0.5s" in str(hung.error)
    waited = _played(envs, tokenizer, backend, ["4"])  # never got a thread: not its action's
    assert (waited.stop_reason, waited.trainable) == ("env_error", False)
    _HELD.set()
    unreset = _played(envs, tokenizer, backend, ["4"], prompt="no reset")
    assert (unreset.stop_reason, unreset.trainable) == ("env_error", False)
    with pytest.raises(RuntimeError, match="all 2 trajectories of the rollout failed"):
        raise_if_all_failed([raised, hung])  # (every one so: the environment is broken)


def strict_gsm8k(text: str, ground_truth: Any) -> float:
    """A user's reward that reads only a ``#### N`` line (and raises without one)."""
    return float(text.split("####")[1].strip() == str(ground_truth))


def test_a_reward_raising_on_an_unmarked_answer_still_finds_the_answer_at_fault() -> None:
    """The bare ground truth is no answer this reward reads; its marked forms are tried in turn
    (before them: reward_error, untrained, for every answer without ``####``)."""
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", f"data.reward={HERE}:strict_gsm8k",
         "data.reward_workers=1"],
    )  # fmt: skip
    with make_reward(cfg.data) as score:
        with pytest.raises(AnswerFaultError, match=r"own answer \('#### 4'\)"):
            asyncio.run(score(Answer("s", "", "The answer is 4.", "4", {})))
        assert asyncio.run(score(Answer("s", "", "#### 4", "4", {}))) == 1.0
