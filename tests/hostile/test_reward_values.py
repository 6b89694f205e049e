"""Rewards that are not rewards: NaN (an environment parsing the model's last word "nan" as a
float), 1e308 (finite, but inf once summed or squared), a string. Wherever a reward enters (a
native environment's step, the reward function, the episode's sum of turn rewards), it is
checked once: a trajectory with such a reward ends with stop reason ``reward_error`` (or
``env_error`` for an environment's step), named in its error, kept out of updates and
counted; its group's other members train, and no advantage is NaN.

A reward that is a `Fraction` of more digits than Python writes out (a user's exact-ratio
reward of a policy's 5,000-digit answer, an environment's): writing it into the error raised
AttributeError ("'Fraction' object has no attribute 'bit_length'"), so the reward function's
or the environment's error named jarl's own helper, and an environment's step ended its
episode ``agent_error`` rather than ``env_error``. It is the `RewardError` (an `EnvError` for
a step) naming the value's size."""

from __future__ import annotations

import asyncio
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, Environments, EnvStep, checked_step
from jax_agent_rl.rewards import (
    Answer,
    RewardError,
    checked_reward,
    load_reward,
)
from jax_agent_rl.rl import core
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import HermesParser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.episodes import episode_metrics
from jax_agent_rl.train.rollout_score import score_episodes
from tests.agent.test_loop import CONFIG

HERE = __file__


def nan_score(text: str, ground_truth: Any) -> float:
    del text, ground_truth
    return float("nan")


def huge_score(text: str, ground_truth: Any) -> float:
    del text, ground_truth
    return 1e308


def close_enough(text: str, ground_truth: Any) -> Any:
    """Whether the answer is the number, as NumPy says: a NumPy bool."""
    return np.isclose(float(text), float(ground_truth))


def mean_of_one(text: str, ground_truth: Any) -> Any:
    """A NumPy array of no dimensions: not a number."""
    del text, ground_truth
    return np.array(1.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    task = prepare(tmp_path_factory.mktemp("t"), ArithmeticTask(), n_train=4, n_val=2, n_sft=4)
    return Tokenizer.from_pretrained(task.model)


def test_a_bad_reward_ends_its_trajectory_not_its_group(tokenizer: Tokenizer) -> None:
    """Each member's reward comes from somewhere else: the reward function (right, wrong,
    NaN, 1e308, a string), an environment that owns the reward (its sum NaN), tool rewards
    whose weighted sum overflows to inf."""
    rules = {
        "nan": load_reward(f"{HERE}:nan_score", "data.reward"),
        "huge": load_reward(f"{HERE}:huge_score", "data.reward"),
    }
    checker = load_reward("math", "data.reward")

    async def score(answer: Answer) -> float:
        if answer.prompt == "text":
            return "high"  # type: ignore[return-value]  # a scorer that skips the registry
        rule = rules.get(answer.prompt, checker)
        return rule(answer.data_source, answer.text, answer.ground_truth, answer.extra)

    kinds = ["right", "wrong", "nan", "huge", "text", "env_nan", "tools_inf"]
    samples = [Sample(k, [{"role": "user", "content": k}], ground_truth="5") for k in kinds]
    trajs = [Trajectory(uid=k, group_id="g", prompt_ids=[1]) for k in kinds]
    for t in trajs:
        t.messages = [{"role": "assistant", "content": "<answer>5</answer>"}]
    trajs[1].messages = [{"role": "assistant", "content": "<answer>4</answer>"}]
    trajs[5].env_reward = math.nan  # an environment's own reward, summed from its steps
    trajs[6].turn_rewards = [1e308, 1e308]
    groups = [[t] for t in trajs]
    scored = asyncio.run(score_episodes(groups, samples, score, 1.0, tokenizer, success_reward=1.0))
    episodes = [e for g in scored for e in g]
    ok = {"right": 1.0, "wrong": 0.0}
    for e in episodes:
        if e.uid in ok:
            assert e.reward == ok[e.uid] and e.trainable and e.stop_reason == "eos"
            continue
        assert e.stop_reason == "reward_error" and not e.trainable, e.uid
        assert e.reward == 0.0 and not e.success
        assert e.error is not None and "reward" in e.error
    assert "nan_score" in str(episodes[2].error) and "nan" in str(episodes[2].error)
    assert "1e+308" in str(episodes[3].error) and "'high'" in str(episodes[4].error)
    assert "inf" in str(episodes[6].error)
    assert episode_metrics(episodes)["stop/reward_error"] == 5 / 7
    trained = [e.reward for e in episodes if e.trainable]
    adv = core.grpo_advantages(np.array(trained), np.zeros(len(trained), int), 1)
    assert np.isfinite(np.asarray(adv)).all()


class LastWord:
    """A native environment (a function of the sample in env.classes, no skyrl-gym adapter)
    whose reward is ``REWARD[kind]``: what parsing a model's last word as a float gives."""

    turns = "all"
    owns_reward = True

    def __init__(self, sample: Sample) -> None:
        self.reward = {"nan": float("nan"), "huge": 1e308, "text": "high", "fine": 1.0}[
            sample.uid.split("/")[0]
        ]

    async def reset(self, sample: Sample) -> list[dict[str, str]]:
        return list(sample.messages)

    async def step(self, text: str, messages: list[dict[str, str]]) -> EnvStep:
        del text, messages
        return EnvStep([], self.reward, True)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_native_environments_reward_is_checked_by_the_loop(setup: dict[str, Any]) -> None:
    backend = EmbeddedBackend(setup["engine"], setup["weights"])

    async def go() -> list[Trajectory]:
        envs = Environments({"last_word": LastWord})
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], tools, HermesParser(), CONFIG, envs=envs
        )
        runs = [
            run_sample(
                Sample(f"{k}/0", [{"role": "user", "content": "Hi"}], env_class="last_word"), ctx
            )
            for k in ("fine", "nan", "huge", "text")
        ]
        trajs = await asyncio.gather(*runs)
        await backend.close()
        return list(trajs)

    fine, *bad = asyncio.run(go())
    assert fine.stop_reason == "env_done" and fine.env_reward == 1.0
    for t, shown in zip(bad, ("nan", "1e+308", "'high'"), strict=True):
        # (the policy's last word made the step's reward fail: a wrong answer, trained on)
        assert t.stop_reason == "caused_error" and t.trainable, t.uid
        assert "last_word.step" in str(t.error) and shown in str(t.error)


