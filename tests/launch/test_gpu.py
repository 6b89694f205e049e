"""launch/gpu.sh plans a CUDA node's GPUs between the learner and the vLLM engines."""

import importlib.metadata
import subprocess
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU_SH = ROOT / "launch" / "gpu.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(GPU_SH), *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_dry_run_splits_the_gpus() -> None:
    out = _run("--gpus", "8", "--learner-gpus", "4", "--dry-run", "cfg.yaml", "trainer.steps=5")
    assert out.returncode == 0, out.stderr
    assert "learner on GPUs 0,1,2,3 (mesh.data=4)" in out.stdout
    assert "4 vLLM engine(s) of 1 GPU(s) each per node on GPUs 4,5,6,7" in out.stdout
    run = next(line for line in out.stdout.splitlines() if line.startswith("run:"))
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in run and "train cfg.yaml engine.backend=vllm" in run
    assert "engine.vllm.replicas=4 engine.vllm.devices=4,5,6,7" in run and run.endswith("steps=5")


def test_ray_refusals_name_the_flag() -> None:
    """(Placing engines on a Ray cluster, dry run: tests/rollout/test_ray.py, on a cluster.)"""
    no_replicas = _run("--gpus", "2", "--ray", "auto", "--dry-run", "cfg.yaml")
    assert no_replicas.returncode == 2 and "--ray needs --replicas" in no_replicas.stderr
    split = _run("--gpus", "2", "--ray", "auto", "--replicas", "2", "--learner-gpus", "1",
                 "--dry-run", "cfg.yaml")  # fmt: skip
    assert split.returncode == 2 and "drop --learner-gpus" in split.stderr
    stray = _run("--gpus", "2", "--replicas", "2", "--dry-run", "cfg.yaml")
    assert stray.returncode == 2 and "--replicas goes with --ray" in stray.stderr


def test_refuses_a_node_without_room_for_an_engine() -> None:
    out = _run("--gpus", "1", "--dry-run", "cfg.yaml")
    assert out.returncode == 2 and "cannot hold" in out.stderr


