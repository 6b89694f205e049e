"""Train-step throughput: the JAX `Learner` against a PyTorch implementation of the same step.

Both sides load the SAME locally written Qwen2-style checkpoint (`SMALL_QWEN2`, ~40M
parameters: hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 32000, tied embeddings) and train
on the SAME fixed batch (default 8 rows x 512 tokens, random token ids; loss mask on the last
256 targets of each row, the "response"; advantages +1 / -1 by row; old logprobs = the fp32
model's own logprobs plus small fixed noise). One step is: forward to fp32 logits, log-softmax,
target logprobs (JAX: a vocabulary chunk at a time, `head_logprobs`, with each token's entropy
for the metrics; torch: all [B, T, V] logits at once), PPO clipped surrogate (ratio =
exp(logp - old), clip 0.2, no dual clip, no importance weights), token-mean over the mask,
backward, global-norm clipping at 1.0, AdamW.
Master weights and optimizer state are fp32 everywhere.

    torch_fp32    transformers' Qwen2ForCausalLM, eager, torch.optim.AdamW, 2 threads
    torch_bf16    the same under torch.autocast("cpu", bfloat16) for forward + loss
    jax_fp32      Learner.update_policy on 1 CPU device, compute_dtype="float32"
    jax_bf16      the same with compute_dtype="bfloat16"
    jax_dp2_*     a data=2 mesh over 2 CPU devices (rows split evenly between them)

Each variant warms up (torch: 1 step; JAX: 2 steps, the first compiling; the timed steps must
not compile again, checked), then times --steps steps one by one; tokens/s = batch tokens /
median step time.

FLOPs per trained token (forward + backward = 3x the forward's)::

    6 * N_matmul + 6 * L * T * H * K
    N_matmul = L * (D * K * (2 H + 2 KV) + 3 * D * F) + V * D   (layer weights + the tied head)

the second term being the attention scores and values (2 matmuls of 2 * T * H * K FLOPs per
token per layer in the forward, halved for the causal mask). MFU = tokens/s * FLOPs per token /
the matmul peak of the variant's dtype, measured in the same run as the best of torch's
``a @ b`` and a jitted ``jnp.dot`` on 2048 x 2048 operands.

    .venv/bin/python bench/learner.py [--steps 5] [--batch 8] [--seq 512] [--quick]

Ends with one JSON line. Timings are noisy on a shared 2-core machine: compare figures from
the same run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MATMUL_N = 2048


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class HostBatch:
    """The fixed batch, as numpy arrays shared by both frameworks."""

    tokens: np.ndarray  # [B, T] int
    targets: np.ndarray  # [B, T] int, tokens shifted left by one
    mask: np.ndarray  # [B, T] float32
    advantages: np.ndarray  # [B, T] float32
    old_logp: np.ndarray  # [B, T] float32


def make_host_batch(batch: int, seq: int, response: int, vocab: int) -> HostBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    mask = np.zeros((batch, seq), np.float32)
    mask[:, seq - response - 1 : seq - 1] = 1.0  # as make_batch: target t is predicted at t
    sign = np.where(np.arange(batch) % 2 == 0, 1.0, -1.0).astype(np.float32)
    advantages = np.broadcast_to(sign[:, None], (batch, seq)).copy()
    return HostBatch(tokens, targets, mask, advantages, np.zeros((batch, seq), np.float32))


def flops_per_token(cfg: Any, seq: int) -> float:
    D, F, K, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    H, KV, V = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    n_matmul = L * (D * K * (2 * H + 2 * KV) + 3 * D * F) + V * D
    return 6 * n_matmul + 6 * L * seq * H * K


def step_seconds(step: Callable[[], object], warmup: int, steps: int) -> tuple[float, list[float]]:
    """The first step's wall time, and those of the ``steps`` steps after ``warmup``."""
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[0], times[warmup:]


# -------------------------------------------------------------------------------- peaks


def torch_peak(dtype: Any, repeats: int = 5) -> float:
    import torch

    a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * MATMUL_N**3 / best


