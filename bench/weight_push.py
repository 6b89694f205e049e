"""Weight push into a running vLLM engine: the JAX learner's parameters to vLLM's CPU build.

The small model (Qwen2-style, ~40M parameters, fp32: ~160 MB) is written here by transformers
and served by one vLLM engine process (`jax_agent_rl.backends.vllm`); its weights, moved a
little each time as a train step would, are pushed ``--pushes`` times through the backend's
path: the HF name/transpose table into one /dev/shm file (this process), then vLLM's
``reload_weights`` from that file in place and a prefix-cache reset (the engine). Reports the
median of each phase and the effective bandwidth. Ends with one JSON line.

    .venv/bin/python bench/weight_push.py [--model small] [--pushes 5]

``--model tiny --pushes 1`` is its smallest run (it checks the bench works).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import jax

from jax_agent_rl.backends.vllm.backend import DEFAULT_PYTHON, VLLMBackend
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.rollout.protocol import PushStats

MODELS = {"tiny": TINY_QWEN2, "small": SMALL_QWEN2}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--pushes", type=int, default=5)
    args = parser.parse_args()
    if not DEFAULT_PYTHON.exists():
        sys.exit("bench/weight_push.py: .venv-vllm is missing; run `scripts/setup.sh vllm` first")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / args.model, MODELS[args.model])
        cfg, weights = load_hf(ckpt)
        backend = VLLMBackend(ckpt, cfg, max_model_len=256, max_num_seqs=8)
        stats: list[PushStats] = []
        try:
            for version in range(1, args.pushes + 1):
                moved = jax.tree.map(lambda x, v=version: x * (1.0 + 1e-3 * v), weights)
                asyncio.run(backend.update_weights(moved, version))
                assert backend.last_push is not None
                stats.append(backend.last_push)
        finally:
            asyncio.run(backend.close())

    def median(field: str) -> float:
        return statistics.median(getattr(s, field) for s in stats)

    size = stats[0].bytes
    print(
        json.dumps(
            {
                "bench": "weight_push",
                "model": args.model,
                "params": cfg.num_params,
                "bytes": size,
                "pushes": args.pushes,
                "write_s": round(median("write_s"), 4),
                "load_s": round(median("load_s"), 4),
                "total_s": round(median("total_s"), 4),
                "first_total_s": round(stats[0].total_s, 4),
                "gb_per_s": round(size / median("total_s") / 1e9, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
