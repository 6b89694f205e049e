"""Train-step throughput: the JAX `Learner`'s RL step against a PyTorch implementation of it.

Both sides load the SAME locally written Qwen2-style checkpoint (`SMALL_QWEN2`, ~40M
parameters: hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 32000, tied embeddings) and run
the SAME GRPO step on the SAME seeded trajectories (random token ids; the first fifth of each,
at most 256 tokens, is prompt, the rest the response the loss is on; rewards 0 / 1 at random
in groups of 8). One step is what `jarl train`'s learner does: old-policy logprobs of every
response token (a forward without gradients), GRPO advantages (group mean / std), then one
update: forward to fp32 logits, log-softmax, target logprobs (JAX: a vocabulary chunk at a
time, `head_logprobs`, with each token's entropy for the metrics; torch: all logits of a
micro-batch at once), PPO clipped surrogate (clip 0.2, no dual clip, no importance weights),
token-mean over the whole batch, backward per micro-batch, global-norm clipping at 1.0, AdamW.
Master weights and optimizer state are fp32 everywhere.

Workloads (``--workload``):

    uniform    8 sequences x 512 tokens (prompt 256): the one-row-per-sequence case
    long_tail  --sequences (32) with lengths ~ lognormal(median 700, sigma 0.6), capped at
               4096: the length mix of agentic rollouts (a few long episodes, many short)
    grpo_groups  --sequences (16) in GRPO groups of 8, each group's after one 1024-token
               prompt, responses ~ lognormal(median 400, sigma 0.8), capped at 4096: what
               tree packing (`learner.tree_packing`) computes once

Variants (``_fp32`` / ``_bf16``: compute dtype; bf16 is torch.autocast on the torch side):

    jax_packed      `Learner.rl_update` on `rl.batch.step_batch`'s layout: sequences packed
                    into rows of --row-tokens (4096), one row per micro-batch
    jax_padded      the same step, packing off: one sequence per row, every row padded to the
                    longest rounded up to 64 * 2**k (the layout before packing), 1 row per
                    micro-batch (long_tail only: on uniform rows it is jax_packed)
    torch_sorted    transformers' Qwen2ForCausalLM (eager, 2 threads, torch.optim.AdamW):
                    sequences sorted by length, micro-batches of consecutive ones up to
                    --row-tokens padded positions, attention mask for the padding
    torch_packed    the same model on packed rows (the JAX layout): position ids restarting
                    per sequence, which transformers turns into attention within each
                    sequence (long_tail only)
    jax_tree        jax_packed with tree packing: rows of sequences sharing a prefix, each
                    shared position computed once (grpo_groups only; there torch is not run:
                    the figures are jax_tree against jax_packed, ``tree_speedup_*``, and the
                    positions each computes per real token, ``positions_per_token_*``)

Each variant warms up (torch: 1 step; JAX: 1 step, compiling; the timed steps must not
compile again, checked), then times --steps steps one by one. jax_padded on long_tail is slow
(its rows are ~80% padding): it runs one step and reports it minus the time XLA spent
compiling in it (measured by JAX's compile events). Useful tokens/s = real (unpadded) tokens of
the batch / median step time; ``real_token_frac`` = real tokens / positions the packed step
computes.

Mixture of experts (``--model tiny-moe`` or ``small-moe``: `jarl checkpoint make`'s Qwen3-MoE
presets, `jax_agent_rl.cli.demo.PRESETS`, with their vocabularies): the same variants on that
model, torch's being transformers' Qwen3MoeForCausalLM (its default experts implementation,
named in the JSON line), and ``dense_jax_packed_fp32`` / ``_bf16``: the JAX step on the
MoE's dense twin (`jax_agent_rl.models.hf_local.dense_twin`: a Qwen3 of the same attention,
embeddings and head whose MLP width makes its active parameters the MoE's, to within the
rounding of the width), on the same trajectories. ``moe_over_dense_*`` is JAX MoE / JAX
dense tokens/s (1.0: the experts cost what a dense MLP of their active size does);
``ratio_vs_torch`` is, as for the dense model, the best JAX over the best torch, here both
on the MoE, with ``ratio_vs_torch_fp32`` / ``_bf16`` per dtype.

FLOPs per trained token, for MFU (forward + backward = 3x the forward, plus the old-logprob
forward: 4x)::

    8 * N_matmul + 8 * L * S * H * K
    N_matmul = L * (D * K * (2 H + 2 KV) + 3 * D * F) + V * D   (layer weights + the tied head)

(a sparse layer's 3 * D * F is its router's D * E and its k experts' 3 * D * M each:
`ModelConfig.matmul_params_per_token`.)

S the mean number of keys a token attends to in its sequence. MFU = useful tokens/s * FLOPs
per token / the matmul peak of the variant's dtype, measured in the same run as the best of
torch's ``a @ b`` and a jitted ``jnp.dot`` on 2048 x 2048 operands.

    .venv/bin/python bench/learner.py [--workload uniform|long_tail|grpo_groups] [--steps N]
        [--sequences N] [--row-tokens N] [--model tiny-moe|small-moe] [--smoke]

``--smoke``: the smallest run that goes through every variant, in fp32 only (`TINY_QWEN2`,
or the ``--model`` given, 2 uniform sequences of 64 tokens or 4 long-tail ones capped at 256,
rows of 256, one timed step, 256^3 matmuls; long_tail's torch_packed in fp32): it checks the
bench works, its figures mean nothing.

Each variant runs in a process of its own, killed once it has run ``--variant-budget-s``
seconds (default 1200); before it starts, a variant whose warm-up and timed steps could not
end within that budget even at its dtype's measured matmul peak in its framework (all of its
FLOPs at 100% MFU) is not run: a dtype whose matmuls crawl on this machine (one AMD EPYC ran
torch's bf16 matmul at 0.3 GFLOP/s, a long_tail step for hours) costs nothing. Either way the
JSON line names the variant under ``skipped``, with why, and its figures are left out (a
ratio that needs them too). ``--variant-budget-s 0`` (``--smoke``'s default) runs every variant
in this process, unbounded.

Ends with one JSON line, always. Timings are noisy on a shared 2-core machine: compare figures
from the same run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jax_agent_rl.models.sharding import one_device_sharder

MATMUL_N = 2048
COMPUTE = {"fp32": "float32", "bf16": "bfloat16"}


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Workload:
    """Seeded trajectories shared by both frameworks."""

    name: str
    sequences: list[np.ndarray]  # int32 token ids, prompt then response
    prompt_lens: list[int]
    rewards: np.ndarray  # [N] float32
    groups: list[str]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def advantages(self) -> np.ndarray:
        """GRPO's (group mean / unbiased std, eps 1e-6), as both sides train on."""
        out = np.zeros(len(self.rewards), np.float32)
        names = np.asarray(self.groups)
        for g in dict.fromkeys(self.groups):
            i = names == g
            r = self.rewards[i]
            out[i] = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if i.sum() > 1 else r / (1 + 1e-6)
        return out


