"""One command that checks the project on a machine with one CUDA GPU, in under 8 minutes.

    python3 bench/gpu_check.py              # on the GPU machine, in the repository root
    python3 bench/gpu_check.py --dry-run    # anywhere: every step at a tiny shape on CPU

It needs nothing but the machine's Python with JAX (CUDA), torch and transformers: the rest
of the project's imports come from ``.gpu-wheels/`` (``scripts/setup.sh gpu-wheels``, run
beforehand where a registry is reachable; carried with the tree), whose wheels are unpacked
into a temporary folder on the steps' ``PYTHONPATH`` only where the machine lacks the
package (no virtualenv, no pip: an air-gapped image need not have either).

Each step runs in a process of its own (``--step NAME``), time-boxed (its box, and what is
left of the whole run's `DEADLINE_S`); a failed, crashed or timed-out step is recorded with
its error and the check goes on. Steps, in order:

    device              JAX's devices and versions; the card's peak bf16 FLOP/s and HBM
                        bandwidth from `PEAKS` (null for a card not in it); a measured
                        bf16 matmul and fp32 reduction beside them
    paged_attention     decode attention over a paged KV pool by JAX's Pallas GPU (Triton)
                        paged-attention kernel, which takes our pool layout [G, P, page, K],
                        against `models.paged.ragged_attention` (the XLA path the engine
                        runs off TPU) in fp32 on the same bf16 inputs; both timed
    hf_parity           tests/models/test_parity.py (the decoder against transformers'
                        forward on checkpoints transformers writes here) on the GPU
    moe_parity          tests/models/test_moe.py's tests against transformers and of the
                        grouped expert matmuls (padded blocks, off TPU) and routing replay:
                        Qwen3-MoE on the GPU
    sampler_vs_learner  tests/rl/test_learner.py's test_learner_logprobs_equal_the_samplers
                        (the engine's sampled logprobs against the learner's recomputation)
    cuda_push           the vLLM backend's weight transport as it decides here (the
                        learner's weights on the first GPU, an engine that inherits the
                        devices: CUDA IPC) and bench/cuda_push_check.py (Qwen2.5-1.5B's
                        shape in bf16 sent by one CUDA IPC handle to a torch process, every
                        tensor hashed on both sides; the dry run: a tiny model via /dev/shm)
    learner_step        the learner's RL step (`Learner.rl_update`) at Qwen2.5-1.5B's shape,
                        random init, bf16 compute, one packed row of 8192 tokens per
                        micro-batch, remat: tokens/s and MFU
    decode              the embedded engine (`Engine` behind `EmbeddedBackend`) decoding at
                        batch 1, 8, 64, 256: decode tokens/s and the fraction of the roofline

The three test steps run pytest with ``JAX_DEFAULT_MATMUL_PRECISION=highest``: their
tolerances are derived for fp32 arithmetic, and XLA on NVIDIA GPUs computes fp32 matmuls in
TF32 (10-bit mantissa) by default. In ``--dry-run`` they only collect (CI runs them on CPU).

MFU = model FLOPs per second / the card's peak bf16 dense FLOP/s, model FLOPs per trained
token ``8 * N_matmul + 8 * L * S * H * K`` (`bench.learner.flops_per_token`: forward and
backward 3x the forward, plus the old-policy forward; S the mean keys a token attends to);
remat's recomputed forward is not counted. Decode's roofline: a step of batch B reads every
weight once and each row's keys and values, so it takes at least
max(bytes / bandwidth, 2 * N * B / peak); the fraction is the measured decode tokens/s
(prefill and admission taken out: `_decode_step`) over B / that time.

Every timed program is also profiled (`Profiler`): after its timing, a few more calls
(`PROFILE_REPEATS` of the device's and the paged-attention programs, one RL step, one round
of each decode batch: ``short`` new tokens, prefill included) run under `jax.profiler`, and
`top_ops` reduces the trace to the 15 ops (fusions, kernels' HLO ops) with the most time a
step, each with its share of the step's total. The times are the GPU streams' kernels where
the trace has device events; on the dry run (CPU, no device streams) they are the XLA CPU
runtime's op events on the host threads, and every summary says which. The table of each is
printed; with $OUT set the step writes ``$OUT/profiles/<step>.<program>.json`` (the summary),
``.txt`` (the table) and, when it is under `RAW_TRACE_MAX`, ``.perfetto_trace.json.gz`` (the
raw trace, for ui.perfetto.dev), and its figures name them under ``profiles``.

Prints progress as it goes, ends with one JSON line (``{"gpu_check": ...}``), and with $OUT
set writes ``$OUT/gpu_check.log`` (everything printed) and ``$OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, cast

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".gpu-wheels"
RESULT = "GPU_CHECK_RESULT "  # a step's last line: this, then its JSON
DEADLINE_S = 450.0  # the whole run, under the 8 minutes it promises
MEM_FRACTION = "0.90"  # of the card's memory XLA may take (steps run one at a time)

# Peak dense bf16 FLOP/s and HBM bandwidth (bytes/s) by `device_kind`, from NVIDIA's data
# sheets (H100 Tensor Core GPU datasheet; H200 product brief): the bf16 figures there are
# with 2:4 sparsity, dense is half. The first key found in the device kind as a word wins
# (so "H100" is the SXM5 card, "NVIDIA H100 80GB HBM3", and a GH200 is none of them); a
# card matching none reports null.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835e12, 4.8e12),
    ("H200", 989e12, 4.8e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
)


def peaks_of(kind: str) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, bytes/s) of the card ``kind`` from `PEAKS`, or (None, None)."""
    for key, flops, bandwidth in PEAKS:
        if re.search(rf"\b{re.escape(key)}\b", kind):
            return flops, bandwidth
    return None, None


