"""Weight push into a running vLLM engine: the JAX learner's parameters to vLLM's CPU build.

The small model (Qwen2-style, ~40M parameters, fp32: ~160 MB) is written here by transformers
and served by one vLLM engine process (`jax_agent_rl.backends.vllm`); its weights, moved a
little each time as a train step would, are pushed ``--pushes`` times through the backend's
path: the HF name/transpose table into one /dev/shm file (this process), then vLLM's
``reload_weights`` from that file in place and a prefix-cache reset (the engine). Reports the
median of each phase and the effective bandwidth. Ends with one JSON line.

    .venv/bin/python bench/weight_push.py [--model small] [--pushes 5]

``--model tiny --pushes 1`` is its smallest run (it checks the bench works).

``--lora``: a LoRA policy (rank ``--rank`` on every projection, alpha = 2 x rank) served by the
embedded engine, which takes the adapters alone: the bytes and seconds of a push of the whole
model against a push of the adapters (``adapter_over_full``), and decode tokens/s (batch 8,
32-token prompts, 64 new tokens, fp32) with the adapters applied unmerged (``x W + s (x A) B``,
what the engine does) against merged into the weights (a plain model, what merge-on-push would
serve), with the seconds such a merge takes per push.

``--delta``: a delta push (`jax_agent_rl.rollout.delta`) against a whole one, in bytes and
seconds (the learner's encoding, the engine's in-place apply), on the demo's model
(`jax_agent_rl.cli.demo.MODEL`) and at the Qwen2.5-1.5B shape (`plan.presets`), in memory:
random fp32 weights (N(0, 0.02), norms 1), one optax Adam step on a random gradient at each
``--lrs``, the weights before and after it cast to each serving dtype (fp32, bf16). At the
1.5B shape ``--layers`` of its 28 layers are built (every leaf kind: embedding, each layer's
leaves, final norm; the full model's bytes scale the per-layer figures by 28 / layers; the
seconds are those of the part). Adam's first step moves every weight by about lr, so at RL
learning rates few move by a whole bf16 step; fp32 serving sees every one move.

``--delta-run``: the same in a real run: `jarl train` of the demo config on its smaller task
(`jax_agent_rl.cli.demo.small_task`, the learning tests'), from ``--warm-start`` (the SFT'd
demo model the learning tests start from), ``--steps`` GRPO steps serving in bf16 at each of
``--lrs`` with delta pushes on (``engine.push.full_every`` past the run): each step's pushed
bytes (``push/bytes``) against a whole push of the same weights.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jax_agent_rl.backends.vllm.backend import DEFAULT_PYTHON, VLLMBackend
from jax_agent_rl.cli.demo import MODEL as DEMO_MODEL
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, Weights, init_params, load_hf, policy_of
from jax_agent_rl.models.adapters import adapters_of, add_lora, merge, with_adapters
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.plan.presets import PRESETS as SHAPES
from jax_agent_rl.protocol import PushStats
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from jax_agent_rl.rollout.delta import DeltaPusher, WeightDelta, apply_delta

MODELS = {"tiny": TINY_QWEN2, "small": SMALL_QWEN2}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="the embedded engine, LoRA pushes")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--delta", action="store_true", help="delta pushes against whole ones")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="--delta's Adam learning rates")
    parser.add_argument("--layers", type=int, default=2, help="--delta: 1.5B layers built")
    parser.add_argument("--delta-run", action="store_true", help="deltas in a real demo run")
    parser.add_argument("--steps", type=int, default=4, help="--delta-run: GRPO steps")
    parser.add_argument(
        "--warm-start",
        default="tests/train/warm_starts/tiny",
        help="--delta-run: the SFT'd demo model the run starts from (the learning tests')",
    )
    args = parser.parse_args()
    if args.delta_run:
        delta_run_bench([float(x) for x in args.lrs.split(",")], args.steps, args.warm_start)
        return
    if args.delta:
        delta_bench([float(x) for x in args.lrs.split(",")], args.layers)
        return
    if args.lora:
        lora_bench(args.model, args.rank, args.pushes)
        return
    if not DEFAULT_PYTHON.exists():
        sys.exit("bench/weight_push.py: .venv-vllm is missing; run `scripts/setup.sh vllm` first")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / args.model, MODELS[args.model])
        cfg, weights = load_hf(ckpt, sharder=one_device_sharder())
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


def _decode_tok_s(backend: EmbeddedBackend, vocab: int, batch: int = 8, new: int = 64) -> float:
    """Tokens/s of ``batch`` requests of 32 random prompt tokens, ``new`` tokens each (the
    median of three runs after one that compiles)."""
    rng = np.random.default_rng(0)

    async def one_run(run: int) -> float:
        reqs = [
            GenerateRequest(
                f"r{run}-{i}",
                tuple(int(t) for t in rng.integers(0, vocab, 32)),
                SamplingParams(max_tokens=new, temperature=1.0, seed=i),
            )
            for i in range(batch)
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)

    asyncio.run(one_run(0))  # compiles
    return statistics.median(asyncio.run(one_run(run)) for run in (1, 2, 3))


def lora_bench(model: str, rank: int, pushes: int) -> None:
    """`--lora` (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / model, MODELS[model])
        base_cfg, base = load_hf(ckpt, sharder=one_device_sharder())
    cfg, w = add_lora(jax.random.key(0), base_cfg, base, Lora(rank, 2.0 * rank))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters_of(w))  # B nonzero: a trained one
    w = with_adapters(base, adapters)
    full: list[PushStats] = []
    lora: list[PushStats] = []
    backend = EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=8, max_len=128, sharder=one_device_sharder()), w
    )
    try:
        for version in range(1, pushes + 1):
            for stats, sent in ((full, w), (lora, adapters)):
                moved = jax.tree.map(lambda x, v=version: x * (1.0 + 1e-3 * v), sent)
                asyncio.run(backend.update_weights(moved, 2 * version - (stats is full)))
                assert backend.last_push is not None
                stats.append(backend.last_push)
        unmerged = _decode_tok_s(backend, cfg.vocab_size)
    finally:
        asyncio.run(backend.close())
    merge_fn = jax.jit(lambda w: merge(cfg, w)[1])
    jax.block_until_ready(merge_fn(w))  # compiled
    t0 = time.perf_counter()
    merged_w = jax.block_until_ready(merge_fn(w))
    merge_s = time.perf_counter() - t0
    plain = EmbeddedBackend(
        Engine(base_cfg, max_concurrent_decodes=8, max_len=128, sharder=one_device_sharder()),
        merged_w,
    )
    try:
        merged = _decode_tok_s(plain, cfg.vocab_size)
    finally:
        asyncio.run(plain.close())
    full_bytes, lora_bytes = full[0].bytes, lora[0].bytes
    median = lambda xs: statistics.median(s.total_s for s in xs)  # noqa: E731
    print(
        json.dumps(
            {
                "bench": "weight_push_lora",
                "model": model,
                "params": base_cfg.num_params,
                "rank": rank,
                "full_bytes": full_bytes,
                "adapter_bytes": lora_bytes,
                "adapter_over_full": round(lora_bytes / full_bytes, 4),
                "full_push_s": round(median(full), 4),
                "adapter_push_s": round(median(lora), 4),
                "unmerged_decode_tok_s": round(unmerged, 1),
                "merged_decode_tok_s": round(merged, 1),
                "merge_s": round(merge_s, 4),
            }
        )
    )