def test_an_environment_step_reward_is_a_finite_number_in_range() -> None:
    for reward, problem in [
        (math.nan, "not a finite number"),
        (-math.inf, "not a finite number"),
        (1e308, "outside"),
        ("1", "expected a number"),
    ]:
        with pytest.raises(EnvError, match=problem):
            checked_step({"observations": [], "reward": reward, "done": True}, "env")
    assert checked_step(EnvStep([], -1e6, True), "env").reward == -1e6


def test_a_numpy_bool_is_a_reward_as_a_python_bool_is() -> None:
    """``np.isclose``'s answer scores as ``True`` does (before: every row was a reward error
    saying np.True_ is "not a finite number"); a value that is no number is named by its type."""
    close = load_reward(f"{HERE}:close_enough", "data.reward")
    assert (close("s", "5.0", "5", {}), close("s", "4", "5", {})) == (1.0, 0.0)
    array = load_reward(f"{HERE}:mean_of_one", "data.reward")
    with pytest.raises(
        RewardError, match=r"gave reward array\(1\.\), a ndarray: expected a number"
    ):
        array("s", "5", "5", {})


class UnprintableError(ValueError):
    """An exception whose message cannot be written (a library's error formatting a value it
    holds: a failing __str__)."""

    def __str__(self) -> str:
        raise RuntimeError("cannot format the value")


def unprintable_score(text: str, ground_truth: Any) -> float:
    del text, ground_truth
    raise UnprintableError


def test_a_reward_raising_an_error_that_cannot_be_written_ends_only_its_episode(
    tokenizer: Tokenizer,
) -> None:
    """Writing the reward error called the exception's __str__, whose own error left
    score_episodes: the step, and the run, failed for one episode's reward function."""
    rule = load_reward(f"{HERE}:unprintable_score", "data.reward")
    checker = load_reward("math", "data.reward")

    async def score(answer: Answer) -> float:
        fn = rule if answer.prompt == "odd" else checker
        return fn(answer.data_source, answer.text, answer.ground_truth, answer.extra)

    samples = [Sample(k, [{"role": "user", "content": k}], ground_truth="5") for k in ("odd", "ok")]
    trajs = [Trajectory(uid=s.uid, group_id="g", prompt_ids=[1]) for s in samples]
    for t in trajs:
        t.messages = [{"role": "assistant", "content": "<answer>5</answer>"}]
    groups = [[t] for t in trajs]
    scored = asyncio.run(score_episodes(groups, samples, score, 1.0, tokenizer, success_reward=1.0))
    episodes = [e for g in scored for e in g]
    odd, ok = episodes
    assert odd.stop_reason == "reward_error" and odd.reward == 0.0 and not odd.trainable
    assert "raised UnprintableError" in str(odd.error) and "unprintable_score" in str(odd.error)
    assert ok.stop_reason == "eos" and ok.reward == 1.0 and ok.trainable


@pytest.mark.parametrize(
    ("reward", "shown"),
    [
        (Fraction(10**5000, 3), "a Fraction of 16610-bit terms"),
        (Fraction(-(10**5000), 7), "a Fraction of 16610-bit terms"),
        (10**5000, "an int of 16610 bits"),
    ],
    ids=["fraction", "negative-fraction", "int"],
)
def test_a_reward_too_long_to_write_out_is_a_reward_error(reward: object, shown: str) -> None:
    with pytest.raises(RewardError, match=f"^mine gave reward {shown}: not a finite number$"):
        checked_reward(reward, "mine")
    step = EnvStep([{"role": "user", "content": "again"}], reward=reward, done=False)
    with pytest.raises(EnvError, match=f"^env.step gave reward {shown}: not a finite number$"):
        checked_step(step, "env")
    assert checked_reward(Fraction(10**5000 + 1, 10**5000), "mine") == 1.0  # (it converts)
