"""What counts as a success, attacked by rewards that are positive but low: a judge's 1/10 or a
partial-credit 0.01 is not a solved task, nor are many small tool rewards around a wrong
answer. Success is ``data.success_reward`` (the outcome reward >= it, 1 by default; tool
rewards left out) unless the episode's environment says itself whether it succeeded."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, EnvStep, checked_step
from jax_agent_rl.rewards import Answer
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.train.episodes import episode_metrics, success_by_source
from jax_agent_rl.train.evaluation import pass_rates, pass_totals
from jax_agent_rl.train.rollout_score import score_episodes

REWARDS = {"judged 1/10": 0.1, "partial": 0.01, "solved": 1.0, "over": 1.5, "wrong": 0.0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    task = prepare(tmp_path_factory.mktemp("t"), ArithmeticTask(), n_train=4, n_val=2, n_sft=4)
    return Tokenizer.from_pretrained(task.model)


async def _reward_of(answer: Answer) -> float:
    return REWARDS[answer.prompt]


def _scored(
    tokenizer: Tokenizer, overrides: list[str], env_success: list[bool | None]
) -> tuple[list[Episode], list[Sample]]:
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])
    samples = [
        Sample(uid=name, messages=[{"role": "user", "content": name}], data_source="s")
        for name in REWARDS
    ]
    groups = []
    for s, env in zip(samples, env_success, strict=True):
        traj = Trajectory(uid=s.uid, group_id=s.uid, prompt_ids=[1])
        if env is not None:
            traj.start_env(owns_reward=False)
            traj.add_env_step(0.0, [], success=env)
        groups.append([traj])
    scored = asyncio.run(
        score_episodes(
            groups, samples, _reward_of, 0.0, tokenizer, success_reward=cfg.data.success_reward
        )
    )
    return [g[0] for g in scored], samples


def test_a_low_positive_reward_is_no_success(tokenizer: Tokenizer) -> None:
    trajs, samples = _scored(tokenizer, [], [None] * len(REWARDS))
    assert [t.success for t in trajs] == [False, False, True, True, False]
    assert episode_metrics(trajs)["success"] == 2 / 5
    assert success_by_source(trajs, samples) == {"success/s": 2 / 5}
    assert pass_rates(pass_totals(trajs, 1, samples), 1)["all"]["pass@1"] == 2 / 5
    # the judge's 1/10 alone: pass@1 is 0, not 1
    judged = pass_totals(trajs[:1], 1, samples[:1])
    assert pass_rates(judged, 1)["all"]["pass@1"] == 0.0


def test_the_threshold_is_a_setting(tokenizer: Tokenizer) -> None:
    trajs, _ = _scored(tokenizer, ["data.success_reward=0.05"], [None] * len(REWARDS))
    assert [t.success for t in trajs] == [True, False, True, True, False]


def test_an_environment_that_says_whether_it_succeeded_is_believed(
    tokenizer: Tokenizer,
) -> None:
    trajs, _ = _scored(tokenizer, [], [True, None, False, None, None])
    assert [t.success for t in trajs] == [True, False, False, True, False]


def test_an_environment_success_flag_is_checked() -> None:
    step = {"observations": [], "reward": 1.0, "done": True, "success": True}
    assert checked_step(step, "env") == EnvStep([], 1.0, True, success=True)
    assert checked_step(EnvStep([], 0.0), "env").success is None
    for bad in ("yes", 1, None.__class__):
        with pytest.raises(EnvError, match="success"):
            checked_step({**step, "success": bad}, "env")
    assert dataclasses.replace(EnvStep([]), success=None).success is None


def _tool_rich(tokenizer: Tokenizer, weight: float, tool_reward: float | None) -> Episode:
    """A wrong answer (reward 0) after 20 tool calls of reward ``tool_reward``, one a turn
    (None: their turn rewards, 0.1 each, as a trajectory holds them), scored with
    ``data.tool_reward_weight=weight``."""
    sample = Sample(uid="tools", messages=[{"role": "user", "content": "wrong"}], data_source="s")
    traj = Trajectory(uid="tools", group_id="tools", prompt_ids=[1])
    if tool_reward is None:
        traj.turn_rewards = [0.1] * 20
    else:
        for _ in range(20):
            traj.add_tool_results([ToolResult("ok", reward=tool_reward)], ["calculator"], [])
    (scored,) = asyncio.run(
        score_episodes([[traj]], [sample], _reward_of, weight, tokenizer, success_reward=1)
    )
    return scored[0]


def test_tool_rewards_that_add_up_are_no_success(tokenizer: Tokenizer) -> None:
    """20 tool calls of reward 0.1 around a wrong answer: the reward is 2 (trained on), but
    success is judged on the outcome alone (before: 2 >= 1, a success), in the training
    figures and in jarl eval's."""
    traj = _tool_rich(tokenizer, 1.0, None)
    assert math.isclose(traj.reward, 20 * 0.1, rel_tol=1e-12) and not traj.success
    samples = [Sample(uid="tools", messages=[], data_source="s")]
    assert episode_metrics([traj])["success"] == 0.0
    assert success_by_source([traj], samples)["success/s"] == 0.0
    assert pass_rates(pass_totals([traj], 1, samples), 1)["all"]["pass@1"] == 0.0