# -------------------------------------------------------------------------------- profiles

PROFILES = "profiles"  # the folder of $OUT the profiles go into
PROFILE_TOP = 15  # the ops a program's summary ranks
PROFILE_REPEATS = 3  # calls profiled of a program of milliseconds (of the RL step, decode's: 1)
RAW_TRACE_MAX = 256 * 1024  # bytes: a bigger gzipped trace is not kept beside its summary


def top_ops(events: list[dict[str, Any]], repeats: int, top: int = PROFILE_TOP) -> dict[str, Any]:
    """The ``top`` ops by time per step of a Chrome trace's ``events`` (the ``traceEvents``
    of `jax.profiler`'s perfetto_trace.json.gz), taken over ``repeats`` steps (a step: one
    call of the program profiled).

    Timed are the complete ("X") events of the device processes (named "/device:...": on a
    GPU, the kernels and copies of its streams), keeping those that name an XLA op
    (``args.hlo_op``: the program's own, not a transfer between calls) where any does; in a
    trace without device events (the CPU), the host's events that name an XLA op (the CPU
    runtime's thunks). ``source`` says which. An event's time is its self time: its
    duration less those of the timed events nested in it on its thread (a while loop's body
    ops count under their own names, the loop keeps the rest). Ops are keyed by (``module``,
    ``op``) (the event's name where it names no op); each has ``us``, its summed time over
    ``repeats``, ``percent`` of the step's ``total_us`` (every timed op), and ``count``, its
    events, both per step; ``rest_us`` is the time of the ops past the ``top``.
    """
    names: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = {pid for pid, name in names.items() if name.startswith("/device:")}
    timed = [e for e in complete if e["pid"] in device]
    source = "device" if timed else "host"
    if timed:
        named = [e for e in timed if "hlo_op" in e.get("args", {})]
        timed = named or timed
    else:
        timed = [e for e in complete if "hlo_op" in e.get("args", {})]
    if not timed:
        raise ValueError("the trace has no device events and no host events of XLA ops")
    self_us = _self_times(timed)
    per_op: dict[tuple[str, str], list[float]] = {}  # (module, op) -> [us, events]
    for e, us in zip(timed, self_us, strict=True):
        args = e.get("args", {})
        key = (args.get("hlo_module", ""), args.get("hlo_op", e["name"]))
        acc = per_op.setdefault(key, [0.0, 0])
        acc[0] += us
        acc[1] += 1
    total = sum(us for us, _ in per_op.values()) / repeats
    ranked = sorted(per_op.items(), key=lambda kv: (-kv[1][0], kv[0]))
    ops = [
        {
            "op": op,
            "module": module,
            "us": round(us / repeats, 3),
            "percent": round(100 * us / repeats / total, 1) if total else 0.0,
            "count": n / repeats,
        }
        for (module, op), (us, n) in ranked[:top]
    ]
    return {
        "source": source,
        "processes": sorted({names.get(e["pid"], str(e["pid"])) for e in timed}),
        "repeats": repeats,
        "events": len(timed),
        "ops_seen": len(per_op),
        "total_us": round(total, 3),
        "ops": ops,
        "rest_us": round(sum(us for _, (us, _n) in ranked[top:]) / repeats, 3),
    }


def _self_times(events: list[dict[str, Any]]) -> list[float]:
    """Each event's duration less those of the events nested directly in it on its thread
    (complete events of one thread nest or follow one another)."""
    self_us = [float(e["dur"]) for e in events]
    threads: dict[tuple[Any, Any], list[int]] = {}
    for i, e in enumerate(events):
        threads.setdefault((e["pid"], e.get("tid")), []).append(i)
    for order in threads.values():
        order.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        open_: list[tuple[float, int]] = []  # (end, index) of the events enclosing this one
        for i in order:
            start, end = events[i]["ts"], events[i]["ts"] + events[i]["dur"]
            while open_ and open_[-1][0] <= start:
                open_.pop()
            if open_:
                parent_end, parent = open_[-1]
                self_us[parent] -= min(end, parent_end) - start
            open_.append((end, i))
    return self_us


