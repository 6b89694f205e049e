"""The twenty-second adversarial pass (the one RL loop: `jax_agent_rl.train.async_loop`).

- A synchronous run whose dataset wraps an epoch between steps renamed a prompt drawn by the
  step before (``<uid>~1``: its request seeds with it), and a run resumed after that step,
  which had forgotten the uids drawn before, did not: the resumed run sampled other tokens
  and trained other parameters than the uninterrupted one. At max_staleness 0 an update only
  takes its own groups, so a prompt is renamed only against its own update's draws."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.demo import TaskFiles, demo_config, prepare
from jax_agent_rl.train import train
from jax_agent_rl.train.traces import read_traces
from tests.train.test_async import TINY


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    """A dataset of data.prompts_per_step prompts: every step after the first wraps an epoch."""
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=2, n_val=4, n_sft=60)


def _train(task: TaskFiles, run_dir: Path, *overrides: str) -> dict[int, dict[str, float]]:
    train(demo_config(run_dir, task, [*TINY, *overrides]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["phase"] == "train"}


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