def _adam_step(w: Weights, lr: float, seed: int) -> Weights:
    """``w`` after one optax Adam step (lr ``lr``) on a random N(0, 1) gradient, leaf by leaf
    (Adam is elementwise: the same step as on the whole tree, in one leaf's memory)."""
    opt = optax.adam(lr)
    leaves, treedef = jax.tree.flatten(w)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for x, k in zip(leaves, keys, strict=True):
        updates, _ = opt.update(jax.random.normal(k, x.shape), opt.init(x))
        out.append(jax.block_until_ready(optax.apply_updates(x, updates)))
    return jax.tree.unflatten(treedef, out)


def _scales(tree: Any, per_layer: int) -> list[int]:
    """Per leaf of ``tree``: how many of the full model's layers it stands for (``per_layer``
    for a layer's leaf, else 1)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [per_layer if "layers" in jax.tree_util.keystr(p) else 1 for p, _ in paths]


def _delta_case(cfg: ModelConfig, before: Weights, after: Weights, per_layer: int) -> dict:
    """One push of ``after`` over ``before`` (both in ``cfg.dtype``): the whole push's bytes,
    the delta's (a layer's leaves counted ``per_layer`` times: the layers a part stands for),
    what each leaf was sent as, the encoding's and the in-place apply's seconds (the second
    of two runs: the first compiles)."""
    pusher = DeltaPusher(cfg, full_every=1 << 30)
    layout = jax.jit(policy_of(cfg).serving_layout)
    runs = []
    for _ in range(2):
        sent, base = pusher.encode(before)
        pusher.took(sent, base, 0)
        served = jax.block_until_ready(layout(before))
        t0 = time.perf_counter()
        delta, _ = pusher.encode(after)
        made = delta.leaves if isinstance(delta, WeightDelta) else ()
        jax.block_until_ready([(d.index, d.values) for d in made if d is not None])
        t1 = time.perf_counter()
        if isinstance(delta, WeightDelta):
            served = jax.block_until_ready(apply_delta(served, delta, 0))
        runs.append((delta, t1 - t0, time.perf_counter() - t1))
        del served
    delta, encode_s, apply_s = runs[-1]
    full = sum(
        int(x.nbytes) * k
        for x, k in zip(jax.tree.leaves(before), _scales(before, per_layer), strict=True)
    )
    if not isinstance(delta, WeightDelta):
        return {"full_bytes": full, "delta_bytes": full, "full_over_delta": 1.0, "whole": True}
    served_scales = _scales(layout(before), per_layer)
    sent = sum(
        (0 if d is None else d.nbytes) * k for d, k in zip(delta.leaves, served_scales, strict=True)
    )
    kinds = collections.Counter("unchanged" if d is None else d.kind for d in delta.leaves)
    return {
        "full_bytes": full,
        "delta_bytes": sent,
        "full_over_delta": round(full / sent, 2),
        "leaves": dict(kinds),
        "encode_s": round(encode_s, 4),
        "apply_s": round(apply_s, 4),
    }


def delta_run_bench(lrs: list[float], steps: int, warm_start: str) -> None:
    """`--delta-run` (module docstring)."""
    from jax_agent_rl.cli.demo import SMALL_OVERRIDES, demo_config, small_task
    from jax_agent_rl.models import request_cpu_devices
    from jax_agent_rl.train import train
    from jax_agent_rl.train.metrics import read_metrics

    request_cpu_devices(2)  # the demo's mesh (data=2), before JAX starts
    figures: dict[str, Any] = {"steps": steps, "warm_start": warm_start, "serving": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        task = small_task(Path(tmp) / "task")
        _, weights = load_hf(warm_start, sharder=one_device_sharder())
        whole = sum(int(x.size) for x in jax.tree.leaves(weights)) * 2  # bf16
        figures["whole_bytes"] = whole
        for lr in lrs:
            overrides = [
                *SMALL_OVERRIDES, f"model.path={warm_start}", "sft.steps=0",
                "model.dtype=bfloat16", f"optim.lr={lr}", f"engine.push.full_every={steps + 2}",
                f"trainer.steps={steps}", "data.val=", "trainer.eval_every=0",
                f"trainer.save_every={steps}",
            ]  # fmt: skip
            run_dir = train(demo_config(Path(tmp) / f"run-{lr:g}", task, overrides))
            rows = read_metrics(run_dir / "metrics.jsonl", "train")
            sent = [int(m["push/bytes"]) for m in rows]
            deltas = [b for b, m in zip(sent, rows, strict=True) if m["push/delta"] == 1.0]
            figures[f"lr{lr:g}"] = {
                # (the run's first push is whole: the backend started on the warm start)
                "bytes": sent,
                "delta": [m["push/delta"] == 1.0 for m in rows],
                "fewer_bytes": round(whole / statistics.median(deltas), 2) if deltas else 1.0,
                "reward": [round(m["reward"], 3) for m in rows],
            }
            print(f"lr {lr:g}: whole {whole} B, pushed {sent} B", file=sys.stderr)
    print(json.dumps(figures))


def delta_bench(lrs: list[float], layers: int) -> None:
    """`--delta` (module docstring)."""
    shapes = {
        "demo": ({**DEMO_MODEL, "vocab_size": 2048}, 1),  # (the demo's trained vocabulary)
        "qwen2.5-1.5b": ({**SHAPES["qwen2.5-1.5b"], "num_hidden_layers": layers}, 28 // layers),
    }
    results: list[dict[str, Any]] = []
    for name, (hf, per_layer) in shapes.items():
        cfg32 = ModelConfig.from_hf(hf)
        w = init_params(jax.random.key(0), cfg32, one_device_sharder())
        for lr in lrs:
            stepped = _adam_step(w, lr, seed=1)
            for dtype in ("float32", "bfloat16"):
                cfg = dataclasses.replace(cfg32, dtype=dtype)
                before, after = (
                    jax.tree.map(lambda x, d=dtype: x.astype(d), t) for t in (w, stepped)
                )
                row = {"model": name, "lr": lr, "dtype": dtype}
                row.update(_delta_case(cfg, before, after, per_layer))
                print(json.dumps(row), file=sys.stderr, flush=True)
                results.append(row)
                del before, after
            del stepped
        del w

    def ratio(model: str, lr: float) -> float:
        return next(
            float(r["full_over_delta"])
            for r in results
            if (r["model"], r["lr"], r["dtype"]) == (model, lr, "bfloat16")
        )

    print(
        json.dumps(
            {
                "bench": "weight_push_delta",
                "layers_built_of_1.5b": layers,
                **{
                    f"full_over_delta_{m}_bf16_lr{lr:g}": ratio(m, lr) for m in shapes for lr in lrs
                },
                "cases": results,
            }
        )
    )


if __name__ == "__main__":
    main()
