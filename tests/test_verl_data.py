"""verl users' data carries over: a row as verl writes it (agent_name ``single_turn_agent``,
data_source ``openai/gsm8k``, a GSM8K ground truth) loads, runs the loop it names and is scored
as verl scores it (verl's strict ``#### N`` rule on the whole decoded response; its parity with
verl's own function is tests/rewards/test_verl_parity.py); tool rewards (`ToolResult.reward`)
reach the reward the learner trains on, times ``data.tool_reward_weight``.

The trainer's own scoring function (`trajectory_reward`) is checked alone; then the trainer's
rollout runs on the real embedded engine with the tiny model `tests.agent.test_loop` memorises
(its ``setup`` fixture, chatml style), which calls the calculator and then answers 42.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import AGENT_LOOPS
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import JarlConfig, load_config
from jax_agent_rl.data.datasets import load_samples
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.base import Tool, ToolResult
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.learn import shaped_rewards
from jax_agent_rl.train.rollout_score import rollout_episodes, trajectory_reward
from tests.agent.test_loop import CONFIG, echo

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


def _config(*overrides: str) -> JarlConfig:
    return load_config(None, ["model.path=unused", "data.train=unused.jsonl", *overrides])


def _verl_row(index: int, ground_truth: str) -> dict[str, Any]:
    """A row of verl's gsm8k preprocessing, with the agent_name verl defaults to."""
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "single_turn_agent",
        "prompt": [{"role": "user", "content": "How many clips did Natalia sell? End with ####."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": index, "split": "train"},
    }


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    corpus = ["48 + 24 = 72.\n#### 72 <answer>7</answer>", GSM8K_SOLUTION]
    save_tokenizer(path, train_bpe(corpus, vocab_size=300), chat_template("chatml_tools"))
    return Tokenizer.from_pretrained(path)


def _answered(
    tok: Tokenizer, sample: Sample, text: str, turn_rewards: tuple[float, ...] = ()
) -> Trajectory:
    traj = Trajectory(
        uid=sample.uid,
        group_id=sample.uid,
        prompt_ids=[],
        messages=[*sample.messages, {"role": "assistant", "content": text}],
        turn_rewards=list(turn_rewards),
    )
    traj.append([*tok.encode(text), tok.token_id("<|im_end|>")], model=True)
    return traj


def test_a_verl_gsm8k_row_is_scored_as_verl_scores_it(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "train.parquet"
    rows = [_verl_row(0, "72"), _verl_row(1, GSM8K_SOLUTION)]  # verl's and GSM8K's own truth
    pq.write_table(pa.Table.from_pylist(rows), path)
    samples = load_samples(path, agents=AGENT_LOOPS, default_agent="single_turn_agent")
    assert [s.agent_name for s in samples] == ["single_turn_agent"] * 2
    cfg = _config()  # no reward configured: openai/gsm8k rows get verl's GSM8K rule
    score = make_reward(cfg.data)

    def reward(sample: Sample, text: str) -> float:
        traj = _answered(tok, sample, text)
        return asyncio.run(trajectory_reward(sample, traj, score, cfg.data.tool_reward_weight, tok))

    verls, whole_solution = samples
    assert reward(verls, "48 + 24 = 72.\n#### 72") == 1.0
    assert reward(verls, "48 + 24 = 71.\n#### 71") == 0.0
    assert reward(verls, "<answer>72</answer>") == 0.0  # verl's rule wants "#### 72"
    # verl compares the answer with the ground truth as a string: a whole solution never matches
    assert reward(whole_solution, "48 + 24 = 72.\n#### 72") == 0.0


@pytest.mark.parametrize(("weight", "reward"), [("0", 1.0), ("1", 1.75), ("2", 2.5)])
def test_tool_rewards_are_added_times_their_weight(
    weight: str, reward: float, tok: Tokenizer
) -> None:
    cfg = _config(f"data.tool_reward_weight={weight}")
    sample = Sample("s", [{"role": "user", "content": "7?"}], ground_truth="7")
    traj = _answered(tok, sample, "<answer>7</answer>", turn_rewards=(0.5, 0.25))  # 2 tool turns
    score = make_reward(cfg.data)
    weighted = trajectory_reward(sample, traj, score, cfg.data.tool_reward_weight, tok)
    assert asyncio.run(weighted) == reward


def tool_aware_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]
) -> float:
    """A verl reward function that uses the tool rewards the way verl hands them over."""
    del data_source
    return float(solution_str == ground_truth) + 0.1 * sum(extra_info["tool_rewards"])


