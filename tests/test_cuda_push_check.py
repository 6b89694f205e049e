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
