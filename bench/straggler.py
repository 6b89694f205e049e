"""A straggler's cost to the requests beside it: 31 short requests with and without one long
prompt arriving with them, on the embedded engine (the small Qwen2-style checkpoint, fp32;
``--model tiny`` for a smoke).

Short: a 32-token prompt, 128 sampled tokens each; long: a ``--long``-token prompt (3000),
8 sampled tokens. Temperature 1, a seed per request, logprobs on. Both workloads start at
once (``asyncio.gather``) on one backend (32 slots, ``engine.max_step_tokens`` 512, 8 steps
per call, every program compiled first), each run twice, the faster kept: ``alone_s`` the
wall time of the 31 short requests by themselves, ``with_long_s`` that of the same 31 (their
last result) when the long one comes with them. ``penalty`` = with_long_s / alone_s: 1.0
when the long prompt's prefill costs the short ones nothing. ``long_alone_s``: the long
request by itself (its prefill, on a CPU compute-bound work that shares the short ones'
steps); ``serial_penalty`` = (alone_s + long_alone_s) / alone_s, the penalty were its work
simply added to theirs: where ``penalty`` sits between 1 and it says how much of the long
prefill the steps hid. Ends with one JSON line.

    .venv/bin/python bench/straggler.py [--model small] [--long 3000] [--short 31]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams

SHORT_PROMPT, SHORT_NEW, LONG_NEW = 32, 128, 8
MODELS = {"tiny": TINY_QWEN2, "small": SMALL_QWEN2}


def requests(tag: str, short: int, long: int, vocab: int) -> list[GenerateRequest]:
    """``short`` short requests, then (``long`` > 0) the long one, prompts drawn by ``tag``
    (each run its own: nothing is served from the prefix cache)."""
    rng = np.random.default_rng(zlib.crc32(tag.encode()))

    def one(i: int, n: int, new: int) -> GenerateRequest:
        prompt = tuple(int(t) for t in rng.integers(1, vocab, n))
        sampling = SamplingParams(max_tokens=new, temperature=1.0, seed=i)
        return GenerateRequest(f"{tag}{i}", prompt, sampling)

    out = [one(i, SHORT_PROMPT, SHORT_NEW) for i in range(short)]
    return out + ([one(short, long, LONG_NEW)] if long else [])


def short_wall(backend: EmbeddedBackend, batch: list[GenerateRequest], short: int) -> float:
    """Seconds from the start until the last of the first ``short`` requests is done."""

    async def run() -> float:
        t0 = time.perf_counter()
        done: list[float] = []

        async def one(request: GenerateRequest) -> None:
            result = await backend.generate(request)
            assert len(result.token_ids) == request.sampling.max_tokens, result.finish_reason
            done.append(time.perf_counter() - t0)

        tasks = [asyncio.create_task(one(r)) for r in batch[:short]]
        rest = [asyncio.create_task(one(r)) for r in batch[short:]]
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        await asyncio.gather(*rest)
        return wall

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="checkpoint")
    parser.add_argument("--long", type=int, default=3000, help="the long prompt's tokens")
    parser.add_argument("--short", type=int, default=31, help="short requests")
    args = parser.parse_args()
    max_len = 4096
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / args.model, MODELS[args.model])
        cfg, w = load_hf(ckpt, sharder=one_device_sharder())
        if args.long + LONG_NEW >= min(max_len, cfg.max_position_embeddings):
            raise SystemExit(f"--long {args.long}: the model holds fewer positions")
        engine = Engine(
            cfg,
            max_concurrent_decodes=args.short + 1,
            max_len=min(max_len, cfg.max_position_embeddings),
            sharder=one_device_sharder(),
        )
        backend = EmbeddedBackend(engine, w, steps_per_call=8, warmup=True)
        vocab = cfg.vocab_size
        try:
            short_wall(backend, requests("w", args.short, args.long, vocab), args.short)
            alone = min(
                short_wall(backend, requests(f"a{k}", args.short, 0, vocab), args.short)
                for k in range(2)
            )
            with_long = min(
                short_wall(backend, requests(f"l{k}", args.short, args.long, vocab), args.short)
                for k in range(2)
            )
            long_alone = min(
                short_wall(backend, requests(f"o{k}", 0, args.long, vocab), 1) for k in range(2)
            )
        finally:
            asyncio.run(backend.close())
    figures = {
        "bench": "straggler",
        "model": args.model,
        "short": args.short,
        "long": args.long,
        "alone_s": round(alone, 3),
        "with_long_s": round(with_long, 3),
        "penalty": round(with_long / alone, 3),
        "long_alone_s": round(long_alone, 3),
        "serial_penalty": round((alone + long_alone) / alone, 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