LENGTHS = {
    "uniform": "all 512 tokens",
    "long_tail": "lognormal(median 700, sigma 0.6), cap 4096, seed 0",
    "grpo_groups": "groups of 8 after one 1024-token prompt, responses lognormal(median 400, "
    "sigma 0.8), cap 4096, seed 0",
}
PROMPT, RESPONSE = 1024, 400  # grpo_groups: a group's prompt, the responses' median


def make_workload(
    name: str, n: int, vocab: int, seq: int = 512, cap: int = 4096, scale: float = 1.0
) -> Workload:
    """``scale`` shrinks grpo_groups' prompt and median response (--smoke)."""
    rng = np.random.default_rng(0)
    if name == "grpo_groups":
        prompt, median = int(PROMPT * scale), RESPONSE * scale
        heads = [rng.integers(0, vocab, prompt) for _ in range(-(-n // 8))]
        responses = np.minimum(np.round(median * np.exp(0.8 * rng.standard_normal(n))), cap)
        sequences = [
            np.concatenate([heads[i // 8], rng.integers(0, vocab, max(int(r), 1))]).astype(np.int32)
            for i, r in enumerate(responses)
        ]
        rewards = rng.integers(0, 2, n).astype(np.float32)
        return Workload(name, sequences, [prompt] * n, rewards, [str(i // 8) for i in range(n)])
    if name == "uniform":
        lengths = np.full(n, seq)
    else:
        lengths = np.minimum(np.round(700 * np.exp(0.6 * rng.standard_normal(n))), cap)
    lengths = np.maximum(lengths.astype(int), 8)
    sequences = [rng.integers(0, vocab, int(L)).astype(np.int32) for L in lengths]
    prompts = [min(int(L) // 5, 256) if name != "uniform" else seq // 2 for L in lengths]
    rewards = rng.integers(0, 2, n).astype(np.float32)
    return Workload(name, sequences, prompts, rewards, [str(i // 8) for i in range(n)])


def trajectories(w: Workload) -> list[Any]:
    from jax_agent_rl.agent.trajectory import Trajectory

    out = []
    for i, (seq, P) in enumerate(zip(w.sequences, w.prompt_lens, strict=True)):
        t = Trajectory(uid=str(i), group_id=w.groups[i], prompt_ids=seq[:P].tolist())
        response = seq[P:].tolist()
        t.append(response, model=True, logprobs=[-1.0] * len(response))
        out.append(t.train_sequence(float(w.rewards[i])))
    return out


def packed_batch(w: Workload, row_tokens: int | None, tree: bool = False) -> Any:
    """The workload as one update's batch (`rl.batch.step_batch`): its trajectories packed into
    rows of ``row_tokens`` (None: one padded row each; ``tree``: tree-packed), a row per
    micro-batch; returns the batch, its sequences and its real rows."""
    from jax_agent_rl.rl.batch import step_batch

    trajs = trajectories(w)
    ones = np.ones(len(trajs), np.float32)
    return step_batch(
        trajs,
        w.rewards,
        w.groups,
        ones,
        mini_batches=1,
        row_tokens=row_tokens,
        bucket=64,
        rows_per_micro=1,
        tree=tree,
    )


def attended_keys(w: Workload) -> float:
    """The mean number of keys a token attends to (causal, within its sequence)."""
    return sum(len(s) * (len(s) + 1) / 2 for s in w.sequences) / w.tokens


def flops_per_token(cfg: Any, keys: float) -> float:
    return 8 * cfg.matmul_params_per_token + 8 * cfg.num_layers * keys * cfg.num_heads * (
        cfg.head_dim
    )


def step_seconds(step: Callable[[], object], warmup: int, steps: int) -> tuple[float, list[float]]:
    """The first step's wall time, and those of the ``steps`` steps after ``warmup``."""
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[0], times[warmup:]


# -------------------------------------------------------------------------------- peaks


def torch_peak(dtype: Any, n: int = MATMUL_N, repeats: int = 5) -> float:
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def jax_peak(dtype: Any, n: int = MATMUL_N, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype) * 0.5
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_peaks(n: int) -> dict[str, dict[str, float]]:
    """dtype -> framework -> FLOP/s of an ``n``^3 matmul (logged)."""
    import jax.numpy as jnp
    import torch

    peaks = {
        d: {"torch": torch_peak(t, n), "jax": jax_peak(j, n)}
        for d, t, j in (
            ("fp32", torch.float32, jnp.float32),
            ("bf16", torch.bfloat16, jnp.bfloat16),
        )
    }
    for d, p in peaks.items():
        log(f"matmul peak {d}: torch {p['torch'] / 1e9:.1f}, jax {p['jax'] / 1e9:.1f} GFLOP/s")
    return peaks


# -------------------------------------------------------------------------------- torch


def torch_micro_batches(w: Workload, layout: str, row_tokens: int) -> list[dict[str, Any]]:
    """Micro-batches of the workload for torch: ``sorted`` (length-sorted, right-padded, up
    to ``row_tokens`` positions each) or ``packed`` (`pack_rows`' rows, positions restarting
    per sequence; one row each)."""
    import torch

    from jax_agent_rl.rl.batch import pack_rows, padded_length

    adv = w.advantages()
    lengths = [len(s) for s in w.sequences]
    if layout == "sorted":
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        groups: list[list[int]] = [[]]
        for i in order:
            if groups[-1] and (len(groups[-1]) + 1) * lengths[i] > row_tokens:
                groups.append([])
            groups[-1].append(i)
    else:
        groups = pack_rows(lengths, padded_length(max(lengths), row_tokens))
    out = []
    for g in groups:
        T = max(lengths[i] for i in g) if layout == "sorted" else sum(lengths[i] for i in g)
        rows = len(g) if layout == "sorted" else 1
        ids = np.zeros((rows, T), np.int64)
        pos = np.zeros((rows, T), np.int64)
        mask = np.zeros((rows, T), np.float32)  # on the position predicting a response token
        advs = np.zeros((rows, T), np.float32)
        attn = np.zeros((rows, T), np.int64)
        at = 0
        for r, i in enumerate(g):
            b = r if layout == "sorted" else 0
            at = 0 if layout == "sorted" else at
            n, P = lengths[i], w.prompt_lens[i]
            ids[b, at : at + n] = w.sequences[i]
            pos[b, at : at + n] = np.arange(n)
            attn[b, at : at + n] = 1
            mask[b, at + P - 1 : at + n - 1] = 1.0
            advs[b, at + P - 1 : at + n - 1] = adv[i]
            at += n
        targets = np.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        mb = {
            "input_ids": torch.from_numpy(ids),
            "targets": torch.from_numpy(targets),
            "mask": torch.from_numpy(mask),
            "adv": torch.from_numpy(advs),
        }
        if layout == "sorted":
            mb["attention_mask"] = torch.from_numpy(attn)
        else:
            mb["position_ids"] = torch.from_numpy(pos)
        out.append(mb)
    return out


def torch_model(ckpt: Path) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)


def torch_train(
    ckpt: Path, w: Workload, layout: str, row_tokens: int, bf16: bool, steps: int
) -> tuple[float, list[float], float, int]:
    """First and timed step times, the first step's loss (and 0 compilations) of the PyTorch
    implementation: one warm-up step (nothing to compile)."""
    model = torch_model(ckpt)
    import contextlib

    import torch

    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True
    )
    micro = torch_micro_batches(w, layout, row_tokens)
    total = sum(float(mb["mask"].sum()) for mb in micro)
    losses: list[float] = []

    def logp_of(mb: dict[str, Any]) -> Any:
        inputs = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids") if k in mb}
        logits = model(**inputs).logits
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        return logp_all.gather(-1, mb["targets"][..., None])[..., 0]

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            olds = [logp_of(mb).float() for mb in micro]
        loss_sum = 0.0
        for mb, old in zip(micro, olds, strict=True):
            with ctx:
                mask, adv = mb["mask"], mb["adv"]
                log_ratio = torch.where(mask > 0, logp_of(mb) - old, torch.zeros_like(old))
                ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
                l1 = -adv * ratio
                l2 = -adv * ratio.clamp(0.8, 1.2)
                loss = (torch.maximum(l1, l2) * mask).sum() / total
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum)

    first, timed = step_seconds(step, 1, steps)
    return first, timed, losses[0], 0


# -------------------------------------------------------------------------------- jax


class CompileCounter:
    """Counts XLA backend compilations and their seconds (JAX's monitoring events)."""

    def __init__(self) -> None:
        import jax

        self.count = 0
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        del kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration_secs


def jax_train(
    ckpt: Path,
    w: Workload,
    row_tokens: int | None,
    dtype: str,
    steps: int,
    counter: CompileCounter,
    tree: bool = False,
) -> tuple[float, list[float], float, int, float]:
    """First and timed step times, the first step's loss, the compilations seen during the
    timed steps, and the layout's real tokens per position its forward computes.
    ``row_tokens`` None: packing off; ``tree``: tree packing. ``steps`` 0: one step only,
    timed without the XLA compile time spent in it."""
    import jax

    from jax_agent_rl.config import AlgorithmSection, OptimSection
    from jax_agent_rl.models import load_hf
    from jax_agent_rl.rl.learner import Learner
    from jax_agent_rl.rl.objectives import SamplingSpec

    cfg, params = load_hf(ckpt, dtype="float32", sharder=one_device_sharder())
    learner = Learner(
        cfg,
        algo=AlgorithmSection(clip_low=0.2, clip_high=0.2, clip_c=None, tis_cap=None),
        optim=OptimSection(lr=1e-6, weight_decay=0.0, grad_clip=1.0),
        sampling=SamplingSpec(),
        compute_dtype=dtype,  # type: ignore[arg-type]
        micro_batch_size=1,
        sharder=one_device_sharder(),
    )
    state = learner.init_state(params)  # each step donates it and takes the next
    del params
    batch, sequences, real = packed_batch(w, row_tokens, tree)
    width = batch.shape[1] if batch.tree is None else batch.tree.shape[1]  # the forward's rows
    real_frac = w.tokens / (real * width)
    losses: list[float] = []
    compiles_before = [0]

    def step() -> None:
        nonlocal state
        if len(losses) == 1:  # warm-up done: from here on nothing may compile
            compiles_before[0] = counter.count
        state, metrics, _ = learner.rl_update(state, batch, sequences, real)
        losses.append(metrics["loss"])
        jax.block_until_ready(state.policy.params)

    if steps == 0:
        seconds = counter.seconds
        first, _ = step_seconds(step, 1, 0)
        return first, [first - (counter.seconds - seconds)], losses[0], 0, real_frac
    first, timed = step_seconds(step, 1, steps)
    return first, timed, losses[0], counter.count - compiles_before[0], real_frac


# -------------------------------------------------------------------------------- main


def bench_model(name: str | None, smoke: bool) -> tuple[str, dict[str, Any]]:
    """The model's name in the JSON line and its HF fields: the dense Qwen2 (tiny for
    ``smoke``) or the MoE preset ``name``."""
    from jax_agent_rl.cli.demo import PRESETS
    from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2

    if name is None:
        return ("tiny_qwen2", TINY_QWEN2) if smoke else ("small_qwen2", SMALL_QWEN2)
    fields, vocab = PRESETS[name]
    return name, {**fields, "vocab_size": vocab}


def dense_twin_of(
    moe: dict[str, Any], ckpt: Path, w: Workload, out: Path
) -> tuple[Path, float, dict[str, Any]]:
    """The dense twin of the MoE of HF fields ``moe`` (checkpoint ``ckpt``) written to
    ``out``, its FLOPs per token on ``w``, and the figures of both models for the JSON line."""
    from jax_agent_rl.models import load_hf
    from jax_agent_rl.models.hf_local import dense_twin, write_hf_checkpoint

    cfg = load_hf(ckpt, sharder=one_device_sharder())[0]
    twin = write_hf_checkpoint(out, dense_twin(moe))
    twin_cfg = load_hf(twin, sharder=one_device_sharder())[0]
    fpt = flops_per_token(twin_cfg, attended_keys(w))
    return (
        twin,
        fpt,
        {
            "active_params": cfg.active_params,
            "experts": f"{cfg.num_experts} of width {cfg.moe_intermediate_size}, "
            f"{cfg.num_experts_per_tok} per token",
            "torch_experts_implementation": torch_model(ckpt).config._experts_implementation,
            "dense_intermediate_size": twin_cfg.intermediate_size,
            "dense_params": twin_cfg.num_params,
            "dense_flops_per_token": round(fpt),
        },
    )


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", choices=("uniform", "long_tail", "grpo_groups"), default="uniform"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (3; long_tail 1)")
    parser.add_argument(
        "--sequences", type=int, default=None, help="long_tail: default 32; grpo_groups: 16"
    )
    parser.add_argument("--row-tokens", type=int, default=4096, help="packed row length")
    parser.add_argument(
        "--model",
        choices=("tiny-moe", "small-moe"),
        default=None,
        help="a Qwen3-MoE preset, timed beside its dense twin (default: the dense small model)",
    )
    parser.add_argument(
        "--variant-budget-s",
        type=float,
        default=None,
        help="seconds a variant may run (warm-up, compiles and timed steps) before it is "
        "killed and skipped; one its dtype's matmul peak could not fit in them is not run; "
        "0: unbounded, every variant in this process (default 1200; --smoke: 0, whose "
        "variants take less than a process's start)",
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    # how the bench runs one variant in a process of its own (not for the command line)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    long_tail = args.workload == "long_tail"
    args.steps = 1 if args.smoke else args.steps or (1 if long_tail else 3)
    default = {"long_tail": (4, 32), "grpo_groups": (8, 16)}.get(args.workload, (2, 8))
    args.sequences = args.sequences or default[0 if args.smoke else 1]
    args.seq, args.cap, args.matmul_n = (64, 256, 256) if args.smoke else (512, 4096, MATMUL_N)
    if args.variant_budget_s is None:
        args.variant_budget_s = 0.0 if args.smoke else 1200.0
    if args.smoke:
        args.row_tokens = 256
    # --smoke: fp32 alone (the bf16 variants are the same code with another dtype)
    args.dtypes = ("fp32",) if args.smoke else ("fp32", "bf16")
    return args


Result = tuple[float, list[float], float, int, float]


def run_variant(name: str, args: argparse.Namespace, folder: Path) -> Result:
    """Variant ``name`` on the checkpoints in ``folder`` (``model``, a MoE's twin ``dense``):
    its first and timed step times, first loss, compilations in the timed steps and the
    packed layout's real-token fraction."""
    from jax_agent_rl.models import load_hf

    ckpt = folder / ("dense" if name.startswith("dense_") else "model")
    vocab, scale = (
        load_hf(ckpt, sharder=one_device_sharder())[0].vocab_size,
        1 / 16 if args.smoke else 1.0,
    )
    w = make_workload(args.workload, args.sequences, vocab, args.seq, args.cap, scale)
    dtype = name.rsplit("_", 1)[1]
    if name.startswith("torch_"):
        layout = name.split("_")[1]
        return (*torch_train(ckpt, w, layout, args.row_tokens, dtype == "bf16", args.steps), 1.0)
    packed = "_packed_" in name or name.startswith("jax_tree")
    timed = args.steps if packed or args.workload != "long_tail" else 0
    rows = args.row_tokens if packed else None
    tree = name.startswith("jax_tree")
    return jax_train(ckpt, w, rows, COMPUTE[dtype], timed, CompileCounter(), tree)


def variant_in_process(name: str, args: argparse.Namespace, folder: Path) -> Result | str:
    """`run_variant` in a process of its own (this script with ``--variant``), killed after
    ``--variant-budget-s``: its figures, or why there are none."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--variant", name, "--checkpoint", str(folder)]
    path = os.pathsep.join(p for p in sys.path if p)  # it imports what this process does
    try:
        done = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            text=True,
            timeout=args.variant_budget_s,
            check=False,
            env={**os.environ, "PYTHONPATH": path},
        )
    except subprocess.TimeoutExpired:
        return f"killed after its budget of {args.variant_budget_s:.0f} s (--variant-budget-s)"
    if done.returncode != 0:
        return f"failed (exit status {done.returncode}; its error is in the log above)"
    first, timed, loss, recompiles, real_frac = json.loads(done.stdout.strip().split("\n")[-1])
    return first, timed, loss, recompiles, real_frac


def fits_budget(seconds_at_peak: float, peak: float, budget: float) -> str | None:
    """Why a variant is not run (None: it is): its steps' FLOPs at the ``peak`` (FLOP/s) of
    its framework and dtype take ``seconds_at_peak`` at least, over its ``budget``."""
    if seconds_at_peak <= budget:
        return None
    return (
        f"its matmul peak here ({peak / 1e9:.2f} GFLOP/s) needs {seconds_at_peak:.0f} s at "
        f"least for its steps, over its budget of {budget:.0f} s (--variant-budget-s)"
    )


def variant_names(args: argparse.Namespace) -> list[str]:
    """The variants the workload and ``--model`` call for, in the order they run."""
    dtypes = args.dtypes
    groups = args.workload == "grpo_groups"  # tree packing against today's packing
    variants = [f"torch_sorted_{d}" for d in dtypes if not groups]
    variants += [f"jax_packed_{d}" for d in dtypes]
    variants += [f"jax_tree_{d}" for d in dtypes if groups]
    if args.workload == "long_tail":  # torch on the packed rows in its faster dtype; JAX unpacked
        variants += [f"torch_packed_{dtypes[-1]}", "jax_padded_fp32"]
    if args.model is not None:
        variants += [f"dense_jax_packed_{d}" for d in dtypes]
    return variants


def bounded_variant(
    name: str,
    args: argparse.Namespace,
    folder: Path,
    tokens: int,
    fpts: dict[str, float],
    peaks: dict[str, dict[str, float]],
) -> Result | str:
    """Variant ``name``'s figures, run here (``--variant-budget-s 0``) or in a process of its
    own within the budget; or why it was not run or did not finish (module docstring)."""
    if not args.variant_budget_s:
        return run_variant(name, args, folder)
    dtype = "bf16" if name.endswith("bf16") else "fp32"
    flops = fpts["dense_" if name.startswith("dense_") else ""]
    own_peak = peaks[dtype]["torch" if name.startswith("torch") else "jax"]
    padded_once = "jax_padded" in name and args.workload == "long_tail"
    runs = 1 + (0 if padded_once else args.steps)
    why = fits_budget(runs * tokens * flops / own_peak, own_peak, args.variant_budget_s)
    return why if why is not None else variant_in_process(name, args, folder)


def main() -> None:
    args = _args()
    steps, n, row_tokens, matmul_n = args.steps, args.sequences, args.row_tokens, args.matmul_n

    import torch

    from jax_agent_rl.models import load_hf
    from jax_agent_rl.models.hf_local import write_hf_checkpoint

    torch.set_num_threads(2)  # (write_hf_checkpoint turns transformers' progress bars off)
    if args.variant is not None:  # one variant, in this process of its own
        print(json.dumps(run_variant(args.variant, args, args.checkpoint)))
        return

    model, hf = bench_model(args.model, args.smoke)
    out: dict[str, Any] = {"bench": "learner", "workload": args.workload, "model": model}
    tok_s: dict[str, float] = {}
    extra: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / "model", hf)
        cfg = load_hf(ckpt, sharder=one_device_sharder())[0]
        scale = 1 / 16 if args.smoke else 1.0
        w = make_workload(args.workload, n, cfg.vocab_size, args.seq, args.cap, scale)
        # variant name's prefix -> FLOPs per token of its model
        fpts = {"": flops_per_token(cfg, attended_keys(w))}
        lengths = [len(s) for s in w.sequences]
        out.update(
            params=cfg.num_params,
            sequences=n,
            real_tokens=w.tokens,
            steps=steps,
            longest=max(lengths),
            median_length=int(np.median(lengths)),
            row_tokens=row_tokens,
            flops_per_token=round(fpts[""]),
            lengths=LENGTHS[args.workload],
            variant_budget_s=args.variant_budget_s,
        )
        if args.model is not None:
            _, fpts["dense_"], figures = dense_twin_of(hf, ckpt, w, Path(tmp) / "dense")
            out.update(figures)

        peaks = matmul_peaks(matmul_n)

        dtypes = args.dtypes
        for name in variant_names(args):
            got = bounded_variant(name, args, Path(tmp), w.tokens, fpts, peaks)
            if isinstance(got, str):
                skipped[name] = got
                log(f"{name}: skipped, {got}")
            else:
                dtype = "bf16" if name.endswith("bf16") else "fp32"
                flops = fpts["dense_" if name.startswith("dense_") else ""]
                tok_s[name] = w.tokens / statistics.median(got[1])
                mfu = tok_s[name] * flops / max(peaks[dtype].values())
                _record(name, got, tok_s[name], mfu, out, extra)

    out["skipped"] = skipped
    _report(out, tok_s, peaks, extra, dtypes)


def _record(
    name: str, got: Result, tok_s: float, mfu: float, out: dict[str, Any], extra: dict[str, Any]
) -> None:
    """A variant's figures (``got``: `run_variant`'s) into the JSON line's ``out`` and
    ``extra``, and the log."""
    first, timed, loss, recompiles, real_frac = got
    extra[f"mfu_{name}"] = round(mfu, 4)
    extra[f"first_step_s_{name}"] = round(first, 2)
    extra[f"loss_{name}"] = round(loss, 6)
    if "jax" in name:
        extra[f"recompiles_{name}"] = recompiles
    if name.startswith("jax_packed"):
        out["real_token_frac"] = round(real_frac, 4)
    if name.startswith(("jax_packed", "jax_tree")):
        out[f"positions_per_token_{name.split('_')[1]}"] = round(1 / real_frac, 4)
    if name.startswith("jax_padded"):
        out["padded_real_token_frac"] = round(real_frac, 4)
    log(
        f"{name}: {tok_s:.0f} useful tok/s (steps {', '.join(f'{t:.2f}' for t in timed)} s; "
        f"first {first:.1f} s), loss {loss:.6f}"
    )


def _report(
    out: dict[str, Any],
    tok_s: dict[str, float],
    peaks: dict[str, dict[str, float]],
    extra: dict[str, Any],
    dtypes: tuple[str, ...],
) -> None:
    """Adds the throughputs, peaks and ratios to ``out`` and prints it as the JSON line."""
    for name, v in tok_s.items():
        out[f"{name}_tok_s"] = round(v, 1)
    for d, p in peaks.items():
        out[f"peak_{d}_gflops_torch"] = round(p["torch"] / 1e9, 1)
        out[f"peak_{d}_gflops_jax"] = round(p["jax"] / 1e9, 1)
    out.update(extra)

    def ratio(key: str, a: str, b: str) -> None:
        """``out[key]``: the best throughput of the variants named ``a...`` over that of
        ``b...`` (left out while either has none: skipped)."""
        best = [max((v for k, v in tok_s.items() if k.startswith(x)), default=0.0) for x in (a, b)]
        if best[0] and best[1]:
            out[key] = round(best[0] / best[1], 3)

    ratio("ratio_vs_torch", "jax_packed", "torch")
    for d in dtypes:  # grpo_groups
        ratio(f"tree_speedup_{d}", f"jax_tree_{d}", f"jax_packed_{d}")
    if "positions_per_token_tree" in out and "positions_per_token_packed" in out:
        drop = out["positions_per_token_packed"] / out["positions_per_token_tree"]
        out["positions_drop"] = round(drop, 3)
    ratio("ratio_vs_padded", "jax_packed_fp32", "jax_padded_fp32")
    if out.get("dense_params") is not None:  # a MoE beside its dense twin
        for d in dtypes:
            ratio(f"moe_over_dense_{d}", f"jax_packed_{d}", f"dense_jax_packed_{d}")
            ratio(f"ratio_vs_torch_{d}", f"jax_packed_{d}", f"torch_sorted_{d}")
        ratio("moe_over_dense_best", "jax_packed", "dense_jax_packed")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
