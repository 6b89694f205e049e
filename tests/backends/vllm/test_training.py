"""`jarl train` with ``engine.backend=vllm``: the demo config (its engine process killed
mid-step: the run completes, every episode trained once), and its LoRA twin (vLLM pushed the
adapters alone, as PEFT folders), train on trajectories sampled by vLLM engine processes, and
the learner's recomputed logprobs match vLLM's on every token."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.backends.vllm.backend import VLLMBackend
from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, demo_config, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.protocol import FP32_LOGPROB_TOLERANCE
from jax_agent_rl.train import train
from tests.processes import trained_through_one_restart

ROOT = Path(__file__).resolve().parents[3]
LORA_CONFIG = DEMO_CONFIG.with_name("demo_calculator_lora_cpu.yaml")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=40, n_val=4, n_sft=60)


def test_the_lora_demo_trains_with_vllm_rollouts(task: TaskFiles, tmp_path: Path) -> None:
    """Through `jarl train` (the full model's run is the in-process one below)."""
    config, run_dir = LORA_CONFIG, tmp_path / "run"
    command = [
        sys.executable, "-m", "jax_agent_rl.cli", "train", str(config),
        f"model.path={task.model}", f"data.train={task.train}", "data.val=",
        f"sft.data={task.sft}", f"tools.config={task.tools}", f"trainer.run_dir={run_dir}",
        "engine.backend=vllm", "engine.kv_cache_gib=0.03125", "sft.steps=2", "sft.batch_size=8",
        "data.prompts_per_step=2", "group.n=4", "engine.max_model_len=128",
        "engine.max_concurrent=8", "agent.max_response_tokens=64", "learner.micro_batch_size=8",
        "trainer.steps=2", "trainer.save_every=2", "trainer.eval_every=0",
        "trainer.tensorboard=false",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["phase"] == "train"}
    assert sorted(train) == [1, 2]
    for step in (1, 2):  # step 2 samples under the weights step 1 pushed
        m = train[step]
        assert 0.0 <= m["reward"] <= 1.0 and m["batch/trajectories"] == 8
        assert m["stop/aborted"] == 0
        # token-exact: the learner scores exactly the tokens vLLM sampled (a shifted or
        # re-tokenized token would be off by whole nats, not by rounding)
        assert m["logprob_gap/max"] <= FP32_LOGPROB_TOLERANCE, m["logprob_gap/max"]
    assert (run_dir / "hf" / "model.safetensors").is_file()
    # the run's policy: its adapters, which vLLM was pushed
    assert (run_dir / "hf-adapter" / "adapter_config.json").is_file()


def test_the_demo_trains_with_vllm_rollouts_through_a_killed_engine(
    task: TaskFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo config on vLLM, its engine process SIGKILLed as the run's first request
    reaches it (step 1's rollout): the backend starts it again with the weights last pushed
    and sends it every request it had, so each step trains all 8 episodes (2 prompts x 4),
    none aborted or cut short, token-exact (the learner's logprobs within the fp32 bound of
    vLLM's), and the metrics count the death, the restart and the requests sent again."""
    killed: list[int] = []
    dispatch = VLLMBackend._dispatch

    def dispatch_and_kill(self: VLLMBackend, call: Any, ticket: Any) -> Any:
        engine = dispatch(self, call, ticket)
        if engine is not None and not killed:  # registered on it: in flight when it dies
            killed.append(engine.process.pid)
            os.kill(engine.process.pid, signal.SIGKILL)
        return engine

    monkeypatch.setattr(VLLMBackend, "_dispatch", dispatch_and_kill)
    cfg = demo_config(
        tmp_path / "run",
        task,
        [
            "engine.backend=vllm", "engine.kv_cache_gib=0.03125", "sft.steps=2",
            "sft.batch_size=8", "data.val=", "data.prompts_per_step=2", "group.n=4",
            "engine.max_model_len=128", "engine.max_concurrent=8",
            "agent.max_response_tokens=64", "learner.micro_batch_size=8", "trainer.steps=2",
            "trainer.eval_every=0", "trainer.save_every=2", "trainer.tensorboard=false",
            "trainer.traces_per_step=8",
        ],
    )  # fmt: skip
    run_dir = train(cfg)
    assert len(killed) == 1
    assert (run_dir / "hf" / "model.safetensors").is_file()
    for m in trained_through_one_restart(run_dir):
        assert m["logprob_gap/max"] <= FP32_LOGPROB_TOLERANCE, m["logprob_gap/max"]