def profile_table(name: str, summary: dict[str, Any]) -> str:
    """`top_ops`'s ``summary`` of program ``name`` as a readable table."""
    where = "device streams" if summary["source"] == "device" else "host XLA op events"
    lines = [f"NOTE: {summary['note']}"] if "note" in summary else []
    lines += [
        f"{name}: top {len(summary['ops'])} of {summary['ops_seen']} ops by self time, "
        f"per step of {summary['repeats']} profiled ({where}: {', '.join(summary['processes'])})",
        f"total {summary['total_us']:.1f} us a step"
        + (f", wall {summary['wall_us']:.1f} us a step" if "wall_us" in summary else ""),
        f"{'us/step':>12} {'%':>6} {'count':>8}  op  [module]",
    ]
    for op in summary["ops"]:
        row = f"{op['us']:12.1f} {op['percent']:6.1f} {op['count']:8.6g}"
        lines.append(f"{row}  {op['op']}  [{op['module']}]")
    rest, others = summary["rest_us"], summary["ops_seen"] - len(summary["ops"])
    share = 100 * rest / summary["total_us"] if summary["total_us"] else 0.0
    lines.append(f"{rest:12.1f} {share:6.1f} {'':>8}  (the rest: {others} ops)")
    return "\n".join(lines) + "\n"


def _profiled(fn: Callable[[], Any], repeats: int, folder: Path) -> tuple[dict[str, Any], Path]:
    """`top_ops` of ``repeats`` calls of ``fn`` under `jax.profiler` (tracing into ``folder``),
    with their ``wall_us`` a call, and the trace's file."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # XLA's events only, no Python calls
    options.host_tracer_level = 1
    options.enable_hlo_proto = False
    with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn())
        wall = time.perf_counter() - t0
    (trace,) = folder.glob("plugins/profile/*/perfetto_trace.json.gz")
    with gzip.open(trace) as f:
        summary = top_ops(json.load(f)["traceEvents"], repeats)
    summary["wall_us"] = round(wall / repeats * 1e6, 1)
    summary["platform"] = jax.devices()[0].platform
    if summary["source"] == "host" and summary["platform"] != "cpu":
        summary["note"] = "no device events: these are the host's, not the card's"
    return summary, trace


@dataclasses.dataclass(frozen=True)
class Profiler:
    """Profiles a step's timed programs: prints each summary's table, and writes the summary
    (`top_ops`), the table and the raw trace (up to `RAW_TRACE_MAX`) into ``folder`` (when
    given) as ``<step>.<program>.json``, ``.txt`` and ``.perfetto_trace.json.gz``."""

    step: str
    folder: Path | None  # $OUT/profiles

    def __call__(self, program: str, fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
        """Profiles ``repeats`` calls of ``fn`` (compiled already): what the step's figures
        say of it (its files, relative to $OUT; or its error)."""
        name = f"{self.step}.{program}"
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="gpu_check_trace_") as tmp:
                summary, trace = _profiled(fn, repeats, Path(tmp))
                out = self._keep(name, summary, trace)
        except Exception as e:  # a profile lost is no reason to lose the step's figures
            print(f"profile of {name} failed: {e!r}", flush=True)
            out = {"error": repr(e)}
        out["seconds"] = round(time.perf_counter() - start, 1)  # what profiling took
        return out

    def _keep(self, name: str, summary: dict[str, Any], trace: Path) -> dict[str, Any]:
        table = profile_table(name, summary)
        print(table, flush=True)
        top = summary["ops"][0]
        out: dict[str, Any] = {
            "source": summary["source"],
            "total_us": summary["total_us"],
            "top": f"{top['op']} {top['percent']}%",
        }
        if self.folder is None:
            return out
        self.folder.mkdir(parents=True, exist_ok=True)
        files = {"summary": f"{name}.json", "table": f"{name}.txt"}
        summary["raw_trace_bytes"] = trace.stat().st_size
        if summary["raw_trace_bytes"] <= RAW_TRACE_MAX:
            files["trace"] = f"{name}.perfetto_trace.json.gz"
            shutil.copyfile(trace, self.folder / files["trace"])
        (self.folder / files["summary"]).write_text(json.dumps(summary, indent=1) + "\n")
        (self.folder / files["table"]).write_text(table)
        return out | {k: f"{self.folder.name}/{v}" for k, v in files.items()}


# -------------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    box_s: float  # its time box on the GPU (the dry run's too)
    pytest: tuple[str, ...] = ()  # a pytest selection, else the step is `run_step`'s


STEPS = (
    Step("device", 60),
    Step("paged_attention", 60),
    Step("hf_parity", 120, ("tests/models/test_parity.py",)),
    Step(
        "moe_parity",
        120,
        ("tests/models/test_moe.py", "-k", "matches or cached or grouped or replay or greedy"),
    ),
    Step(
        "sampler_vs_learner",
        100,
        ("tests/rl/test_learner.py", "-k", "test_learner_logprobs_equal_the_samplers"),
    ),
    Step("cuda_push", 90),
    Step("learner_step", 180),
    Step("decode", 200),
)


def _card(dry: bool) -> tuple[Any, float | None, float | None]:
    """JAX's first device and its peaks (`peaks_of`); off the dry run it must be a GPU."""
    import jax

    dev = jax.devices()[0]
    if not dry and dev.platform != "gpu":
        raise RuntimeError(f"JAX's first device is {dev} ({dev.platform}), not a GPU")
    return (dev, *peaks_of(dev.device_kind))