def jax_peak(dtype: Any, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((MATMUL_N, MATMUL_N), dtype)
    b = jnp.ones((MATMUL_N, MATMUL_N), dtype) * 0.5
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * MATMUL_N**3 / best


# -------------------------------------------------------------------------------- torch


def torch_old_logp(ckpt: Path, hb: HostBatch) -> np.ndarray:
    """The fp32 model's logprob of every target, plus fixed noise (so ratios are not all 1)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(hb.tokens).long()).logits.float()
        logp = torch.log_softmax(logits, -1)
        logp = logp.gather(-1, torch.from_numpy(hb.targets).long()[..., None])[..., 0]
    noise = np.random.default_rng(1).normal(0.0, 0.05, logp.shape).astype(np.float32)
    return (logp.numpy() + noise) * hb.mask


def torch_train(
    ckpt: Path, hb: HostBatch, bf16: bool, steps: int
) -> tuple[float, list[float], float, int]:
    """First and timed step times, the first step's loss (and 0 compilations) of the PyTorch
    implementation: one warm-up step (nothing to compile)."""
    import contextlib

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True
    )
    ids = torch.from_numpy(hb.tokens).long()
    targets = torch.from_numpy(hb.targets).long()
    mask = torch.from_numpy(hb.mask)
    adv = torch.from_numpy(hb.advantages)
    old = torch.from_numpy(hb.old_logp)
    losses: list[float] = []

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=ids).logits
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            logp = logp_all.gather(-1, targets[..., None])[..., 0]
            log_ratio = torch.where(mask > 0, logp - old, torch.zeros_like(logp))
            ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
            l1 = -adv * ratio
            l2 = -adv * ratio.clamp(0.8, 1.2)
            loss = (torch.maximum(l1, l2) * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    first, timed = step_seconds(step, 1, steps)
    return first, timed, losses[0], 0


# -------------------------------------------------------------------------------- jax


class CompileCounter:
    """Counts XLA backend compilations (a listener on JAX's monitoring events)."""

    def __init__(self) -> None:
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def jax_train(
    ckpt: Path, hb: HostBatch, dtype: str, data: int, steps: int, counter: CompileCounter
) -> tuple[float, list[float], float, int]:
    """First and timed step times, the first step's loss, and the compilations seen during the
    timed steps."""
    import jax

    from jax_agent_rl.config import AlgorithmSection, OptimSection
    from jax_agent_rl.models import Sharder, load_hf, make_mesh
    from jax_agent_rl.rl.batch import TrainBatch
    from jax_agent_rl.rl.learner import Learner, SamplingSpec

    cfg, params = load_hf(ckpt, dtype="float32")
    B, T = hb.tokens.shape
    sharder = None if data == 1 else Sharder(make_mesh(data, 1, 1, jax.devices()[:data]))
    learner = Learner(
        cfg,
        params,
        algo=AlgorithmSection(clip_low=0.2, clip_high=0.2, clip_c=None, tis_cap=None),
        optim=OptimSection(lr=1e-6, weight_decay=0.0, grad_clip=1.0),
        sampling=SamplingSpec(),
        compute_dtype=dtype,  # type: ignore[arg-type]
        micro_batch_size=B,
        sharder=sharder,
    )
    del params
    zeros = np.zeros((B, T), np.float32)
    batch = TrainBatch(
        tokens=hb.tokens,
        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        segment_ids=np.ones((B, T), np.int32),
        targets=hb.targets,
        mask=hb.mask,
        rollout_logp=hb.old_logp,
        advantages=hb.advantages,
        old_logp=hb.old_logp,
        ref_logp=zeros,
        old_values=zeros,
        returns=zeros,
    )
    losses: list[float] = []
    compiles_before = [0]

    def step() -> None:
        if len(losses) == 2:  # warm-up done: from here on nothing may compile
            compiles_before[0] = counter.count
        losses.append(learner.update_policy(batch)["loss"])
        jax.block_until_ready(learner.state.params)

    first, timed = step_seconds(step, 2, steps)
    return first, timed, losses[0], counter.count - compiles_before[0]


# -------------------------------------------------------------------------------- main


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--batch", type=int, default=None, help="rows (default 8)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 512)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 x 256, 2 steps")
    parser.add_argument("--no-dp2", action="store_true", help="skip the data=2 mesh variants")
    return parser.parse_args()


def _finish(
    out: dict[str, Any],
    tok_s: dict[str, float],
    peaks: dict[str, dict[str, float]],
    extra: dict[str, Any],
) -> None:
    """Adds the throughputs, peaks and ratio to ``out`` and prints it as the JSON line."""
    for name, v in tok_s.items():
        out[f"{name}_tok_s"] = round(v, 1)
    for d, p in peaks.items():
        out[f"peak_{d}_gflops"] = round(max(p.values()) / 1e9, 1)
        out[f"peak_{d}_gflops_torch"] = round(p["torch"] / 1e9, 1)
        out[f"peak_{d}_gflops_jax"] = round(p["jax"] / 1e9, 1)
    out.update(extra)
    best_jax = max(v for k, v in tok_s.items() if k.startswith("jax"))
    best_torch = max(v for k, v in tok_s.items() if k.startswith("torch"))
    out["best_jax_over_best_torch"] = round(best_jax / best_torch, 3)
    out["goal_1_3x_met"] = best_jax / best_torch >= 1.3
    print(json.dumps(out))


def main() -> None:
    args = _args()
    steps = args.steps or (2 if args.quick else 5)
    B = args.batch or (2 if args.quick else 8)
    T = args.seq or (256 if args.quick else 512)
    response = T // 2

    # 2 CPU devices for the data=2 mesh: only possible before JAX's first operation
    from jax_agent_rl.models import request_cpu_devices

    request_cpu_devices(2)
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from jax_agent_rl.models import load_hf
    from jax_agent_rl.models.hf_local import SMALL_QWEN2, write_hf_checkpoint

    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()
    counter = CompileCounter()
    dp2 = not args.no_dp2 and len(jax.devices()) >= 2 and B % 2 == 0
    if not args.no_dp2 and not dp2:
        log(f"skipping data=2: {len(jax.devices())} devices, batch {B}")

    out: dict[str, Any] = {"bench": "learner", "model": "small_qwen2"}
    tok_s: dict[str, float] = {}
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / "small", SMALL_QWEN2)
        cfg = load_hf(ckpt)[0]
        fpt = flops_per_token(cfg, T)
        out.update(params=cfg.num_params, batch=[B, T], response=response, steps=steps)
        out["flops_per_token"] = fpt

        peaks = {
            "fp32": {"torch": torch_peak(torch.float32), "jax": jax_peak(jnp.float32)},
            "bf16": {"torch": torch_peak(torch.bfloat16), "jax": jax_peak(jnp.bfloat16)},
        }
        for d, p in peaks.items():
            log(f"matmul peak {d}: torch {p['torch'] / 1e9:.1f}, jax {p['jax'] / 1e9:.1f} GFLOP/s")

        hb = make_host_batch(B, T, response, cfg.vocab_size)
        hb.old_logp = torch_old_logp(ckpt, hb)

        variants: list[tuple[str, Callable[[], tuple[float, list[float], float, int]]]] = [
            ("torch_fp32", lambda: torch_train(ckpt, hb, False, steps)),
            ("torch_bf16", lambda: torch_train(ckpt, hb, True, steps)),
            ("jax_fp32", lambda: jax_train(ckpt, hb, "float32", 1, steps, counter)),
            ("jax_bf16", lambda: jax_train(ckpt, hb, "bfloat16", 1, steps, counter)),
        ]
        if dp2:
            variants += [
                ("jax_dp2_fp32", lambda: jax_train(ckpt, hb, "float32", 2, steps, counter)),
                ("jax_dp2_bf16", lambda: jax_train(ckpt, hb, "bfloat16", 2, steps, counter)),
            ]
        for name, run in variants:
            first, timed, loss, recompiles = run()
            tok_s[name] = B * T / statistics.median(timed)
            dtype = "bf16" if name.endswith("bf16") else "fp32"
            peak = max(peaks[dtype].values())
            extra[f"mfu_{name}"] = round(tok_s[name] * fpt / peak, 4)
            extra[f"first_step_s_{name}"] = round(first, 2)
            extra[f"loss_{name}"] = round(loss, 6)
            if name.startswith("jax"):
                extra[f"recompiles_{name}"] = recompiles
            log(
                f"{name}: {tok_s[name]:.0f} tok/s (steps {', '.join(f'{t:.2f}' for t in timed)}"
                f" s; first {first:.1f} s), loss {loss:.6f}"
            )

    _finish(out, tok_s, peaks, extra)


if __name__ == "__main__":
    main()