def test_by_default_the_reward_function_decides_what_tool_rewards_count_as_in_verl(
    tok: Tokenizer,
) -> None:
    """verl's score is its reward function's alone (weight 0), and the function reads the tool
    rewards from ``extra_info["tool_rewards"]``, beside the row's own extra_info."""
    sample = Sample("s", [{"role": "user", "content": "7?"}], ground_truth="7", extra={"k": 1})
    traj = _answered(tok, sample, "7", turn_rewards=(0.5, 0.25))
    builtin = _config()
    assert builtin.data.tool_reward_weight == 0.0
    score = make_reward(builtin.data)
    unweighted = trajectory_reward(sample, traj, score, builtin.data.tool_reward_weight, tok)
    assert asyncio.run(unweighted) == 0.0
    verl_fn = _config("data.reward=tests.test_verl_data:tool_aware_score")
    with make_reward(verl_fn.data) as score:
        assert asyncio.run(trajectory_reward(sample, traj, score, 0.0, tok)) == pytest.approx(1.075)
    assert sample.extra == {"k": 1}  # the row's own extra_info is not changed


TOOL_REWARD = 0.25


class PaidCalculator(Tool):
    """The calculator (its name and schema, so the memorised model calls it), paying a tool
    reward on every call."""

    name = calculator.name
    schema = calculator.schema

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        result = await calculator.execute(state, arguments)
        return dataclasses.replace(result, reward=TOOL_REWARD)


def _trainer_rollout(setup: dict[str, Any], weight: float) -> tuple[list[Episode], np.ndarray]:
    """The trainer's rollout of two episodes of the calculator question, one with each of verl's
    loops; returns the trajectories and the rewards the learner's advantages are computed from."""
    cfg = _config(f"data.tool_reward_weight={weight}")
    question = [{"role": "user", "content": "What is 17 + 25?"}]
    samples = [
        Sample("tools", question, ground_truth="42", agent_name="tool_agent"),
        Sample("single", question, ground_truth="42", agent_name="single_turn_agent"),
    ]

    async def go() -> list[Episode]:
        backend = EmbeddedBackend(setup["engine"], setup["weights"])
        tools = LocalTools(ToolRegistry([PaidCalculator(), echo]))
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], tools, make_parser(setup["parser"]), CONFIG
        )
        # one sample at a time: decoded beside another sequence, a token's logprob moves by
        # ~1e-6 (the batch and attention length change the summation order), enough to flip
        # a greedy near-tie of the memorised model, and what runs beside what depends on timing
        trajs = [
            traj
            for sample in samples
            for traj in await rollout_episodes(
                [sample],
                1,
                ctx,
                "t",
                seed=cfg.trainer.seed,
                score=make_reward(cfg.data),
                tool_reward_weight=cfg.data.tool_reward_weight,
                success_reward=cfg.data.success_reward,
            )
        ]
        await backend.close()
        return trajs

    trajs = asyncio.run(go())
    return trajs, shaped_rewards(trajs, cfg)


CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)


@CHATML
def test_tool_rewards_reach_the_reward_the_learner_trains_on(setup: dict[str, Any]) -> None:
    for weight in (0.0, 2.0):
        (tools, single), learner_rewards = _trainer_rollout(setup, weight)
        # tool_agent: a calculator call (a tool reward), then the right <answer>
        assert tools.stop_reason == "eos" and tools.traj.tool_calls == 1
        assert tools.traj.turn_rewards == [TOOL_REWARD]
        assert tools.reward == 1.0 + weight * TOOL_REWARD
        # single_turn_agent: one model turn (the call is its last word), no tool runs
        assert single.stop_reason == "max_turns" and single.traj.num_turns == 1
        assert single.traj.tool_calls == 0 and single.traj.turn_rewards == []
        assert single.reward == 0.0
        np.testing.assert_array_equal(learner_rewards, [1.0 + weight * TOOL_REWARD, 0.0])
