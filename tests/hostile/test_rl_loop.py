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
  signals (ratio, advantage, entropy in ``jarl view``), silently. The marker is the last ``#``.
- A synchronous run whose dataset wraps an epoch between steps renamed a prompt drawn by the
  step before (``<uid>~1``: its request seeds with it), and a run resumed after that step,
  which had forgotten the uids drawn before, did not: the resumed run sampled other tokens
  and trained other parameters than the uninterrupted one. At max_staleness 0 an update only
  takes its own groups, so a prompt is renamed only against its own update's draws.
- The step's hooks got only the groups its update trained on: under dynamic sampling a
  reward that raised on most rows warned "75% of episodes ended reward_error" with no
  example of what raised (the groups it dropped held them all), and traced nothing; the
  synchronous loop handed them every episode it sampled, which they get again (all but the
  stale ones, in async mode).
- In async mode the next version's groups were granted only when the next update began,
  after the step's hooks, not when the push landed (docs/async.md: they may start once the
  policy is max_staleness versions behind them): rollouts starved while a held-out
  evaluation or a checkpoint ran. And the last updates granted groups for versions past
  trainer.steps, which no update trains on (the final push of a pinned schedule waited for
  them, and a later resume with more steps skipped their prompts)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from safetensors.numpy import load_file

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import AGENT_LOOPS, register_agent_loop
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import TaskFiles, demo_config, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
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
from jax_agent_rl.train import Hook, Rollout, Run, StepEnd, build_run, rl_loop, train
from jax_agent_rl.train.producer import Producer
from jax_agent_rl.train.rollout_score import distinct_samples, rollout_episodes
from jax_agent_rl.train.traces import read_traces, trace_index
from tests.train.test_async import TINY


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


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    """A dataset of data.prompts_per_step prompts: every step after the first wraps an epoch."""
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=2, n_val=4, n_sft=60)


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["phase"] == "train"}


def _train(task: TaskFiles, run_dir: Path, *overrides: str) -> dict[int, dict[str, float]]:
    train(demo_config(run_dir, task, [*TINY, *overrides]))
    return _metrics(run_dir)


def test_a_resumed_synchronous_run_is_the_uninterrupted_one_past_an_epoch(
    two_prompts: TaskFiles, tmp_path: Path
) -> None:
    """Two prompts, two a step: step 2 draws step 1's prompts again. Resumed after step 1, the
    run plays and trains step 2 as the uninterrupted run does."""
    same = ["engine.batch_buckets=false", "trainer.save_every=1"]
    whole = _train(two_prompts, tmp_path / "whole", *same, "trainer.steps=2")
    _train(two_prompts, tmp_path / "resumed", *same, "trainer.steps=1")
    resumed = _train(two_prompts, tmp_path / "resumed", *same, "trainer.steps=2")
    uids = [
        sorted(r["uid"] for r in read_traces(tmp_path / name / "traces.jsonl", 2))
        for name in ("whole", "resumed")
    ]
    assert uids[0] == uids[1]
    for key in ("reward", "response_len/mean", "grad_norm"):
        assert whole[2][key] == resumed[2][key], key
    a = load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "hf" / "model.safetensors"))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_step_reports_the_groups_dynamic_sampling_dropped(tmp_path: Path) -> None:
    """Dynamic sampling, a reward that raises on three rows of four and gives the fourth no
    signal: every group is dropped. The step's console warning still shows what raised (an
    episode of those it sampled), and its traces show them, as the synchronous loop's did
    before the one loop handed the hooks only the groups an update trained on."""
    task = prepare(tmp_path / "task", ArithmeticTask(), n_train=4, n_val=4, n_sft=60)
    first = json.loads(Path(task.train).read_text().splitlines()[0])
    kept = first["reward_model"]["ground_truth"]
    reward = tmp_path / "some_raise.py"
    reward.write_text(
        "def score(text, ground_truth):\n"
        f"    if ground_truth != {kept!r}:\n"
        "        raise ValueError('no score for this row')\n"
        "    return 0.0\n"
    )
    out = io.StringIO()
    cfg = demo_config(
        tmp_path / "run",
        task,
        [
            *TINY,
            "trainer.steps=1",
            "data.prompts_per_step=4",
            "learner.micro_batch_size=16",
            "group.dynamic_sampling=true",
            "group.max_refills=0",
            f"data.reward={reward}:score",
        ],
    )
    train(cfg, Console(file=out, force_terminal=False, width=1000))
    m = _metrics(tmp_path / "run")[1]
    assert m["async/groups_no_signal"] == 4 and m["batch/trajectories"] == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("step 1/1"))
    assert "75% of episodes ended reward_error (e.g. reward error:" in line, line
    assert "no score for this row" in line, line
    assert len(read_traces(tmp_path / "run" / "traces.jsonl", 1)) == 8


