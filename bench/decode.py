"""Decode throughput: the embedded JAX engine against vLLM's CPU build and against the same
engine served by JetStream's orchestrator, in one run.

All serve the SAME checkpoints, written here by transformers: tiny (~0.46M params,
head_dim 64) and small (Qwen2-style, ~40M: hidden 512, 8 layers, 8 heads, 2 kv heads,
intermediate 1536, vocab 32000). Workload: batch B of random 32-token prompts, 128 new tokens
each, temperature 1, EOS ignored, logprobs returned (JetStream returns none); fp32 and bf16; B
in 1, 8, 32. Each goes through its full asyncio `RolloutBackend` (``--backends
embedded,jetstream,vllm``): the embedded engine's continuous batching, JetStream's Driver and
gRPC server in their own process (`jax_agent_rl.backends.jetstream`, 8 decode steps per engine
call like the embedded one's), and vLLM's ``AsyncLLM`` in its own process
(`jax_agent_rl.backends.vllm`).
``_ratio`` is jax / vLLM; ``_jetstream_overhead`` is jax / JetStream: what JetStream's serving
loop (a Python thread per stage, one gRPC stream per request) costs over the same engine.

Mixture of experts: ``--models tiny-moe,small-moe`` serves `jarl checkpoint make`'s Qwen3-MoE
presets (`jax_agent_rl.cli.demo.PRESETS`, with their vocabularies) on the backends given and, on
the embedded engine, their dense twins (`jax_agent_rl.models.hf_local.dense_twin`: a Qwen3 of
the same active parameter count), keys ``<model>_<dtype>_b<B>_dense_jax_tok_s``;
``_moe_over_dense`` is the MoE's tokens/s over its twin's on the embedded engine.

The same run measures the machine: matmul FLOP/s per dtype (a 2048^3 jitted matmul) and
memory bandwidth (a jitted reduction over 400 MB). The roofline bound for a decode step at
batch B is max(2 * active params * B / peak_flops, bytes read / bandwidth), the bytes being
the weights a step reads: all of a dense model's; of a MoE's sparse layers, the experts its B
tokens choose (E * (1 - (1 - k / E)^B) of E when the router spreads them evenly). Each
engine's tokens/s is reported as a fraction of B / that time. Ends with one JSON line.

    .venv/bin/python bench/decode.py [--batches 1,8,32] [--models tiny,small,tiny-moe,small-moe]
                                     [--backends embedded,jetstream,vllm] [--smoke]

``--smoke``: the smallest run (the embedded engine alone, the tiny model or the --models
given, batch 1, 8 new tokens, fp32 only, 256^3 matmul, 4 MB reduction): it checks the bench
works, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.cli.demo import PRESETS
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, dense_twin, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, RolloutBackend, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
VENVS = {"vllm": ".venv-vllm", "jetstream": ".venv-jetstream"}
LABELS = {"embedded": "jax", "vllm": "vllm", "jetstream": "jetstream"}
MODELS = {
    "tiny": TINY_QWEN2,
    "small": SMALL_QWEN2,
    **{m: {**PRESETS[m][0], "vocab_size": PRESETS[m][1]} for m in ("tiny-moe", "small-moe")},
}
DTYPES = ("float32", "bfloat16")


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def machine(dtypes: tuple[str, ...], n: int = 2048, floats: int = 100_000_000) -> dict[str, float]:
    """Matmul GFLOP/s of an ``n``^3 product per dtype, and GB/s of a sum over ``floats``."""
    out = {}
    for dtype in dtypes:
        a = jnp.ones((n, n), dtype)
        mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
        out[f"peak_{dtype}_gflops"] = 2 * n**3 / _best(lambda: mm(a)) / 1e9  # noqa: B023
    x = jnp.ones((floats,), jnp.float32)
    total = jax.jit(jnp.sum)
    out["bandwidth_gb_s"] = x.nbytes / _best(lambda: total(x)) / 1e9
    return out


def weights_read(cfg: ModelConfig, batch: int) -> float:
    """The parameters a decode step at ``batch`` reads: all, less the experts no token of the
    batch chooses when the router spreads the batch's choices evenly (each expert escapes one
    token's k choices with probability 1 - k / E)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    if not E:
        return cfg.num_params
    unread = E * (1 - k / E) ** batch
    return cfg.num_params - sum(cfg.moe_layers) * unread * 3 * cfg.hidden_size * (
        cfg.moe_intermediate_size
    )


