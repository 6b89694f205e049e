"""The trainer as a user runs it (`jarl train` in a subprocess): a run killed with SIGKILL,
while a checkpoint is being written and again in the middle of a step, resumes to exactly the
parameters of a run that was never interrupted; configs are validated before anything runs.
The task is the package's (tests/train/conftest.py), made once for every module here; the
runs here start from its SFT warm start (`warm`), made once for the module."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles
from jax_agent_rl.config import load_config
from jax_agent_rl.train import train
from jax_agent_rl.train.checkpoints import RunCheckpoints
from jax_agent_rl.train.metrics import read_metrics

# a 60-step SFT (once: `warm`) and RL steps in five runs: optimized code pays (when each run
# did its own SFT, compiled at O0 the file took 288 s of a suite run's CPU, 221 s optimized)
pytestmark = pytest.mark.compute_bound

ROOT = Path(__file__).resolve().parents[2]


def _command(task: TaskFiles, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "jax_agent_rl.cli", "train", str(DEMO_CONFIG),
        f"model.path={task.model}", f"data.train={task.train}", "data.val=",
        f"sft.data={task.sft}", f"tools.config={task.tools}", f"trainer.run_dir={run_dir}",
        "sft.steps=60", "sft.batch_size=16",
        "data.reward=format",  # a half-trained model gets the format right only sometimes
        "data.prompts_per_step=4", "group.n=4", "engine.max_model_len=128",
        "agent.max_response_tokens=64", "learner.micro_batch_size=16",
        "trainer.steps=3", "trainer.save_every=1", "trainer.eval_every=0",
        "trainer.tensorboard=false", "optim.lr=1e-3", "engine.warmup=false",
    ]  # fmt: skip


def _rl_command(task: TaskFiles, warm: Path, run_dir: Path) -> list[str]:
    """`_command`'s run without its SFT stage, from ``warm``, the policy that stage gives:
    RL from it is RL after that stage. The warm start is no part of what the tests here
    check, and each run repeated it (~30 s of CPU a run)."""
    return [*_command(task, run_dir), f"model.path={warm}", "sft.data=", "sft.steps=0"]


@pytest.fixture(scope="module")
def warm(task: TaskFiles, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`_command`'s SFT stage alone (no RL step): its policy, exported with the tokenizer."""
    run_dir = tmp_path_factory.mktemp("sft")
    train(load_config(DEMO_CONFIG, [*_command(task, run_dir)[5:], "trainer.steps=0"]))
    return run_dir / "hf"


def _complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _kill_when(cmd: list[str], ready: "callable[[], bool]", timeout: float = 600) -> None:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_and_resume_equals_an_uninterrupted_run(
    task: TaskFiles, warm: Path, tmp_path: Path
) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_rl_command(task, warm, whole), cwd=ROOT, check=True, capture_output=True)

    ckpts = killed / "checkpoints"
    # 1) killed while checkpoint 1 is being written (its temporary folder exists)
    _kill_when(
        _rl_command(task, warm, killed),
        lambda: ckpts.is_dir() and any(p.name.startswith("1.") for p in ckpts.iterdir()),
    )
    assert 1 not in _complete_steps(killed)  # never a half-written checkpoint 1
    assert RunCheckpoints(ckpts, 2).latest_step() == 0
    # 2) killed in the middle of step 3, right after checkpoint 2 is complete
    _kill_when(
        _rl_command(task, warm, killed), lambda: ckpts.is_dir() and 2 in _complete_steps(killed)
    )
    # 3) resume to the end
    done = subprocess.run(
        _rl_command(task, warm, killed), cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 2" in done.stdout

    a = load_file(whole / "hf" / "model.safetensors")
    b = load_file(killed / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    def train_records(run_dir: Path) -> dict[int, dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if r["phase"] == "train"}

    whole_m, killed_m = train_records(whole), train_records(killed)
    assert sorted(whole_m) == sorted(killed_m) == [1, 2, 3]
    for step in (1, 2, 3):  # the same episodes were sampled and scored
        assert whole_m[step]["reward"] == killed_m[step]["reward"]
        assert whole_m[step]["response_len/mean"] == killed_m[step]["response_len/mean"]
    assert any(whole_m[s]["grad_norm"] > 0 for s in (1, 2, 3))  # the updates did something

    # 4) the last checkpoint damaged afterwards (a copy cut short): resuming from it is one
    # line naming its step and folder, not orbax's traceback
    meta = whole / "checkpoints" / "3" / "meta" / "metadata"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    more = [*_rl_command(task, warm, whole), "trainer.steps=4"]
    done = subprocess.run(more, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"checkpoint of step 3 ({whole / 'checkpoints' / '3'})" in done.stderr.splitlines()[-1]


def test_dynamic_sampling_trains_only_groups_with_a_reward_signal(
    task: TaskFiles, warm: Path, tmp_path: Path
) -> None:
    """DAPO: groups whose rewards are all equal are dropped and refilled; only kept groups are
    trained. A half-trained model gets the answer format right only sometimes, so with the
    format reward some groups are mixed and some are not. Run as `jarl train`, as the runs
    above: the same process layout (two CPU devices), so that it loads the programs they
    compiled (in this process, on its eight devices, it compiled its own: ~120 s of CPU)."""
    n, want = 4, 4
    args = _rl_command(task, warm, tmp_path / "run")
    args += ["trainer.steps=2", "trainer.save_every=2", "group.dynamic_sampling=true"]
    args += ["group.max_refills=3", f"group.n={n}", f"data.prompts_per_step={want}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        kept, sampled = int(r["groups_kept"]), int(r["episodes_sampled"])
        assert 1 <= kept <= want  # refills ask only for the groups still missing
        assert r["batch/trajectories"] == kept * n  # the trained episodes: kept groups only
        assert sampled % n == 0 and sampled >= kept * n
    # some group was dropped and refilled (the seeds make this run the same every time)
    assert any(r["episodes_sampled"] > r["batch/trajectories"] for r in steps)


def test_dry_run_validates_configs(task: TaskFiles, capsys: pytest.CaptureFixture[str]) -> None:
    gsm8k = str(ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml")
    ok = [f"model.path={task.model}", f"data.train={task.train}", f"data.val={task.val}"]
    # the demo model's context is 512 tokens (the dry run compares the config's with it)
    assert main(["train", gsm8k, *ok, "engine.max_model_len=512", "--dry-run"]) == 0
    assert "adv_estimator: grpo" in capsys.readouterr().out
    assert main(["train", str(DEMO_CONFIG), *ok, f"sft.data={task.sft}", "--dry-run"]) == 0
    ppo = str(ROOT / "configs" / "demo_calculator_ppo_cpu.yaml")
    assert main(["train", ppo, *ok, f"sft.data={task.sft}", "--dry-run"]) == 0
    assert "adv_estimator: gae" in capsys.readouterr().out

    assert main(["train", gsm8k, *ok, "algorithm.clip_hihg=0.3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'algorithm.clip_hihg'" in err and "clip_high" in err
    assert main(["train", gsm8k, "model.path=/no/such/ckpt", ok[1], "--dry-run"]) == 2
    assert "model.path='/no/such/ckpt' does not exist" in capsys.readouterr().err
    assert main(["train", gsm8k, ok[0], f"data.train={task.model}/config.json", "--dry-run"]) == 2
    assert "expected a .jsonl or .parquet file" in capsys.readouterr().err