def _producer(max_staleness: int) -> Producer:
    trainer = types.SimpleNamespace(max_staleness=max_staleness)
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=trainer))
    return Producer(run, None, None, 0, None)  # type: ignore[arg-type]  # (_distinct reads cfg)


def test_prompts_that_one_update_may_take_together_are_renamed_apart() -> None:
    """max_staleness 2: update 2 may take a refill of update 0's (sampled at version 0) and
    the groups of update 4 (granted when update 2 begins). Drawn for both, a prompt was
    renamed only within 3 versions, so both groups were ``a``: one group in the update."""
    p = _producer(2)
    a = Sample("a", [])
    for version in (0, 1, 2):
        p._distinct([Sample("x", [])], version)
    assert [s.uid for s in p._distinct([a], 0)] == ["a"]  # update 0's refill
    p._distinct([Sample("y", [])], 3)
    assert [s.uid for s in p._distinct([a], 4)] == ["a~1"]
    # synchronous (max_staleness 0): an update takes only its own groups; the next update's
    # "a" stays "a" (as in a resumed run, which never drew the last one's)
    p = _producer(0)
    assert [s.uid for s in p._distinct([a, a], 0)] == ["a", "a~1"]
    assert [s.uid for s in p._distinct([a], 1)] == ["a"]


def test_async_groups_start_once_the_push_lands_not_after_the_hooks(tmp_path: Path) -> None:
    """max_staleness 1: once update 1 is pushed (the policy at version 1) the groups of update
    2 may start (docs/async.md, admission), while the step's hooks (a held-out evaluation, a
    checkpoint) run. They were granted only when the next update began, after the hooks:
    the engine went without new groups for as long as the hooks took. (At max_staleness 0
    they still wait for the hooks: a checkpoint never holds the next step's prompts.) And no
    groups are granted for updates past trainer.steps."""
    task = prepare(tmp_path / "task", ArithmeticTask(), n_train=40, n_val=4, n_sft=60)
    drawn: dict[str, list[int]] = {}
    for mode in ("async", "sync"):
        cfg = demo_config(
            tmp_path / mode,
            task,
            [*TINY, "trainer.steps=3", f"trainer.max_staleness={int(mode == 'async')}"],
        )
        run, state = build_run(cfg, Console(quiet=True))

        async def hook(run: Run, rollout: Rollout, end: StepEnd, mode: str = mode) -> None:
            del rollout, end
            await asyncio.sleep(0.5)  # (a hook's work: the producer runs meanwhile)
            drawn.setdefault(mode, []).append(run.sampler.state()["position"])

        try:
            asyncio.run(rl_loop(run, state, [Hook(1, hook)]))
        finally:
            run.checkpoints.close()
            run.metrics.close()
    # 2 prompts an update: after update 1, those of updates 1 to 3 (async), of update 1
    # (sync); none past update 3, the last (no update would train on them: they were drawn,
    # 8 prompts, and the final push of a pinned schedule waited for their groups)
    assert drawn == {"async": [6, 6, 6], "sync": [2, 4, 6]}