def test_dry_run_on_two_nodes_prints_each_nodes_process() -> None:
    """One learner process per node, joined through node 0's coordinator: the flags
    `jarl train` takes (the multi-process tests start processes with the same ones); the mesh
    spans both nodes' learner GPUs; each node keeps its own vLLM engines."""
    out = _run(
        "--gpus", "8", "--nodes", "2", "--coordinator", "10.0.0.2:8476", "--dry-run", "cfg.yaml"
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "(mesh.data=8 over 2 nodes)" in out.stdout
    nodes = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    assert len(nodes) == 2
    for rank, line in enumerate(nodes):
        assert line.startswith(f"node {rank}: env CUDA_VISIBLE_DEVICES=0,1,2,3 ")
        assert "-m jax_agent_rl.cli train cfg.yaml engine.backend=vllm" in line
        assert "engine.vllm.replicas=4 engine.vllm.devices=4,5,6,7" in line
        assert "mesh.data=8" in line
        assert line.endswith(f"--coordinator 10.0.0.2:8476 --num-processes 2 --process-id {rank}")


def test_a_node_runs_only_its_own_rank() -> None:
    out = _run(
        "--gpus", "4", "--nodes", "3", "--node-rank", "2", "--coordinator", "h:1", "--dry-run",
        "cfg.yaml", "trainer.steps=5",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = next(line for line in out.stdout.splitlines() if line.startswith("run:"))
    assert "mesh.data=6 trainer.steps=5 --coordinator h:1 --num-processes 3 --process-id 2" in run


def test_multi_node_refusals_name_the_missing_flag() -> None:
    no_coordinator = _run("--gpus", "2", "--nodes", "2", "--node-rank", "0", "cfg.yaml")
    assert no_coordinator.returncode == 2 and "--coordinator" in no_coordinator.stderr
    no_rank = _run("--gpus", "2", "--nodes", "2", "--coordinator", "h:1", "cfg.yaml")
    assert no_rank.returncode == 2 and "--node-rank" in no_rank.stderr
    bad_rank = _run("--gpus", "2", "--nodes", "2", "--node-rank", "2", "--coordinator", "h:1",
                    "--dry-run", "cfg.yaml")  # fmt: skip
    assert bad_rank.returncode == 2 and "not in 0 .. 1" in bad_rank.stderr
    ray = _run("--gpus", "2", "--nodes", "2", "--coordinator", "h:1", "--ray", "x", "--replicas",
               "1", "cfg.yaml")  # fmt: skip
    assert ray.returncode == 2 and "one per node" in ray.stderr


def test_dry_run_gives_each_engine_its_tensor_parallel_gpus() -> None:
    """Engine i takes GPUs i*T .. i*T+T-1 of the engine GPUs (the backend groups
    engine.vllm.devices T by T, tests/backends/vllm)."""
    out = _run(
        "--gpus", "8", "--learner-gpus", "2", "--tensor-parallel", "3", "--dry-run", "c.yaml"
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "2 vLLM engine(s) of 3 GPU(s) each per node on GPUs 2,3,4,5,6,7" in out.stdout
    run = next(line for line in out.stdout.splitlines() if line.startswith("run:"))
    assert "engine.vllm.replicas=2 engine.vllm.devices=2,3,4,5,6,7" in run
    assert "engine.vllm.tensor_parallel_size=3" in run
    uneven = _run("--gpus", "8", "--tensor-parallel", "3", "--dry-run", "c.yaml")
    assert uneven.returncode == 2
    assert "the 4 engine GPUs do not split into --tensor-parallel 3 groups" in uneven.stderr
    bad = _run("--gpus", "8", "--tensor-parallel", "0", "--dry-run", "c.yaml")
    assert bad.returncode == 2 and "not a positive count" in bad.stderr
    ray = _run("--gpus", "2", "--ray", "auto", "--replicas", "2", "--engine-gpus", "1",
               "--tensor-parallel", "2", "--dry-run", "c.yaml")  # fmt: skip
    assert ray.returncode == 2 and "an engine shards over all its GPUs" in ray.stderr


def test_a_node_without_cuda_jax_gets_the_locked_one() -> None:
    """This host's .venv has no CUDA plugin: the plan names the setup a run does first."""
    out = _run("--gpus", "2", "--dry-run", "c.yaml")
    assert out.returncode == 0, out.stderr
    assert "setup: scripts/setup.sh cuda (.venv has no CUDA JAX" in out.stdout
    assert "bash scripts/setup.sh cuda" in GPU_SH.read_text()


def test_the_cuda_lock_pins_the_runtime_of_the_locked_jax() -> None:
    """requirements/cuda-lock.txt (`scripts/setup.sh cuda`) holds what jax[cuda12] asks for at
    the locked jax version: its plugin (and the plugin's PJRT, the same release)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "add_to_venv cuda requirements/cuda-lock.txt jax_plugins.xla_cuda12" in setup
    lock = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    (jax_version,) = [line.removeprefix("jax==") for line in lock if line.startswith("jax==")]
    assert importlib.metadata.version("jax") == jax_version
    wanted = {
        (r := Requirement(line)).name: r
        for line in importlib.metadata.requires("jax") or []
        if 'extra == "cuda12"' in line
    }
    lines = (ROOT / "requirements" / "cuda-lock.txt").read_text().splitlines()
    entries = [line.split("==") for line in lines if line and not line.startswith("#")]
    pins = dict(entries)
    assert len(pins) == len(entries)  # one pin per package
    assert wanted["jax-cuda12-plugin"].specifier.contains(pins["jax-cuda12-plugin"])
    assert wanted["jaxlib"].specifier.contains(jax_version)
    assert pins["jax-cuda12-pjrt"] == pins["jax-cuda12-plugin"]
    assert all(name.startswith("nvidia-") and name.endswith("-cu12") for name in list(pins)[2:])