def _memory_gib(dev: Any, stat: str) -> float | None:
    """The device's memory statistic ``stat`` in GiB (None where its allocator has none)."""
    value = (dev.memory_stats() or {}).get(stat)
    return None if value is None else round(value / 2**30, 1)


def _device_step(dry: bool, profile: Profiler) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import jaxlib

    dev, flops, bandwidth = _card(dry)
    out: dict[str, Any] = {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "devices": len(jax.devices()),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "peak_bf16_tflops": None if flops is None else flops / 1e12,
        "peak_hbm_tb_s": None if bandwidth is None else bandwidth / 1e12,
        "memory_gib": _memory_gib(dev, "bytes_limit"),
    }
    # an n^3 bf16 matmul (fp32 accumulation) and a sum over ``floats`` fp32 numbers, big
    # enough on the GPU (1.1 TFLOP, 2 GiB) that a call's overhead is small beside them
    n, floats = (256, 2**20) if dry else (8192, 2**29)
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    out["measured_bf16_tflops"] = round(2 * n**3 / _timed(lambda: matmul(a), 5) / 1e12, 1)
    x = jnp.ones((floats,), jnp.float32)
    out["measured_bandwidth_tb_s"] = round(x.nbytes / _timed(lambda: jnp.sum(x), 5) / 1e12, 3)
    out["profiles"] = {
        "matmul": profile("matmul", lambda: matmul(a), PROFILE_REPEATS),
        "reduction": profile("reduction", lambda: jnp.sum(x), PROFILE_REPEATS),
    }
    return out


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """The best of ``repeats`` wall times of ``fn`` (after one call, which compiles)."""
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


@dataclasses.dataclass(frozen=True)
class PagedShape:
    rows: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_row: int  # a row's page table: pages_per_row * page_size positions
    k_splits: int  # the kernel's partitions of a row's pages (they must divide them)


# Qwen2.5-1.5B's attention (12 query heads over 2 kv heads, head dim 128), 1024 positions
PAGED_GPU = PagedShape(64, 12, 2, 128, 16, 64, 8)
PAGED_DRY = PagedShape(4, 4, 2, 32, 16, 8, 2)
PAGES_PER_BLOCK = 4  # the kernel's pages per compute block (64 positions: a power of two)


def _paged_kernel(s: PagedShape, interpret: bool) -> tuple[Callable[..., Any], str]:
    """``out = kernel(q [B, H, K] scaled, k_pages, v_pages, table [B, M], lengths [B])`` by
    JAX's Pallas GPU (Triton) paged-attention kernel, and the warning its import gives."""
    import warnings

    import jax

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    fn = jax.jit(
        lambda q, k, v, table, lengths: paged_attention(
            q,
            k,
            v,
            table,
            lengths,
            k_splits=s.k_splits,
            pages_per_compute_block=PAGES_PER_BLOCK,
            interpret=interpret,
        )
    )
    return fn, "; ".join(str(w.message) for w in caught)


def _lower_for_gpu(s: PagedShape, device_kind: str) -> int:
    """Lowers the kernel at shape ``s`` through Triton for an abstract ``device_kind`` card
    (no GPU needed): the size of the program's text, which holds the Triton module."""
    import jax
    import jax.numpy as jnp

    kernel, _ = _paged_kernel(s, interpret=False)
    B, P = s.rows, s.rows * s.pages_per_row
    pages = jax.ShapeDtypeStruct((s.kv_heads, P, s.page_size, s.head_dim), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((B, s.heads, s.head_dim), jnp.bfloat16),
        pages,
        pages,
        jax.ShapeDtypeStruct((B, s.pages_per_row), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
    )
    card = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=card)
    ):
        traced = cast(Any, kernel).trace(*args)  # a jitted function
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    if "xla.gpu.triton" not in text:
        raise AssertionError("the kernel did not lower to a Triton call")
    return len(text)


