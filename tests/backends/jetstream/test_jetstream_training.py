"""`jarl train` with ``engine.backend=jetstream``: the demo config trains on trajectories that
JetStream's server sampled, the learner stands in for the logprobs it does not return, and the
step after a weight push samples under the pushed weights. (The server serving a LoRA policy,
its adapters pushed alone, is tests/conformance/test_lora_conformance.py's; `jarl train` with a
LoRA config on a server backend, tests/backends/vllm/test_training.py's.) A run whose server
is killed mid-step completes, every episode trained once."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.backends.jetstream.client import JetStreamBackend
from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, demo_config, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.train import train
from jax_agent_rl.train.traces import read_traces
from tests.processes import trained_through_one_restart

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=40, n_val=4, n_sft=60)


def test_demo_trains_with_jetstream_rollouts(task: TaskFiles, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "jax_agent_rl.cli", "train", str(DEMO_CONFIG),
        f"model.path={task.model}", f"data.train={task.train}", f"data.val={task.val}",
        f"sft.data={task.sft}", f"tools.config={task.tools}", f"trainer.run_dir={run_dir}",
        "engine.backend=jetstream", "sft.steps=2", "sft.batch_size=8",
        "data.prompts_per_step=2", "group.n=4", "engine.max_model_len=128",
        "engine.max_concurrent=8", "agent.max_response_tokens=64", "learner.micro_batch_size=8",
        "trainer.steps=2", "trainer.save_every=2", "trainer.eval_every=1",
        "trainer.tensorboard=false",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "evaluation samples so too, not greedily" in done.stdout  # said, not hidden

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["phase"] == "train"}
    assert sorted(train) == [1, 2]
    for step in (1, 2):
        m = train[step]
        assert 0.0 <= m["reward"] <= 1.0 and m["batch/trajectories"] == 8
        assert m["stop/aborted"] == 0
        assert m["rollout/logprobs_recomputed"] == 1.0  # the learner's stand in for JetStream's
        assert "logprob_gap/max" not in m  # no gap between a logprob and itself to report
        assert m["time/weight_push_s"] > 0
    assert {r["step"] for r in records if r["phase"] == "val"} == {0, 1, 2}
    # every turn of step k is sampled under the weights step k - 1 pushed (version k - 1)
    for step in (1, 2):
        traces = read_traces(run_dir / "traces.jsonl", step)
        assert traces and all(set(t["weight_versions"]) == {step - 1} for t in traces)
    assert (run_dir / "hf" / "model.safetensors").is_file()


def test_a_run_completes_when_its_jetstream_server_is_killed_mid_step(
    task: TaskFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server is SIGKILLed once the run's first stream is open (step 1's rollout): the
    backend starts it again with the weights last pushed and sends every request in flight
    again, so each step trains all 8 episodes (2 prompts x 4), none aborted or cut short, each
    turn under the weights of its step, and the metrics count the death, the restart and the
    requests sent again."""
    killed: list[int] = []
    read = JetStreamBackend._read

    def kill_then_read(self: JetStreamBackend, *args: Any) -> Any:
        if not killed:  # its request is in the server's hands: it dies with it in flight
            killed.append(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
        return read(self, *args)

    monkeypatch.setattr(JetStreamBackend, "_read", kill_then_read)
    cfg = demo_config(
        tmp_path / "run",
        task,
        [
            "engine.backend=jetstream", "sft.steps=2", "sft.batch_size=8", "data.val=",
            "data.prompts_per_step=2", "group.n=4", "engine.max_model_len=128",
            "engine.max_concurrent=8", "engine.warmup=false", "agent.max_response_tokens=64",
            "learner.micro_batch_size=8", "trainer.steps=2", "trainer.eval_every=0",
            "trainer.tensorboard=false", "trainer.traces_per_step=8",
        ],
    )  # fmt: skip
    run_dir = train(cfg)
    assert len(killed) == 1
    trained_through_one_restart(run_dir)
    for step in (1, 2):  # the restarted server served the weights of version 0, then 1
        traces = read_traces(run_dir / "traces.jsonl", step)
        assert traces and all(set(t["weight_versions"]) == {step - 1} for t in traces)
