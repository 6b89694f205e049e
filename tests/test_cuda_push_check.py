"""bench/cuda_push_check.py's dry run: a tiny model's tensors sent to a second process through
the CPU path (/dev/shm) arrive bit for bit; the CUDA transport refuses host arrays by name (its
GPU run is the lead's check, docs/vllm.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_sends_every_tensor_bit_for_bit() -> None:
    out = subprocess.run(
        [sys.executable, "bench/cuda_push_check.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])["cuda_push_check"]
    assert result["equal"] and result["differing"] == []
    assert result["tensors"] == 26  # TINY_QWEN2: embedding, final norm, 2 layers x 12
    assert result["mode"].startswith("dry-run")


def test_the_cuda_path_is_chosen_when_learner_and_every_engine_share_its_gpu() -> None:
    """`push_transport`: CUDA IPC when the learner's weights sit on one GPU that every engine
    sees (listed in its CUDA_VISIBLE_DEVICES, or inherited); /dev/shm for host weights,
    weights over several GPUs, or an engine that does not see the learner's GPU. Host
    arrays name no GPU (`learner_gpus`)."""
    import jax.numpy as jnp

    from jax_agent_rl.backends.vllm.cuda_ipc import learner_gpus, push_transport

    assert learner_gpus([jnp.zeros(3)], None) == [] == learner_gpus([jnp.zeros(3)], "2,3")
    cases = {
        ((), ("4", "5")): ("shm", "not on a CUDA device"),
        (("0", "1"), ("", "")): ("shm", "span GPUs ['0', '1']"),
        (("0",), ("4,0", "5")): ("shm", "engines [1] do not see the learner's GPU 0"),
        (("0",), ("4,0", "5,0")): ("cuda_ipc", "share GPU 0"),
        (("GPU-7f",), ("", "")): ("cuda_ipc", "share GPU GPU-7f"),
    }
    for (gpus, engines), (path, why) in cases.items():
        got, reason = push_transport(gpus, engines)
        assert got == path and why in reason, (gpus, engines, reason)