def _paged_attention_step(dry: bool, profile: Profiler) -> dict[str, Any]:
    """JAX's Pallas GPU paged-attention kernel against `ragged_attention` (on the dry run in
    Pallas's interpret mode at a tiny shape, and lowered through Triton at the GPU's shape
    for an abstract H100).

    Both read the same bf16 pool; the reference computes in fp32 from the kernel's own
    (bf16, pre-scaled) queries, so its error is fp32 rounding (~1e-6 relative, negligible).
    The kernel's error, with u = 2^-8 (the bf16 bound the project's kernel tests use) and
    W = P|V| (the exact weights times the values' magnitudes, per output entry; |O| <= W):
    its unnormalised weights rounded to bf16 for the values' matmul (u W); each of the
    ``k_splits`` partial outputs stored in bf16 (u W), rescaled by a bf16 correction (2 u W)
    and summed in bf16 ((k_splits - 1) u W); the sum's normaliser and division in bf16
    (2 u W): at most (k_splits + 5) u W in all.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_agent_rl.models.paged import page_pairs, pair_block, ragged_attention

    _card(dry)
    s = PAGED_DRY if dry else PAGED_GPU
    B, H, G, K, ps, M = s.rows, s.heads, s.kv_heads, s.head_dim, s.page_size, s.pages_per_row
    P = B * M  # the pool: every row's pages, shuffled
    rng = np.random.default_rng(0)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, H, K), jnp.float32)
    k_pages = jax.random.normal(kk, (G, P, ps, K), jnp.float32).astype(jnp.bfloat16)
    v_pages = jax.random.normal(kv, (G, P, ps, K), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(rng.permutation(P).reshape(B, M), jnp.int32)
    pos = jnp.asarray(rng.integers(0, M * ps, B), jnp.int32)  # the query's position per row
    pos = pos.at[0].set(M * ps - 1)  # one row of full length
    q_kernel = (q * K**-0.5).astype(jnp.bfloat16)  # the kernel does not scale
    C = pair_block(ps)
    pairs = page_pairs(table, pos, jnp.ones(B, bool), -(-B * M // C) * C, ps)
    # the reference gets the kernel's queries, unscaled in fp32 (it scales them back)
    q_ref = q_kernel.astype(jnp.float32) * K**0.5
    ref_fn = jax.jit(lambda q, k, v: ragged_attention(q, k, v, pairs, pos))
    kernel, warned = _paged_kernel(s, interpret=dry)
    want = np.asarray(ref_fn(q_ref, k_pages, v_pages))
    weights = np.asarray(ref_fn(q_ref, k_pages, jnp.abs(v_pages)))  # P|V| per entry
    got = np.asarray(kernel(q_kernel, k_pages, v_pages, table, pos + 1).astype(jnp.float32))
    bound = (s.k_splits + 5) * 2.0**-8 * weights
    err = np.abs(got - want)
    out: dict[str, Any] = {
        "kernel": "jax.experimental.pallas.ops.gpu.paged_attention",
        "import_warning": warned or None,
        **dataclasses.asdict(s),
        "max_abs_err": float(err.max()),
        "max_err_over_bound": float((err / bound).max()),
    }
    if not (err <= bound).all():
        raise AssertionError(f"kernel vs reference beyond the rounding bound: {out}")
    programs = {
        "kernel": lambda: kernel(q_kernel, k_pages, v_pages, table, pos + 1),
        "xla_ragged": lambda: ref_fn(q_kernel, k_pages, v_pages),
    }
    if dry:
        out["triton_lowered_h100_chars"] = _lower_for_gpu(PAGED_GPU, "NVIDIA H100 80GB HBM3")
        for fn in programs.values():  # compiled before they are profiled
            jax.block_until_ready(fn())
    else:
        for name, fn in programs.items():
            out[f"{name}_us"] = round(_timed(fn, 20) * 1e6)
    out["profiles"] = {name: profile(name, fn, PROFILE_REPEATS) for name, fn in programs.items()}
    return out


def _learner_step(dry: bool, profile: Profiler) -> dict[str, Any]:
    import jax
    import numpy as np
    from learner import (  # bench/ is the script's folder: first on its path
        CompileCounter,
        attended_keys,
        flops_per_token,
        make_workload,
        packed_batch,
    )

    from jax_agent_rl.config import AlgorithmSection, OptimSection
    from jax_agent_rl.models import ModelConfig, init_params
    from jax_agent_rl.models.attention_kernels import training_kernel
    from jax_agent_rl.models.hf_local import TINY_QWEN2
    from jax_agent_rl.models.sharding import one_device_sharder
    from jax_agent_rl.plan.presets import preset_model
    from jax_agent_rl.rl.learner import Learner
    from jax_agent_rl.rl.objectives import SamplingSpec

    dev, peak, _ = _card(dry)
    counter = CompileCounter()
    cfg = ModelConfig.from_hf(TINY_QWEN2) if dry else preset_model("qwen2.5-1.5b")
    row_tokens, seq, steps = (256, 64, 1) if dry else (8192, 512, 3)
    learner = Learner(
        cfg,
        algo=AlgorithmSection(clip_low=0.2, clip_high=0.2, clip_c=None, tis_cap=None),
        optim=OptimSection(lr=1e-6, weight_decay=0.0, grad_clip=1.0),
        sampling=SamplingSpec(),
        compute_dtype="bfloat16",
        micro_batch_size=1,
        remat=True,
        sharder=one_device_sharder(),
    )
    # fp32 master weights
    state = learner.init_state(init_params(jax.random.key(0), cfg, sharder=one_device_sharder()))
    w = make_workload("uniform", row_tokens // seq, cfg.vocab_size, seq)
    batch, sequences, real = packed_batch(w, row_tokens)
    t0 = time.perf_counter()
    state, first, _ = learner.rl_update(state, batch, sequences, real)
    jax.block_until_ready(state.policy.params)
    first_s = time.perf_counter() - t0
    compiles = counter.count

    def step() -> Any:
        nonlocal state
        state, _, _ = learner.rl_update(state, batch, sequences, real)
        return state.policy.params

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t0)
    step_s = min(times)
    profiled = profile("rl_update", step, 1)
    fpt = flops_per_token(cfg, attended_keys(w))
    tok_s = w.tokens / step_s
    out = {
        "params": cfg.num_params,
        "tokens": w.tokens,
        "rows": int(batch.shape[0]),
        "row_tokens": int(batch.shape[-1]),
        "first_step_s": round(first_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tok_s),
        "flops_per_token": round(fpt),
        "mfu": None if peak is None else round(tok_s * fpt / peak, 4),
        "compiles_in_timed_steps": counter.count - compiles,
        # the fused attention kernel the step ran (None: the XLA loop)
        "attention_kernel": training_kernel(learner.sharder, learner.spec.compute_dtype),
        "loss": float(first["loss"]),
        # what the step held at most on the card (weights, Adam, activations)
        "peak_memory_gib": _memory_gib(dev, "peak_bytes_in_use"),
        "profiles": {"rl_update": profiled},
    }
    if not np.isfinite(float(first["loss"])):
        raise AssertionError(f"the first step's loss is {out['loss']}")
    return out


def decode_roofline(cfg: Any, batch: int, positions: float, peak: float, bandwidth: float) -> float:
    """The most tokens/s a bf16 decode step of ``batch`` rows of ``positions`` cached
    positions each can give: it reads every weight once and each row's keys and values, and
    computes 2 FLOPs per weight per row (attention's FLOPs are small beside them)."""
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # per position
    step_bytes = 2 * cfg.num_params + batch * positions * kv_bytes
    return batch / max(step_bytes / bandwidth, 2 * cfg.num_params * batch / peak)


def _decode_step(dry: bool, profile: Profiler) -> dict[str, Any]:
    """Each batch B on an engine of B slots: B requests of ``short`` new tokens, then of
    ``long`` (`bench.decode.throughput`: a warm-up round, then the best of two). Decode's
    tokens/s is B (long - short) over the difference of their times, so the prompts'
    prefill and the requests' admission cancel; ``tokens_per_s`` is the long run's whole.
    The profile ``bB`` is of one more round of ``short`` (its prefill included)."""
    import asyncio

    import jax
    import numpy as np
    from decode import throughput

    from jax_agent_rl.engine import Engine
    from jax_agent_rl.models import ModelConfig, init_params
    from jax_agent_rl.models.hf_local import TINY_QWEN2
    from jax_agent_rl.models.sharding import one_device_sharder
    from jax_agent_rl.plan.presets import preset_model
    from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams

    _, peak, bandwidth = _card(dry)
    base = ModelConfig.from_hf(TINY_QWEN2) if dry else preset_model("qwen2.5-1.5b")
    cfg = dataclasses.replace(base, dtype="bfloat16")
    params = init_params(jax.random.key(0), cfg, sharder=one_device_sharder())
    prompt, short, long = (8, 8, 24) if dry else (32, 32, 160)
    batches = (2,) if dry else (1, 8, 64, 256)
    out: dict[str, Any] = {"params": cfg.num_params, "prompt": prompt, "new": [short, long]}
    out["profiles"] = {}
    rng = np.random.default_rng(1)

    def round_of(backend: EmbeddedBackend, batch: int) -> None:
        """``batch`` requests of ``short`` new tokens at once."""
        requests = [
            GenerateRequest(
                f"profiled{i}",
                tuple(int(t) for t in rng.integers(0, cfg.vocab_size, prompt)),
                SamplingParams(max_tokens=short, temperature=1.0),
            )
            for i in range(batch)
        ]

        async def run() -> None:
            await asyncio.gather(*(backend.generate(r) for r in requests))

        asyncio.run(run())

    for B in batches:
        engine = Engine(
            cfg,
            max_concurrent_decodes=B,
            max_len=prompt + long,
            batch_buckets=False,
            sharder=one_device_sharder(),
        )
        backend = EmbeddedBackend(engine, params, steps_per_call=8)
        try:
            seconds = {
                n: B * n / throughput(backend, cfg.vocab_size, B, prompt, n) for n in (short, long)
            }
            out["profiles"][f"b{B}"] = profile(f"b{B}", functools.partial(round_of, backend, B), 1)
        finally:
            asyncio.run(backend.close())
        tok_s = B * (long - short) / (seconds[long] - seconds[short])
        fraction = None
        if peak is not None and bandwidth is not None:
            # the rows' mean length over the steps between short and long
            bound = decode_roofline(cfg, B, prompt + (short + long) / 2, peak, bandwidth)
            fraction = round(tok_s / bound, 4)
        out[f"b{B}"] = {
            "decode_kernel": engine.decode_kernel,
            "decode_tokens_per_s": round(tok_s, 1),
            "roofline_fraction": fraction,
            "tokens_per_s": round(B * long / seconds[long], 1),
        }
        print(RESULT + json.dumps(out), flush=True)  # so far: kept if a later batch times out
    return out


def _cuda_push_step(dry: bool, profile: Profiler) -> dict[str, Any]:
    """`STEPS`' cuda_push (module docstring): the transport's decision, then the check."""
    del profile  # (a transfer between processes: no program of this one to profile)
    import jax.numpy as jnp

    from jax_agent_rl.backends.vllm import cuda_ipc

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    transport, why = cuda_ipc.push_transport(cuda_ipc.learner_gpus([jnp.zeros(1)], visible), [""])
    check = [sys.executable, str(ROOT / "bench" / "cuda_push_check.py")]
    done = subprocess.run(
        check + (["--dry-run"] if dry else []), capture_output=True, text=True, check=False
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = " / ".join((done.stderr.strip().splitlines() or lines or [""])[-3:])
        raise RuntimeError(f"bench/cuda_push_check.py exited {done.returncode}: {tail}")
    return {"transport": transport, "why": why, **json.loads(lines[-1])["cuda_push_check"]}


STEP_FUNCTIONS: dict[str, Callable[[bool, Profiler], dict[str, Any]]] = {
    "device": _device_step,
    "paged_attention": _paged_attention_step,
    "cuda_push": _cuda_push_step,
    "learner_step": _learner_step,
    "decode": _decode_step,
}


def run_step(name: str, dry: bool, profiles: Path | None) -> None:
    """The body of a step process: its figures as the last line (`RESULT`), its profiles
    into ``profiles`` (if given)."""
    sys.path.insert(0, str(ROOT))
    out = STEP_FUNCTIONS[name](dry, Profiler(name, profiles))
    print(RESULT + json.dumps(out), flush=True)


# -------------------------------------------------------------------------------- setup


def _wheel_modules(wheel: Path) -> set[str]:
    """The top-level modules and packages a wheel installs."""
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
    names = set()
    for top in tops:
        if top.endswith((".dist-info", ".data")):
            continue
        names.add(top.split(".")[0] if top.endswith((".py", ".so")) else top)
    return names


def unpack_missing_wheels(target: Path, say: Callable[[str], None]) -> list[str]:
    """Unpacks into ``target`` each wheel of `WHEELS` none of whose modules this Python
    imports already (the machine's own packages win); returns the wheels unpacked."""
    unpacked = []
    for wheel in sorted(WHEELS.glob("*.whl")):
        modules = _wheel_modules(wheel)
        if modules and all(importlib.util.find_spec(m) is None for m in modules):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
            unpacked.append(wheel.name)
    say(f"unpacked {len(unpacked)} of {len(list(WHEELS.glob('*.whl')))} wheels: {unpacked}")
    return unpacked


# -------------------------------------------------------------------------------- driver


class Log:
    """Prints and keeps every line (written to $OUT/gpu_check.log when $OUT is set)."""

    def __init__(self, out_dir: Path | None) -> None:
        self.file: TextIO | None = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.file = (out_dir / "gpu_check.log").open("w")
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            if self.file is not None:
                self.file.write(line + "\n")
                self.file.flush()


def _spawn(cmd: list[str], env: dict[str, str], timeout: float, say: Log) -> tuple[int, list[str]]:
    """Runs ``cmd`` in its own process group, echoing its output; kills the group at
    ``timeout``. Returns its exit status (`TIMED_OUT` if killed) and its lines."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            say("  | " + lines[-1])

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = TIMED_OUT
    reader.join(timeout=5)
    return rc, lines


TIMED_OUT = -1000  # `_spawn`'s status of a process it killed (not one a process can exit with)
# pytest plugins a test step does without: its cache, and two that installed packages register
# and the selected tests never use, whose imports were half of a step's start (hypothesis's and
# langsmith's: 4.7 of 9.9 CPU seconds to collect the sampler_vs_learner test). A name no
# package registers is no error.
PYTEST_PLUGINS_OFF = (
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:langsmith_plugin",
)


def _pytest_counts(lines: list[str]) -> dict[str, int]:
    """pytest's summary counts ("3 passed, 1 failed in 2.0s"; collect-only: "2/27 tests
    collected (25 deselected)" counts 2)."""
    out: dict[str, int] = {}
    for line in lines[-5:]:
        for n, what in re.findall(
            r"(\d+)(?:/\d+)? (passed|failed|errors?|skipped|tests? collected)", line
        ):
            out["collected" if "collected" in what else what] = int(n)
    return out


def run_one(
    step: Step, dry: bool, env: dict[str, str], box: float, say: Log, out_dir: Path | None
) -> dict[str, Any]:
    """Runs ``step`` in its own process within ``box`` seconds: its figures and ``status``
    (passed, failed or timeout) with the ``error`` of a step that did not pass; its profiles
    go into ``out_dir``/profiles (if given)."""
    if step.pytest:
        # the tests' tolerances are for fp32 arithmetic (XLA's GPU default is TF32)
        env = {**env, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
        cmd = [sys.executable, "-m", "pytest", *PYTEST_PLUGINS_OFF, "-q", *step.pytest]
        cmd += ["--collect-only"] if dry else []
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step.name]
        cmd += ["--dry-run"] if dry else []
        cmd += [] if out_dir is None else ["--profiles", str(out_dir / PROFILES)]
    t0 = time.monotonic()
    rc, lines = _spawn(cmd, env, box, say)
    result: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1)}
    if step.pytest:
        result.update(_pytest_counts(lines))
    found = [ln for ln in lines if ln.startswith(RESULT)]
    if found:  # the last figures it printed (a timed-out step's so far)
        result.update(json.loads(found[-1][len(RESULT) :]))
    ran = result.get("collected" if dry else "passed", 0) > 0
    if rc == TIMED_OUT:
        result.update(status="timeout", error=f"killed after its box of {box:.0f}s")
    elif rc != 0 or (step.pytest and not ran):
        tail = [ln for ln in lines if ln.strip()][-3:]
        result.update(status="failed", error=f"exit {rc}: " + " / ".join(tail))
    else:
        result["status"] = "passed"
    return result


