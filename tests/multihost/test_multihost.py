"""Multi-process runs on one machine, as on a pod: 2 processes x 4 CPU devices (gloo
collectives over loopback) against 1 process x 8 devices, started with `jarl train`'s own
flags (``--coordinator``, ``--num-processes``, ``--process-id``: what `launch/gpu.sh --nodes`
runs on every node, and ``--distributed`` on a TPU slice differs only in where JAX reads them).

Each process is a real OS process; the tests wait on process exits and on files the run writes
(a checkpoint appearing), never on sleeps, with generous bounds only against a hang.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.cli.demo import TaskFiles, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.train.metrics import read_metrics
from tests.multihost.faulty import FAIL_HERE

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_calculator_cpu.yaml"
WORKER = Path(__file__).with_name("learner_worker.py")
HANG_S = 900  # a bound against a hung run only: each run here takes about a minute
# fp32 sums in another order (micro-batch rows gathered over processes): the learner's own
# tolerance between layouts. The steps move parameters by ~lr = 1e-3 each, 100x more.
PARAM_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=64, n_val=8, n_sft=64)


def tiny(task: TaskFiles, run_dir: Path, steps: int) -> list[str]:
    """The demo config shrunk to the tiny checkpoint, on a data=2 x fsdp=4 mesh: 8 devices,
    whole micro-batches of 8 rows (4 per process), 8 decode slots (4 per process). Tests that
    check no held-out figure and nothing of SFT (the first test checks its update) add
    `RL_ONLY`: no evaluation before the first step and after the last (its episodes are waited
    on by every process), and no SFT (its program, compiled in each process, took half of
    such a run)."""
    return [
        f"model.path={task.model}", "model.tokenizer=", f"data.train={task.train}",
        f"data.val={task.val}", "data.val_size=4", f"sft.data={task.sft}", "sft.steps=2",
        "sft.batch_size=8", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        "trainer.eval_every=0", "trainer.save_every=1", "trainer.keep_checkpoints=10",
        "trainer.tensorboard=false", "mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1",
        "group.n=4", "data.prompts_per_step=4", "engine.max_model_len=192",
        "engine.max_concurrent=8", "agent.max_tokens_per_turn=32",
        "agent.max_response_tokens=96", "agent.max_tool_response_tokens=16",
        "learner.micro_batch_size=8", "learner.seq_bucket=64", "algorithm.mini_batches=2",
        "engine.warmup=false",
    ]  # fmt: skip


RL_ONLY = ["data.val=", "sft.data="]

SLURM_PORTS = range(61440, 65536)  # where JAX puts a SLURM job's coordinator


def free_port(ports: range | None = None) -> int:
    """A port nothing listens on: any (the kernel's pick), or one of ``ports``."""
    for port in random.sample(ports, 64) if ports else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port in {ports}")


def start(
    argv: Sequence[str],
    processes: int,
    logs: Path,
    slurm: bool = False,
    cwds: Sequence[Path] | None = None,
    envs: Sequence[dict[str, str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """``argv`` once per process, joined through a coordinator on loopback (``processes`` 1:
    a plain single-process run); each process's output to ``logs.<id>``. The processes get
    ``--coordinator``, ``--num-processes`` and ``--process-id``; with ``slurm``, instead,
    ``--distributed`` and the environment of a SLURM job step, which JAX reads. ``cwds``: each
    process's working directory (default: the repository), as hosts differ; ``envs``: each
    process's own environment variables."""
    port = free_port(SLURM_PORTS if slurm else None)
    group = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    procs = []
    for i in range(processes):
        flags = [*group, "--process-id", str(i)] if processes > 1 else []
        env = dict(os.environ) | (envs[i] if envs else {})
        if slurm:
            flags = ["--distributed"]
            env |= {
                "SLURM_JOB_ID": str(port - SLURM_PORTS.start),  # JAX's port: 61440 + id % 4096
                "SLURM_STEP_NODELIST": "127.0.0.1",
                "SLURM_NTASKS": str(processes),
                "SLURM_PROCID": str(i),
                "SLURM_LOCALID": str(i),
            }
        with Path(f"{logs}.{i}").open("wb") as out:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [*argv, *flags],
                    cwd=cwds[i] if cwds else ROOT,
                    env={**env, "PYTHONPATH": str(ROOT)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def finish(procs: Sequence[subprocess.Popen[bytes]]) -> list[int]:
    try:
        return [p.wait(timeout=HANG_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def jarl_train(overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "jax_agent_rl.cli", "train", str(CONFIG), *overrides]


def log(logs: Path, i: int) -> str:
    return Path(f"{logs}.{i}").read_text(errors="replace")


def params_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_two_processes_train_as_one_with_eight_devices(task: TaskFiles, tmp_path: Path) -> None:
    """The same SFT warm start and two RL steps on the same trajectories (no rollout
    randomness), with 2 mini-batches each: parameters equal within fp32 reduction order."""
    outs = {}
    for processes in (2, 1):
        out = tmp_path / f"params-{processes}.npz"
        argv = [
            sys.executable,
            str(WORKER),
            str(out),
            *tiny(task, tmp_path / f"run-{processes}", 2),
        ]
        if processes == 1:  # the rows in the order 2 processes lay them out (mini-batches)
            argv += ["--rows-as-processes", "2"]
        logs = tmp_path / f"log-{processes}"
        codes = finish(start(argv, processes, logs))
        assert codes == [0] * processes, log(logs, 0)[-3000:]
        outs[processes] = params_of(out)
    two, one = outs[2], outs[1]
    assert two.keys() == one.keys()
    for key in two:
        assert np.abs(two[key] - one[key]).max() <= PARAM_TOLERANCE, key
    moved = max(
        float(np.abs(one[k] - one[k.replace("end/", "start/")]).max())
        for k in one
        if k.startswith("end/")
    )
    assert moved >= 100 * PARAM_TOLERANCE  # the RL steps really moved the parameters


def test_jarl_train_distributed_in_a_slurm_job_step(task: TaskFiles, tmp_path: Path) -> None:
    """``--distributed`` (what `launch/tpu_pod.sh` runs on every TPU worker) takes the
    processes from the environment; here a SLURM job step's, one process per device (JAX's
    SLURM convention), so each process's engine serves on a single device."""
    run = tmp_path / "run"
    overrides = [*tiny(task, run, 2), "mesh.data=1", "mesh.fsdp=2", *RL_ONLY]
    logs = tmp_path / "log"
    codes = finish(start(jarl_train(overrides), 2, logs, slurm=True))
    assert codes == [0, 0], log(logs, 0)[-3000:] + log(logs, 1)[-3000:]
    assert "run folder" in log(logs, 0)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "train"] == [1, 2]


def test_a_process_that_fails_is_named_by_the_others(task: TaskFiles, tmp_path: Path) -> None:
    """Process 1's own error (its reward function raises): it prints its traceback and reports
    the error at once; process 0, whose collective then fails, names process 1 and that
    error rather than calling it dead."""
    overrides = [
        *tiny(task, tmp_path / "run", 2),
        "data.reward=tests.multihost.faulty:fails_on_process_1",
        *RL_ONLY,
    ]
    logs = tmp_path / "log"
    codes = finish(start(jarl_train(overrides), 2, logs, envs=[{}, {FAIL_HERE: "1"}]))
    assert codes == [1, 1]
    failure = "HostFailure: the reward failed on purpose on process 1"
    assert f"process 1 of 2 failed: {failure} (its log has the traceback)" in log(logs, 0)
    assert "Traceback" in log(logs, 1)
    assert f"process 1 of 2 failed: {failure} (the traceback above)" in log(logs, 1)


def test_a_file_missing_on_one_host_stops_every_host(task: TaskFiles, tmp_path: Path) -> None:
    """The config's checks run on every process and are shared: relative paths that exist on
    process 0's host (working directory) only stop both processes, each naming process 1."""
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
    (hosts[0] / "train.jsonl").write_bytes(task.train.read_bytes())
    overrides = [*tiny(task, tmp_path / "run", 1), "data.train=train.jsonl"]
    logs = tmp_path / "log"
    codes = finish(start(jarl_train(overrides), 2, logs, cwds=hosts))
    assert codes == [2, 2]
    for i in range(2):
        assert "jarl: on process 1: data.train='train.jsonl' does not exist" in log(logs, i)


def test_a_run_folder_not_shared_by_every_host_is_refused(task: TaskFiles, tmp_path: Path) -> None:
    """All processes write the checkpoints, so trainer.run_dir must be one folder for all; a
    relative one under different working directories (as on hosts' own disks) is not."""
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
    logs = tmp_path / "log"
    codes = finish(start(jarl_train(tiny(task, Path("run"), 1)), 2, logs, cwds=hosts))
    assert codes == [1, 1]
    refusal = "trainer.run_dir=run is not one folder shared by every host: process 1 does not see"
    assert refusal in log(logs, 0) and refusal in log(logs, 1)
    assert not (hosts[1] / "run" / "checkpoints" / "0").exists()


def wait_for(path: Path, procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Until ``path`` exists (the run got there), or a process ended (it never will)."""
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        assert all(p.poll() is None for p in procs), "a process ended before the checkpoint"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


# The killed run's steps: process 1 is killed once the checkpoint of step 1 is complete, so
# the rerun has one or two left (a kill that late by more than a step would fail the test). Each
# step of a 2-process rerun is costly: process 1 compiles its engine's programs in every run
# (JAX writes the compilation cache from process 0 only) and meets new sequence lengths each
# step; the rerun's steps 3 and 4 of 4 took 62 s and 34 s here, under load.
STEPS = 3


def test_a_killed_process_is_named_the_rerun_resumes_and_one_process_goes_on(
    task: TaskFiles, tmp_path: Path
) -> None:
    """The whole loop with rollouts on 2 processes. Process 1 dies (SIGKILL, as a host does)
    once the checkpoint of step 1 is complete: process 0 stops with a message naming process 1.
    The same command rerun resumes from the last complete checkpoint and finishes: process 0
    alone writes metrics (each step once, with the episodes of both), traces, plots and the
    export; both write the checkpoints, from which 1 process with 8 devices goes on (the arrays'
    shapes do not depend on the process count, only their layout)."""
    run = tmp_path / "run"
    overrides = [*tiny(task, run, STEPS), "trainer.eval_every=2", "sft.data="]
    argv = [*jarl_train(overrides), "--heartbeat-timeout", "30"]
    logs = tmp_path / "log"
    procs = start(argv, 2, logs)
    try:
        wait_for(run / "checkpoints" / "1", procs)
        procs[1].send_signal(signal.SIGKILL)
    finally:
        codes = finish(procs)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0
    # ours, when the survivor meets the loss in a collective (the usual case); the JAX
    # distributed service's, when it was waiting on the service itself (a checkpoint barrier)
    named = r"process 1 of 2 stopped responding|Task 1 heartbeat timeout|heartbeats\):\s*1\b"
    assert re.search(named, log(logs, 0)), log(logs, 0)[-3000:]
    saved = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert 1 <= saved < STEPS

    before = len((run / "metrics.jsonl").read_text().splitlines())
    logs = tmp_path / "rerun"
    codes = finish(start(argv, 2, logs))
    assert codes == [0, 0], log(logs, 0)[-3000:] + log(logs, 1)[-3000:]
    assert f"resumed from the checkpoint of step {saved}" in log(logs, 0)
    lines = (run / "metrics.jsonl").read_text().splitlines()[before:]
    records = [json.loads(line) for line in lines]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == list(range(saved + 1, STEPS + 1))
    assert all(r["episodes_sampled"] == 16 and r["batch/trajectories"] <= 16 for r in train)
    assert [r["step"] for r in records if r["phase"] == "val"][-1] == STEPS
    assert (run / "traces.jsonl").is_file() and (run / "reward.png").is_file()
    assert (run / "hf" / "model.safetensors").is_file()
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        *range(STEPS + 1)
    ]
    last = f"step {STEPS}/{STEPS}"
    assert last in log(logs, 0) and "run folder" in log(logs, 0)
    assert last not in log(logs, 1) and "run folder" not in log(logs, 1)

    overrides = [*tiny(task, run, STEPS + 1), "trainer.eval_every=0", "sft.data="]
    codes = finish(start(jarl_train(overrides), 1, tmp_path / "one"))
    assert codes == [0], log(tmp_path / "one", 0)[-3000:]
    assert f"resumed from the checkpoint of step {STEPS}" in log(tmp_path / "one", 0)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl", "train")]
    assert steps == [*range(1, STEPS + 2)]