def test_a_bad_tool_reward_is_named_and_counts_only_where_tool_rewards_count(
    tokenizer: Tokenizer,
) -> None:
    """A NaN tool reward is checked as its turn is recorded, naming the tool: at
    tool_reward_weight 0 it never enters the reward (before: 0 * NaN, reward_error); at 1 the
    episode is a wrong answer, trained on, its answer_fault naming the tool (the tool computed
    the NaN from the policy's calls: before, it ended reward_error, untrained, and a policy
    whose calls made the tool's reward fail escaped a wrong answer's penalty)."""
    ignored = _tool_rich(tokenizer, 0.0, math.nan)
    assert ignored.stop_reason == "eos" and ignored.trainable and ignored.reward == 0.0
    assert ignored.traj.turn_rewards == [0.0] * 20
    counted = _tool_rich(tokenizer, 1.0, math.nan)
    assert counted.stop_reason == "eos" and counted.trainable
    assert "the tool 'calculator' gave reward nan" in str(counted.answer_fault)
    assert counted.reward == 0.0 and not counted.success


def test_a_failed_tool_reward_scores_a_right_answer_as_wrong_and_keeps_penalties(
    tokenizer: Tokenizer,
) -> None:
    """Where turn rewards count, one call whose reward fails makes the episode a wrong answer
    whatever its outcome: the outcome counts 0 and the calls that passed count only where
    they lower the reward (a right answer, reward 1, with calls of -0.05 and one NaN: -0.05
    each, summed; with calls of +0.5 and one NaN: 0), never untrained."""
    sample = Sample(uid="r", messages=[{"role": "user", "content": "solved"}], data_source="s")

    def played(rewards: list[float]) -> Trajectory:
        traj = Trajectory(uid="r", group_id="r", prompt_ids=[1])
        traj.messages = [{"role": "assistant", "content": "right"}]
        for r in rewards:
            traj.add_tool_results([ToolResult("ok", reward=r)], ["calculator"], [])
        return traj

    trajs = [played([-0.05, -0.05, math.nan]), played([0.5, math.nan]), played([0.5])]
    scored = asyncio.run(
        score_episodes([trajs], [sample], _reward_of, 1.0, tokenizer, success_reward=1)
    )[0]
    assert [e.stop_reason for e in scored] == ["eos"] * 3 and all(e.trainable for e in scored)
    assert math.isclose(scored[0].reward, -0.1, rel_tol=1e-12) and scored[1].reward == 0.0
    assert [e.success for e in scored] == [False, False, True] and scored[2].reward == 1.5
    assert [e.answer_fault is None for e in scored] == [False, False, True]
