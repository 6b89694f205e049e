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
    assert "4 vLLM engine(s) on GPUs 4,5,6,7" in out.stdout
    run = next(line for line in out.stdout.splitlines() if line.startswith("run:"))
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in run and "train cfg.yaml rollout.backend=vllm" in run
    assert "rollout.replicas=4 rollout.vllm_devices=4,5,6,7" in run and run.endswith("steps=5")


def test_dry_run_on_a_ray_cluster_submits_a_job() -> None:
    out = _run("--gpus", "2", "--ray", "http://head:8265", "--dry-run", "cfg.yaml")
    assert out.returncode == 0, out.stderr
    assert "run:  ray job submit --address http://head:8265 --working-dir . -- env" in out.stdout
    assert "rollout.replicas=1 rollout.vllm_devices=1" in out.stdout


def test_refuses_a_node_without_room_for_an_engine() -> None:
    out = _run("--gpus", "1", "--dry-run", "cfg.yaml")
    assert out.returncode == 2 and "cannot hold" in out.stderr
