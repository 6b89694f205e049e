"""Decode throughput: the embedded JAX engine against vLLM's CPU build, in one run.

Both engines serve the SAME checkpoints, written here by transformers: tiny (~0.46M params,
head_dim 64) and small (Qwen2-style, ~40M: hidden 512, 8 layers, 8 heads, 2 kv heads,
intermediate 1536, vocab 32000). Workload: batch B of random 32-token prompts, 128 new tokens
each, temperature 1, EOS ignored, logprobs returned; fp32 and bf16; B in 1, 8, 32. Both go
through their full asyncio `RolloutBackend` (``--backends embedded,vllm``): the embedded engine's
continuous batching, and vLLM's ``AsyncLLM`` in its own process (`gpu_backend`), not bare loops.

The same run measures the machine: matmul FLOP/s per dtype (a 2048^3 jitted matmul) and
memory bandwidth (a jitted reduction over 400 MB). The roofline bound for a decode step at
batch B is max(2 * params * B / peak_flops, param_bytes / bandwidth); each engine's tokens/s
is reported as a fraction of B / that time. Ends with one JSON line.

    .venv/bin/python bench/decode.py [--batches 1,8,32] [--models tiny,small] [--backends embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, RolloutBackend, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODELS = {"tiny": TINY_QWEN2, "small": SMALL_QWEN2}
DTYPES = ("float32", "bfloat16")


def _best(fn, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> dict[str, float]:
    out = {}
    for dtype in DTYPES:
        a = jnp.ones((2048, 2048), dtype)
        mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
        out[f"peak_{dtype}_gflops"] = 2 * 2048**3 / _best(lambda: mm(a)) / 1e9  # noqa: B023
    x = jnp.ones((100_000_000,), jnp.float32)
    total = jax.jit(jnp.sum)
    out["bandwidth_gb_s"] = x.nbytes / _best(lambda: total(x)) / 1e9
    return out


def throughput(backend: RolloutBackend, vocab: int, batch: int, prompt_len: int, new: int) -> float:
    """Best generated tokens per second of two rounds of ``batch`` requests (after a warm-up)."""
    rng = np.random.default_rng(0)

    async def run(tag: str) -> float:
        requests = [
            GenerateRequest(
                f"{tag}{i}",
                tuple(int(t) for t in rng.integers(0, vocab, prompt_len)),
                SamplingParams(max_tokens=new, temperature=1.0, seed=i),
            )
            for i in range(batch)
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(backend.generate(r) for r in requests))
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)

    asyncio.run(run("warm"))  # compiles every bucket this workload touches
    return max(asyncio.run(run("a")), asyncio.run(run("b")))


def decode(
    name: str, ckpt: Path, dtype: str, batches: list[int], prompt_len: int, new: int
) -> dict[int, float]:
    """Tokens per second at each batch size on backend ``name`` (one backend for all)."""
    cfg, w = load_hf(ckpt, dtype=dtype)  # type: ignore[arg-type]
    backend: RolloutBackend
    if name == "vllm":
        from gpu_backend.backend import VLLMBackend

        backend = VLLMBackend(
            ckpt, cfg, dtype=dtype, max_model_len=prompt_len + new, max_num_seqs=max(batches)
        )
    else:
        engine = Engine(cfg, max_concurrent_decodes=max(batches), max_len=prompt_len + new)
        backend = EmbeddedBackend(engine, w, steps_per_call=8)
    try:
        return {b: throughput(backend, cfg.vocab_size, b, prompt_len, new) for b in batches}
    finally:
        asyncio.run(backend.close())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--backends", default="embedded,vllm", help="embedded, or embedded,vllm")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with_vllm = "vllm" in args.backends.split(",")
    if with_vllm and not VLLM_PYTHON.exists():
        sys.exit("bench/decode.py: .venv-vllm is missing; run `scripts/setup.sh vllm` first")

    figures: dict[str, object] = {"bench": "decode", "prompt": args.prompt, "new": args.new}
    hw = machine()
    figures.update({k: round(v, 1) for k, v in hw.items()})
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ckpt = write_hf_checkpoint(Path(tmp) / name, MODELS[name])
            n_params = load_hf(ckpt)[0].num_params
            for dtype in DTYPES:
                ours = decode("embedded", ckpt, dtype, batches, args.prompt, args.new)
                theirs = (
                    decode("vllm", ckpt, dtype, batches, args.prompt, args.new) if with_vllm else {}
                )
                bytes_per = 4 if dtype == "float32" else 2
                for b in batches:
                    step_s = max(
                        2 * n_params * b / (hw[f"peak_{dtype}_gflops"] * 1e9),
                        n_params * bytes_per / (hw["bandwidth_gb_s"] * 1e9),
                    )
                    bound = b / step_s
                    key = f"{name}_{dtype}_b{b}"
                    figures[f"{key}_roofline_tok_s"] = round(bound, 1)
                    figures[f"{key}_jax_tok_s"] = round(ours[b], 1)
                    figures[f"{key}_jax_roofline_frac"] = round(ours[b] / bound, 3)
                    if b in theirs:
                        figures[f"{key}_vllm_tok_s"] = round(theirs[b], 1)
                        figures[f"{key}_vllm_roofline_frac"] = round(theirs[b] / bound, 3)
                        figures[f"{key}_ratio"] = round(ours[b] / theirs[b], 2)
                print(f"# {name} {dtype}: jax {ours} vllm {theirs}", file=sys.stderr, flush=True)
    for name in args.models.split(","):
        for b in batches:
            best_jax = max(figures[f"{name}_{d}_b{b}_jax_tok_s"] for d in DTYPES)  # type: ignore[type-var]
            if with_vllm:
                best_vllm = max(figures[f"{name}_{d}_b{b}_vllm_tok_s"] for d in DTYPES)  # type: ignore[type-var]
                figures[f"{name}_b{b}_best_ratio"] = round(best_jax / best_vllm, 2)  # type: ignore[operator]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
