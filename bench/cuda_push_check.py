"""Checks the CUDA weight push's transport (`jax_agent_rl.backends.vllm.cuda_ipc`) without
vLLM: a JAX process sends a model's weights to a separate torch process as one CUDA IPC
handle; the receiver rebuilds every tensor, copies it into its own memory (what
``reload_weights`` does with each tensor), and both sides hash every tensor's bytes.

    python3 bench/cuda_push_check.py            # a CUDA machine: Qwen2.5-1.5B's shape, bf16
    python3 bench/cuda_push_check.py --dry-run  # anywhere: a tiny model through /dev/shm

The dry run sends the same tensors through the CPU path (`wire.write_tensors` / `map_tensors`,
what the backend uses on CPU) to the same receiver and compares the same hashes; the CUDA
transport is not run there (it is only checked to refuse host arrays by name).

Prints one JSON line, ``{"cuda_push_check": {...}}``: tensors, bytes, ``equal`` (every
tensor bit for bit), the sender's seconds (DLPack and packing into the shared buffer), the
receiver's (opening the handle and copying every tensor out), their sum and GB/s over it.
Exits 1 when a tensor differs. Needs JAX (CUDA) and torch; the project's other imports from
``.gpu-wheels`` as bench/gpu_check.py unpacks them (``--wheels``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jax_agent_rl.models.sharding import one_device_sharder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def receive(mode: str) -> None:
    """The engine's side (torch only): the payload on stdin, the hashes and times on stdout."""
    import torch

    from jax_agent_rl.backends.vllm import cuda_ipc, wire

    message = json.loads(sys.stdin.read())
    t0 = time.perf_counter()
    if mode == "cuda":
        received = list(cuda_ipc.import_tensors(message["payload"]))
    else:
        received = [
            (name, torch.frombuffer(data, dtype=getattr(torch, dtype)).view(shape))
            for name, data, dtype, shape in wire.map_tensors(message["path"], message["index"])
        ]
    copies = [(name, t.clone()) for name, t in received]  # into this process's own memory
    if mode == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    digests = {
        name: _digest(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for name, t in copies
    }
    print(json.dumps({"seconds": seconds, "digests": digests}))


def _weights(dry: bool) -> tuple[Any, Any]:
    import dataclasses

    import jax

    from jax_agent_rl.models import ModelConfig, init_params
    from jax_agent_rl.models.hf_local import TINY_QWEN2
    from jax_agent_rl.plan.presets import preset_model

    cfg = ModelConfig.from_hf(TINY_QWEN2) if dry else preset_model("qwen2.5-1.5b")
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    return cfg, init_params(jax.random.key(0), cfg, sharder=one_device_sharder())


def _host_digest(array: Any) -> str:
    import numpy as np

    host = np.ascontiguousarray(np.asarray(array))
    return _digest(host.view(np.uint8).tobytes())


def check(dry: bool) -> dict[str, Any]:
    import jax

    from jax_agent_rl.backends.vllm import cuda_ipc, wire
    from jax_agent_rl.models import hf_tensors

    cfg, weights = _weights(dry)
    tensors = list(hf_tensors(cfg, weights, on_device=True))
    jax.block_until_ready([t for _, t in tensors])
    mode = "shm" if dry else "cuda"
    cmd = [sys.executable, __file__, "--receive", mode]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), _extra_path()]))}
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=wire.SHM_DIR, prefix="jarl-check-") as f:
        if dry:
            try:  # the CUDA transport takes only CUDA arrays, and says so
                cuda_ipc.export_tensors(tensors[:1])
                raise AssertionError("the CUDA push took host arrays")
            except ValueError as e:
                assert "needs every tensor on one CUDA device" in str(e), e
            host = [(name, jax.device_get(t)) for name, t in tensors]
            message: dict[str, Any] = {
                "path": f.name,
                "index": wire.write_tensors(Path(f.name), host),
            }
            nbytes = Path(f.name).stat().st_size
        else:
            export = cuda_ipc.export_tensors(tensors)
            message, nbytes = {"payload": export.payload}, export.nbytes
        send_s = time.perf_counter() - t0
        out = subprocess.run(
            cmd, input=json.dumps(message), capture_output=True, text=True, env=env, check=False
        )
    if out.returncode != 0:
        raise RuntimeError(f"the receiver failed:\n{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = {name: _host_digest(t) for name, t in tensors}
    total = send_s + got["seconds"]
    return {
        "mode": "dry-run: /dev/shm (CUDA transport not run)" if dry else "cuda ipc",
        "device": str(tensors[0][1].devices().pop()),
        "tensors": len(tensors),
        "bytes": nbytes,
        "equal": got["digests"] == want,
        "differing": sorted(n for n in want if got["digests"].get(n) != want[n])[:5],
        "send_s": round(send_s, 4),
        "receive_s": round(got["seconds"], 4),
        "total_s": round(total, 4),
        "gb_per_s": round(nbytes / total / 1e9, 2),
    }


def _extra_path() -> str:
    """Where bench/gpu_check.py unpacks `.gpu-wheels` (``--wheels``), or nothing."""
    return os.environ.get("JARL_WHEELS_PATH", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny model through /dev/shm")
    parser.add_argument("--receive", choices=["cuda", "shm"], help=argparse.SUPPRESS)
    parser.add_argument("--wheels", action="store_true", help="unpack missing .gpu-wheels first")
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return
    if args.wheels:
        from gpu_check import unpack_missing_wheels  # its neighbour in bench/

        target = Path(tempfile.mkdtemp(prefix="jarl-wheels-"))
        unpack_missing_wheels(target, lambda line: print(line, file=sys.stderr))
        os.environ["JARL_WHEELS_PATH"] = str(target)
        sys.path.insert(0, str(target))
    result = check(args.dry_run)
    print(json.dumps({"cuda_push_check": result}))
    sys.exit(0 if result["equal"] else 1)


if __name__ == "__main__":
    main()