def throughput(backend: RolloutBackend, vocab: int, batch: int, prompt_len: int, new: int) -> float:
    """Best generated tokens per second of two rounds of ``batch`` requests (after a warm-up)."""
    rng = np.random.default_rng(0)

    async def run(tag: str) -> float:
        requests = [
            GenerateRequest(
                f"{tag}{i}",
                tuple(int(t) for t in rng.integers(0, vocab, prompt_len)),
                SamplingParams(max_tokens=new, temperature=1.0),  # (JetStream takes no seed)
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
    cfg, w = load_hf(ckpt, dtype=dtype, sharder=one_device_sharder())  # type: ignore[arg-type]
    backend: RolloutBackend
    if name == "vllm":
        from jax_agent_rl.backends.vllm.backend import VLLMBackend

        backend = VLLMBackend(
            ckpt, cfg, dtype=dtype, max_model_len=prompt_len + new, max_num_seqs=max(batches)
        )
    elif name == "jetstream":
        from jax_agent_rl.backends.jetstream.client import JetStreamBackend

        backend = JetStreamBackend(
            ckpt, cfg, dtype=dtype, max_model_len=prompt_len + new, slots=max(batches), steps=8
        )
    else:
        engine = Engine(
            cfg,
            max_concurrent_decodes=max(batches),
            max_len=prompt_len + new,
            sharder=one_device_sharder(),
        )
        backend = EmbeddedBackend(engine, w, steps_per_call=8)
    try:
        return {b: throughput(backend, cfg.vocab_size, b, prompt_len, new) for b in batches}
    finally:
        asyncio.run(backend.close())


def model_figures(
    model: str,
    tmp: Path,
    args: argparse.Namespace,
    hw: dict[str, float],
    backends: list[str],
    batches: list[int],
) -> dict[str, object]:
    """``model``'s figures on every backend, dtype and batch (a MoE's: with its dense twin's
    on the embedded engine), its checkpoints written under ``tmp``."""
    figures: dict[str, object] = {}
    ckpt = write_hf_checkpoint(tmp / model, MODELS[model])
    cfg = load_hf(ckpt, sharder=one_device_sharder())[0]
    twin = None
    if cfg.num_experts:
        twin = write_hf_checkpoint(tmp / f"{model}-dense", dense_twin(MODELS[model]))
        figures[f"{model}_active_params"] = cfg.active_params
        figures[f"{model}_dense_active_params"] = load_hf(twin, sharder=one_device_sharder())[
            0
        ].active_params
    for dtype in args.dtypes:
        tok_s = {
            LABELS[name]: decode(name, ckpt, dtype, batches, args.prompt, args.new)
            for name in backends
        }
        if twin is not None:
            tok_s["dense_jax"] = decode("embedded", twin, dtype, batches, args.prompt, args.new)
        bytes_per = 4 if dtype == "float32" else 2
        for b in batches:
            step_s = max(
                2 * cfg.active_params * b / (hw[f"peak_{dtype}_gflops"] * 1e9),
                weights_read(cfg, b) * bytes_per / (hw["bandwidth_gb_s"] * 1e9),
            )
            bound = b / step_s
            key = f"{model}_{dtype}_b{b}"
            figures[f"{key}_roofline_tok_s"] = round(bound, 1)
            for label, by_batch in tok_s.items():
                figures[f"{key}_{label}_tok_s"] = round(by_batch[b], 1)
                if label != "dense_jax":  # (the twin's roofline is not the MoE's)
                    figures[f"{key}_{label}_roofline_frac"] = round(by_batch[b] / bound, 3)
            jax_tok_s = tok_s["jax"][b]
            if twin is not None:
                figures[f"{key}_moe_over_dense"] = round(jax_tok_s / tok_s["dense_jax"][b], 3)
            if "vllm" in tok_s:
                figures[f"{key}_ratio"] = round(jax_tok_s / tok_s["vllm"][b], 2)
            if "jetstream" in tok_s:
                figures[f"{key}_jetstream_overhead"] = round(jax_tok_s / tok_s["jetstream"][b], 2)
        print(f"# {model} {dtype}: {tok_s}", file=sys.stderr, flush=True)
    return figures


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument(
        "--models", default=None, help=f"comma-separated, of {list(MODELS)} (tiny,small)"
    )
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument(
        "--backends", default="embedded,jetstream,vllm", help="comma-separated, embedded first"
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    args.dtypes = DTYPES
    if args.smoke:
        args.batches, args.prompt, args.new = "1", 8, 8
        args.models = args.models or "tiny"
        args.backends = "embedded"
        args.dtypes = ("float32",)
    args.models = args.models or "tiny,small"
    return args


def main() -> None:
    args = _args()
    dtypes: tuple[str, ...] = args.dtypes
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    if backends[0] != "embedded" or not set(backends) <= set(LABELS):
        sys.exit(f"bench/decode.py: --backends {args.backends}: embedded first, then of {LABELS}")
    models = args.models.split(",")
    if not set(models) <= set(MODELS):
        sys.exit(f"bench/decode.py: --models {args.models}: comma-separated, of {list(MODELS)}")
    for name in backends[1:]:
        if not (ROOT / VENVS[name] / "bin" / "python").exists():
            sys.exit(f"bench/decode.py: {VENVS[name]} is missing; run `scripts/setup.sh {name}`")

    figures: dict[str, object] = {"bench": "decode", "prompt": args.prompt, "new": args.new}
    hw = machine(dtypes, 256, 1_000_000) if args.smoke else machine(dtypes)
    figures.update({k: round(v, 1) for k, v in hw.items()})
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            figures.update(model_figures(model, Path(tmp), args, hw, backends, batches))
    if "vllm" in backends:
        for model in models:
            for b in batches:
                best_jax = max(figures[f"{model}_{d}_b{b}_jax_tok_s"] for d in dtypes)  # type: ignore[type-var]
                best_vllm = max(figures[f"{model}_{d}_b{b}_vllm_tok_s"] for d in dtypes)  # type: ignore[type-var]
                figures[f"{model}_b{b}_best_ratio"] = round(best_jax / best_vllm, 2)  # type: ignore[operator]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
