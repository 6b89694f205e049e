"""Reward functions that block or never return (a user function waiting on a service): each
runs in a worker process under ``data.reward_timeout_s``, so one that blocks holds no sibling
episode, and one that never returns ends its own episode with ``reward_error`` naming the
setting, the reward and the row, while the rest of the step is scored. What a function raises
in its worker reaches the step as it would from a thread. (A reasoning-gym scorer that a
policy's answer hangs for good: `test_hanging_scorers`.)

The slow function waits on a socket served by the test's event loop: every wait is on an
event, bounded; no test reads the clock."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from typing import Any

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.rollout_score import score_episodes

HERE = "tests.hostile.test_slow_rewards"
BOUND_S = 30.0  # how long a blocked reward waits for its release (the test fails past it)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    task = prepare(tmp_path_factory.mktemp("t"), ArithmeticTask(), n_train=4, n_val=2, n_sft=4)
    return Tokenizer.from_pretrained(task.model)


def blocking(text: str, ground_truth: Any) -> float:
    """1 for the answer "quick"; any other (the row's own answer, the ground truth, too: these
    tests' failures are the reward's, not the answer's, `test_answer_faults.py`) connects to the
    test's port (the ground truth) and waits for a byte there: 1 if it came, 0 if it waited out
    the bound."""
    if text == "quick":
        return 1.0
    with socket.create_connection(("127.0.0.1", ground_truth), timeout=BOUND_S) as entered:
        try:
            return float(entered.recv(1) == b"1")
        except TimeoutError:
            return 0.0


def first_over_five(text: str, ground_truth: Any) -> float:
    """1 for the answer "quick"; for "slow", the first number over 5 of none: the
    `StopIteration` of a `next` left without a default."""
    del ground_truth
    return 1.0 if text == "quick" else next(x for x in [1.0, 2.0] if x > 5)


def exiting(text: str, ground_truth: Any) -> float:
    """1 for the answer "quick"; for "slow", ``sys.exit``."""
    del ground_truth
    return 1.0 if text == "quick" else sys.exit("no answer")


def timing_out(text: str, ground_truth: Any) -> float:
    """1 for the answer "quick"; for any other, the `TimeoutError` of a service that did not
    answer (its own, at once)."""
    del ground_truth
    if text != "quick":
        raise TimeoutError("the service did not answer")
    return 1.0


def dying(text: str, ground_truth: Any) -> float:
    """1 for the answer "quick"; for "slow", its process ends at once (as a scorer's C code
    crashing on an answer ends it)."""
    del ground_truth
    return 1.0 if text == "quick" else os._exit(3)


def _score(
    tokenizer: Tokenizer, overrides: list[str], releaser: bool
) -> tuple[Episode, Episode, bool]:
    """The episodes "slow" and "quick", scored by `blocking` in one step, and whether the slow
    one entered its wait: a server on the event loop takes its connection and, with
    ``releaser``, releases it."""
    cfg = load_config(
        None, ["model.path=m", "data.train=t.jsonl", f"data.reward={HERE}:blocking", *overrides]
    )
    entered: list[bool] = []

    async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        entered.append(True)
        if releaser:
            writer.write(b"1")
            await writer.drain()

    async def go() -> list[Episode]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        samples = [
            Sample(f"row_{k}/0", [], ground_truth=port, data_source="s", group_id=f"row_{k}")
            for k in ("slow", "quick")
        ]
        groups = []
        for k in ("slow", "quick"):
            traj = Trajectory(uid=f"row_{k}/0", group_id=f"row_{k}", prompt_ids=[1])
            traj.messages = [{"role": "assistant", "content": k}]
            groups.append([traj])
        async with server:
            with make_reward(cfg.data) as score:
                scored = await score_episodes(
                    groups, samples, score, 0.0, tokenizer, success_reward=1.0
                )
        return [g[0] for g in scored]

    slow, quick = asyncio.run(go())
    return slow, quick, bool(entered)


def test_a_blocking_reward_holds_no_other_work_of_the_event_loop(tokenizer: Tokenizer) -> None:
    """While the slow reward blocks, the event loop runs on: its release comes from a task on
    the loop (before: the reward ran on the loop, so the release could not come until the
    reward gave up waiting, and scored 0)."""
    slow, quick, entered = _score(tokenizer, [], releaser=True)
    assert entered
    assert (slow.reward, slow.stop_reason) == (1.0, "eos")
    assert (quick.reward, quick.stop_reason) == (1.0, "eos")


def test_a_reward_that_never_returns_ends_only_its_episode(tokenizer: Tokenizer) -> None:
    """Past data.reward_timeout_s the slow episode ends with reward_error naming the setting,
    the reward and the row (its worker stopped); the quick one is scored (before: the step
    waited on it)."""
    slow, quick, entered = _score(tokenizer, ["data.reward_timeout_s=1"], releaser=False)
    assert entered  # it was running (not waiting for a worker) when it was stopped
    assert slow.stop_reason == "reward_error" and not slow.trainable
    assert slow.reward == 0.0 and not slow.success
    error = str(slow.error)
    assert "data.reward_timeout_s=1s" in error and f"data.reward='{HERE}:blocking'" in error
    assert "row 'row_slow'" in error
    assert (quick.reward, quick.stop_reason, quick.success) == (1.0, "eos", True)


@pytest.mark.parametrize(
    ("reward", "raised"), [("first_over_five", "StopIteration"), ("exiting", "SystemExit")]
)
def test_a_reward_raising_what_a_thread_cannot_pass_on_ends_only_its_episode(
    tokenizer: Tokenizer, reward: str, raised: str
) -> None:
    """A reward raising StopIteration (which an asyncio future refuses to hold) or SystemExit
    (which in a thread ends only that thread) ends its episode with reward_error naming it and
    the function at once (before: StopIteration was lost, and the episode waited out
    data.reward_timeout_s to be named a slow reward; SystemExit ended the run)."""
    overrides = [f"data.reward={HERE}:{reward}", f"data.reward_timeout_s={BOUND_S}"]
    slow, quick, _ = _score(tokenizer, overrides, releaser=False)
    assert slow.stop_reason == "reward_error" and slow.reward == 0.0 and not slow.success
    error = str(slow.error)
    assert raised in error and f"in {reward} " in error and "reward_timeout_s" not in error
    assert (quick.reward, quick.stop_reason, quick.success) == (1.0, "eos", True)


def test_a_reward_whose_process_dies_ends_only_its_episode(tokenizer: Tokenizer) -> None:
    """A reward function that ends its worker process (a crash in a scorer's C code) ends its
    episode with reward_error saying the worker died and how; the quick one is scored."""
    overrides = [f"data.reward={HERE}:dying", f"data.reward_timeout_s={BOUND_S}"]
    slow, quick, _ = _score(tokenizer, overrides, releaser=False)
    assert slow.stop_reason == "reward_error" and slow.reward == 0.0 and not slow.success
    assert "died during the call (exit status 3)" in str(slow.error)
    assert (quick.reward, quick.stop_reason, quick.success) == (1.0, "eos", True)


def test_a_reward_raising_timeout_error_is_not_called_late(tokenizer: Tokenizer) -> None:
    """A function's own TimeoutError is its error, named with the function, not a call past
    data.reward_timeout_s (before: it was reported as one)."""
    overrides = [f"data.reward={HERE}:timing_out", f"data.reward_timeout_s={BOUND_S}"]
    slow, quick, _ = _score(tokenizer, overrides, releaser=False)
    assert slow.stop_reason == "reward_error" and slow.reward == 0.0
    error = str(slow.error)
    assert "TimeoutError: the service did not answer in timing_out " in error
    assert "reward_timeout_s" not in error
    assert (quick.reward, quick.stop_reason, quick.success) == (1.0, "eos", True)
