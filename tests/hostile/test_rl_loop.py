"""The RL loop's bookkeeping of prompts, episodes and the batches it trains on, against a
dataset and a schedule that a run meets in its ordinary course.

- A batch of prompts that runs past an epoch's end can draw a row twice (`PromptSampler`: 7
  of 100 batches of 4 over 10 rows). The episodes of both were named by the row's uid and the
  step's tag alone, so they shared their uids, and with them their tool state: one episode's
  calls changed the other's (a sandbox's files, a counter), and the first to end released the
  other's state mid-episode, silently; a verl interaction, shared by every episode under its
  uid, started the second over the first and ended both at the first's end; they also shared
  their requests' seeds (the same tokens twice) and their group. The second draw now plays
  under a uid of its own (``<uid>~1``).
- A data row whose ``data_source`` holds ``#`` (``gsm8k#test``) names its episodes with it,
  and the traces mapped a batch's rows back to their trajectories by the uid before its first
  ``#`` (the marker of a trajectory's per-turn samples): such a traced episode got no learner
  signals (ratio, advantage, entropy in ``jarl view``), silently. The marker is the last ``#``."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import AGENT_LOOPS, register_agent_loop
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.data.datasets import PromptSampler
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import (
    Answer,
)
from jax_agent_rl.rl.batch import per_turn_samples, step_batch
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import Tool, ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.step import distinct_samples, rollout_episodes
from jax_agent_rl.train.traces import trace_index


class Counter(Tool):
    """A stateful tool: each call counts the calls of its trajectory's state."""

    def __init__(self) -> None:
        self.name = "counter"
        self.schema = {
            "type": "function",
            "function": {
                "name": "counter",
                "description": "Counts this trajectory's calls.",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> list[int]:
        del trajectory_id, create_kwargs
        return [0]

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        state[0] += 1
        return ToolResult(str(state[0]))


def _counting_loop(episodes: int) -> Any:
    """A user loop: a call of the counter, then (once ``episodes`` episodes have made theirs)
    another; its answer is the two counts."""
    first_calls: list[str] = []
    all_called = asyncio.Event()

    async def counting(sample: Sample, ctx: AgentContext) -> Trajectory:
        first = await ctx.tools.call(sample.uid, "counter", {})
        first_calls.append(sample.uid)
        if len(first_calls) == episodes:
            all_called.set()
        await all_called.wait()
        second = await ctx.tools.call(sample.uid, "counter", {})
        await ctx.tools.release(sample.uid)
        traj = Trajectory(uid=sample.uid, group_id=sample.group_id, prompt_ids=[1])
        traj.messages = [{"role": "assistant", "content": f"{first.text},{second.text}"}]
        traj.end("eos")
        return traj

    return counting


async def _unscored(answer: Answer) -> float:
    del answer
    return 0.0


def test_a_row_drawn_twice_for_a_step_plays_apart(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    rows = [Sample(f"r-{i}", [{"role": "user", "content": "2+2?"}], "4") for i in range(10)]
    sampler = PromptSampler(rows, seed=0)
    batches = [[s.uid for s in sampler.next_batch(4)] for _ in range(100)]
    twice = [b for b in batches if len(set(b)) < len(b)]
    assert len(twice) == 7  # (batches past an epoch's end drew a row again)
    row = dataclasses.replace(rows[1], agent_name="counting")
    register_agent_loop("counting", _counting_loop(episodes=4))
    try:
        tools = LocalTools(ToolRegistry([Counter()]))
        ctx = AgentContext(
            backend, tokenizer, tools, make_parser("hermes"), AgentConfig(), TurnBuilder(tokenizer)
        )
        trajs = asyncio.run(
            rollout_episodes(
                [row, row],
                2,
                ctx,
                "s3a0",
                seed=0,
                score=_unscored,
                tool_reward_weight=0.0,
                success_reward=1.0,
            )
        )
    finally:
        del AGENT_LOOPS["counting"]
    assert [(t.uid, t.group_id) for t in trajs] == [
        ("r-1/s3a0/0", "r-1"),
        ("r-1/s3a0/1", "r-1"),
        ("r-1~1/s3a0/0", "r-1~1"),
        ("r-1~1/s3a0/1", "r-1~1"),
    ]
    assert [e.traj.messages[-1]["content"] for e in trajs] == ["1,2"] * 4  # (each its own state)
    assert tools.open_trajectories == 0
    drawn: set[str] = set()  # (a step's refill, and a name a row may itself have)
    again = distinct_samples([rows[1], Sample("r-1~1", [], "4")], drawn)
    assert [s.uid for s in distinct_samples([rows[1]], drawn)] == ["r-1~2"]
    assert [s.uid for s in again] == ["r-1", "r-1~1"] and drawn == {"r-1", "r-1~1", "r-1~2"}


def test_a_traced_episode_whose_uid_holds_a_hash_is_found_in_the_batch() -> None:
    trajs = []
    for k in range(2):
        t = Trajectory(uid=f"gsm8k#test-{k}/s1a0/0", group_id=f"gsm8k#test-{k}", prompt_ids=[1, 2])
        t.append([10 + k, 11], model=True, logprobs=[-0.1, -0.2])
        t.append([5, 6], model=False)
        t.append([20 + k], model=True, logprobs=[-0.3])
        trajs.append(t)
    seqs = [t.train_sequence(0.0) for t in trajs]
    for rows in (seqs, [s for t in seqs for s in per_turn_samples(t)]):
        batch, _, _ = step_batch(
            rows, np.zeros(len(rows)), [r.group_id for r in rows], np.ones(len(rows)),
            mini_batches=1, row_tokens=32, bucket=8, rows_per_micro=2,
        )  # fmt: skip
        index = trace_index(batch, rows, trajs)
        targets = batch.targets.reshape(-1)
        for s, t in enumerate(trajs):
            for j, (token, m) in enumerate(zip(t.response_ids, t.loss_mask, strict=True)):
                if m or rows is seqs:  # (per-turn rows hold only the sampled tokens)
                    assert index[s, j] >= 0 and targets[index[s, j]] == token