def run_check(
    dry: bool, out_dir: Path | None, only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Every step of `STEPS` (those named in ``only``) in order within `DEADLINE_S`: the
    summary (also printed as the last line, and written to ``out_dir``)."""
    say = Log(out_dir)
    start = time.monotonic()
    say(f"gpu_check: {'dry run on CPU' if dry else 'GPU run'} in {ROOT}")
    say(f"python: {sys.executable} {sys.version.split()[0]}")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu" if dry else "cuda,cpu",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": MEM_FRACTION,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    if not dry:  # outside the tree: a second run on the same machine skips the compiles
        env["JAX_COMPILATION_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "gpu_check_jax_cache")
    summary: dict[str, Any] = {"dry_run": dry, "steps": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as site:
        paths = [str(ROOT)]
        if WHEELS.is_dir():
            try:
                summary["unpacked_wheels"] = unpack_missing_wheels(Path(site), say)
            except (OSError, zipfile.BadZipFile) as e:  # the steps will say what is missing
                summary["unpack_error"] = repr(e)
                say(f"unpacking {WHEELS.name}/ failed: {e!r}")
            paths.append(site)
        else:
            say(f"no {WHEELS.name}/: the machine's own packages only")
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        for step in (s for s in STEPS if only is None or s.name in only):
            elapsed = time.monotonic() - start
            box = min(step.box_s, DEADLINE_S - elapsed)
            if box < 10:
                result = {"status": "skipped", "error": "no time left in the run"}
            else:
                say(f"== {step.name} (box {box:.0f}s, {elapsed:.0f}s into the run)")
                try:
                    result = run_one(step, dry, env, box, say, out_dir)
                except Exception as e:  # a step that could not even run: the others still do
                    result = {"status": "failed", "error": f"the check itself: {e!r}"}
            say(f"== {step.name}: {result['status']} ({result.get('seconds', 0)}s)")
            summary["steps"][step.name] = result
    summary["seconds"] = round(time.monotonic() - start, 1)
    summary["passed"] = all(s["status"] == "passed" for s in summary["steps"].values())
    if out_dir is not None:
        (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(json.dumps({"gpu_check": summary}))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[s.name for s in STEPS],
        help="run these steps only (default: every step), e.g. --only device moe_parity",
    )
    parser.add_argument("--step", choices=sorted(STEP_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--profiles", type=Path, help=argparse.SUPPRESS)  # a step's folder
    args = parser.parse_args()
    if args.step:
        run_step(args.step, args.dry_run, args.profiles)
        return
    out = os.environ.get("OUT")
    only = tuple(args.only) if args.only else None
    summary = run_check(args.dry_run, Path(out) if out else None, only)
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
