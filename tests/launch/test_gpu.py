"""launch/gpu.sh plans a CUDA node's GPUs between the learner and the vLLM engines."""

import subprocess
from pathlib import Path

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
    assert "4 vLLM engine(s) per node on GPUs 4,5,6,7" in out.stdout
    run = next(line for line in out.stdout.splitlines() if line.startswith("run:"))
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in run and "train cfg.yaml rollout.backend=vllm" in run
    assert "rollout.vllm.replicas=4 rollout.vllm.devices=4,5,6,7" in run and run.endswith("steps=5")


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
        assert "-m jax_agent_rl.cli train cfg.yaml rollout.backend=vllm" in line
        assert "rollout.vllm.replicas=4 rollout.vllm.devices=4,5,6,7" in line
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
