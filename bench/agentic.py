"""A long-tailed multi-turn agentic workload: useful tokens/s and KV memory, per backend.

Every backend runs the same seeded workload through the asyncio `RolloutBackend` protocol
alone (token ids in; token ids, logprobs, finish reason out). ``--prompts P`` prompts, each
the prompt of a GRPO group of ``--n N`` episodes; every trajectory is a chain of turns:

- prompt length: lognormal, median 150 tokens, sigma 0.7 (the N episodes share it);
- turns drawn per trajectory: geometric, mean 3, at most ``--max-turns``;
- tokens sampled per turn: lognormal, median 100, sigma 0.6;
- tool-output tokens appended after a turn: lognormal, median 60, sigma 1.0.

Each draw is rounded and clipped to [1, max_len / 4] (a prompt to [8, max_len / 4], so the
first turn always fits); prompt and tool tokens are uniform over the vocabulary. A turn's
prompt is the previous turn's prompt, the token ids it returned and the tool output: token-
exact, nothing re-tokenized. A trajectory ends after its drawn turns, or earlier, at the
first turn that would not fit the backend's ``max_model_len`` (its tool output plus its
sampled tokens). Sampling: temperature 1, a seed per request, no stop tokens (each turn
samples exactly its drawn count), logprobs on. One ``session_id`` per trajectory. Since the
lengths do not depend on the sampled ids, every backend serves the same token counts; the
plan is fixed before anything runs, and every result is checked against it. The workload is
long-tailed when the final context lengths' max is at least twice their median
(``final_len_*``).

All trajectories run at once (``asyncio.gather``); only the backend bounds concurrency.

Same KV budget, ``--kv-gib``, on both sides:

- embedded: the paged engine, a pool of pages of 32 positions that holds the budget, one
  decode slot per trajectory; sessions keep their pages in the pool (evicted when it runs
  short), prefixes are shared, long prompts prefilled in chunks of 512.
- dense: the same engine configured as the dense cache before it: one page of ``max_len``
  positions per slot (so ``max_concurrent_decodes`` = the rows that fit the budget, and no
  prefix shorter than ``max_len`` is shared but a session's own), no chunking.
  For both, a periodic task reads the backend during the run: reserved = the pages held x
  bytes per page; real = the tokens those hold (the cached positions of the busy slots, plus
  the tokens of kept sessions not being decoded) x bytes per token.
  ``steps_per_call`` 8; every program compiled before the clock starts.
- vLLM (`jax_agent_rl.backends.vllm`, its own process under .venv-vllm):
  ``kv_cache_memory_bytes`` = the budget (its paged cache holds the prefix cache too),
  ``max_num_seqs`` = the number of trajectories. Its real bytes and prefill tokens are not
  visible from here: null.

Figures per backend: ``useful_tok_s`` (sampled tokens / wall time of the whole workload),
sampled tokens, prefill tokens (embedded: prefilled and served from a session's cache),
peak KV bytes reserved and of real tokens, and the most requests in flight at once as the
driver sees them (every live trajectory has one: no tool latency here); embedded also the
most slots decoding at once, and where its time went (`call_profile`): the share of the wall
in engine calls, their count and mean length, the rows a call's ragged step and each of its
decode steps asked for on average, and the share of computed rows that were padding to
their buckets. Across backends: ``useful_tok_s_ratio_vs_vllm`` (embedded /
vLLM), ``kv_reserved_over_real`` (embedded, peak / peak), and ``useful_tok_s_ratio_vs_dense``
(embedded / dense). Ends with one JSON line.

    .venv/bin/python bench/agentic.py [--model small] [--kv-gib 0.25] [--prompts 8] [--n 4]
                                      [--backends embedded,dense,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jax_agent_rl.engine import Engine, page_bytes
from jax_agent_rl.models import ModelConfig, load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import (
    BackendStats,
    EmbeddedBackend,
    GenerateRequest,
    GenerateResult,
    RolloutBackend,
    SamplingParams,
)

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"tiny": TINY_QWEN2, "small": SMALL_QWEN2}
BACKENDS = ("embedded", "dense", "vllm")
PAGE_SIZE = 32  # positions per page of the paged engine
STEPS_PER_CALL = 8
SAMPLE_PERIOD_S = 0.01  # how often the embedded engine's buffers are read during a run

# the workload's distributions (see the module docstring): (median, sigma) of lognormals
PROMPT = (150.0, 0.7)
SAMPLED = (100.0, 0.6)
TOOL = (60.0, 1.0)
MEAN_TURNS = 3.0


@dataclasses.dataclass(frozen=True)
class Turn:
    tool_ids: tuple[int, ...]  # appended to the context before this turn's request (first: none)
    sample: int  # tokens to sample
    seed: int


@dataclasses.dataclass(frozen=True)
class Trajectory:
    uid: str
    prompt: tuple[int, ...]
    turns: tuple[Turn, ...]
    drawn_turns: int  # more than it has: it ended at the first turn that did not fit

    @property
    def prompt_lens(self) -> list[int]:
        """Each request's prompt length."""
        out, length = [], len(self.prompt)
        for turn in self.turns:
            out.append(length + len(turn.tool_ids))
            length = out[-1] + turn.sample
        return out

    @property
    def final_len(self) -> int:
        return len(self.prompt) + sum(len(t.tool_ids) + t.sample for t in self.turns)


def _lognormal(
    rng: np.random.Generator, median_sigma: tuple[float, float], lo: int, hi: int
) -> int:
    median, sigma = median_sigma
    return int(np.clip(round(rng.lognormal(np.log(median), sigma)), lo, hi))


def plan(
    prompts: int, n: int, max_turns: int, vocab: int, max_len: int, seed: int
) -> list[Trajectory]:
    """The whole workload, drawn once: every trajectory's prompt, turns, tool outputs, seeds."""
    rng = np.random.default_rng(seed)
    cap = max_len // 4

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, vocab, count))

    out = []
    for p in range(prompts):
        prompt = tokens(_lognormal(rng, PROMPT, 8, cap))
        for e in range(n):
            drawn = min(int(rng.geometric(1.0 / MEAN_TURNS)), max_turns)
            turns: list[Turn] = []
            length = len(prompt)
            for i in range(drawn):
                tool = tokens(_lognormal(rng, TOOL, 1, cap)) if i else ()
                sample = _lognormal(rng, SAMPLED, 1, cap)
                turn_seed = int(rng.integers(0, 2**31))
                if length + len(tool) + sample > max_len:
                    break  # this turn would not fit: the trajectory ends
                turns.append(Turn(tool, sample, turn_seed))
                length += len(tool) + sample
            out.append(Trajectory(f"p{p}e{e}", prompt, tuple(turns), drawn))
    return out


def _lognormal_text(median_sigma: tuple[float, float], lo: int, hi: int) -> str:
    median, sigma = median_sigma
    return f"lognormal(median={median:g}, sigma={sigma:g}) in [{lo}, {hi}]"


def describe(trajectories: list[Trajectory], max_len: int, max_turns: int) -> dict[str, Any]:
    """The workload's distributions and the figures of its length distribution."""
    final = np.array([t.final_len for t in trajectories])
    turns = np.array([len(t.turns) for t in trajectories])
    p50 = float(np.percentile(final, 50))
    return {
        "prompt_len_dist": _lognormal_text(PROMPT, 8, max_len // 4),
        "turns_dist": f"geometric(mean={MEAN_TURNS:g}) capped at {max_turns}, "
        f"ended early where the next turn would pass max_len={max_len}",
        "sampled_per_turn_dist": _lognormal_text(SAMPLED, 1, max_len // 4),
        "tool_per_turn_dist": _lognormal_text(TOOL, 1, max_len // 4),
        "trajectories": len(trajectories),
        "turns_total": int(turns.sum()),
        "turns_p50": float(np.percentile(turns, 50)),
        "turns_max": int(turns.max()),
        "ended_by_max_len": sum(len(t.turns) < t.drawn_turns for t in trajectories),
        "sampled_tokens": sum(u.sample for t in trajectories for u in t.turns),
        # prefill without any cache, and with each session's cached turns reused (a turn then
        # prefills its tool output and the previous turn's last token, which was not cached)
        "prompt_tokens": sum(sum(t.prompt_lens) for t in trajectories),
        "min_prefill_tokens": sum(
            len(t.prompt) + sum(len(u.tool_ids) + 1 for u in t.turns[1:]) for t in trajectories
        ),
        "final_len_p50": round(p50, 1),
        "final_len_p90": round(float(np.percentile(final, 90)), 1),
        "final_len_max": int(final.max()),
        "final_len_max_over_p50": round(float(final.max()) / p50, 2),
        "long_tailed": bool(final.max() >= 2 * p50),
    }


@dataclasses.dataclass
class Meter:
    """Requests in flight now, and the largest values seen during a run (``None``: not
    observable on this backend)."""

    in_flight: int = 0
    max_in_flight: int = 0
    kv_reserved_bytes: int | None = None
    kv_real_bytes: int | None = None
    decoding: int | None = None

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1

    def see(self, reserved: int, real: int, decoding: int) -> None:
        self.kv_reserved_bytes = max(self.kv_reserved_bytes or 0, reserved)
        self.kv_real_bytes = max(self.kv_real_bytes or 0, real)
        self.decoding = max(self.decoding or 0, decoding)


def embedded_kv(backend: EmbeddedBackend) -> tuple[int, int, int]:
    """(KV bytes reserved, KV bytes of the tokens really held, slots decoding), read from the
    backend's page ledger. Runs on the event loop beside the engine thread: each container
    is copied by one ``list`` call (atomic under the GIL) before it is read."""
    engine = backend.engine
    per_token = engine.page_bytes // engine.page_size
    jobs = list(backend._slots.values())
    decoding = {job.request.session_id for job in jobs if job.request.session_id is not None}
    reserved = backend._pool.in_use * engine.page_bytes
    tokens = sum(job.pos for job in jobs) + backend._sessions.kept_tokens(decoding)
    return reserved, tokens * per_token, len(jobs)


async def run_trajectory(backend: RolloutBackend, trajectory: Trajectory, meter: Meter) -> None:
    """Runs the trajectory's turns in order; every result must match the plan."""
    context = trajectory.prompt
    for i, turn in enumerate(trajectory.turns):
        context = (*context, *turn.tool_ids)
        sampling = SamplingParams(max_tokens=turn.sample, temperature=1.0, seed=turn.seed)
        request = GenerateRequest(
            f"{trajectory.uid}t{i}", context, sampling, session_id=trajectory.uid
        )
        with meter.request():
            result = await backend.generate(request)
        _check(request, result)
        context = (*context, *result.token_ids)


def _check(request: GenerateRequest, result: GenerateResult) -> None:
    want = request.sampling.max_tokens
    got = (result.finish_reason, len(result.token_ids), len(result.logprobs or ()))
    if got != ("length", want, want):
        raise RuntimeError(
            f"{request.request_id}: (finish, tokens, logprobs) {got}; the plan says "
            f"('length', {want}, {want})"
        )


async def run_workload(
    backend: RolloutBackend, trajectories: list[Trajectory], progress: Progress, label: str
) -> tuple[float, Meter]:
    """Every trajectory at once; the wall time and the peaks seen meanwhile."""
    meter = Meter()
    task = progress.add_task(label, total=len(trajectories))
    embedded = backend if isinstance(backend, EmbeddedBackend) else None

    def sample() -> None:
        if embedded is not None:
            meter.see(*embedded_kv(embedded))

    async def every_period() -> None:
        while True:
            sample()
            await asyncio.sleep(SAMPLE_PERIOD_S)

    async def one(trajectory: Trajectory) -> None:
        await run_trajectory(backend, trajectory, meter)
        sample()
        progress.advance(task)

    metering = asyncio.create_task(every_period())
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(t) for t in trajectories))
    finally:
        wall = time.perf_counter() - t0
        metering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await metering
    return wall, meter


def warm(backend: RolloutBackend) -> None:
    """One short request before the clock starts (first-call costs off the measurement)."""
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    asyncio.run(backend.generate(GenerateRequest("warm", tuple(range(1, 17)), sampling)))


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every backend gets: the checkpoint, the length and the KV budget."""

    checkpoint: Path
    cfg: ModelConfig
    max_len: int
    kv_bytes: int
    trajectories: int

    def dense_slots(self) -> tuple[int, int, int]:
        """(bytes per cached token, bytes of one dense row, rows that fit the budget)."""
        dtype = Engine(
            self.cfg, max_concurrent_decodes=1, max_len=self.max_len, sharder=one_device_sharder()
        ).cache_dtype
        row = page_bytes(self.cfg, self.max_len, np.dtype(dtype).itemsize)
        return row // self.max_len, row, self.kv_bytes // row


def start(name: str, setup: Setup) -> tuple[RolloutBackend, float]:
    """The backend and the seconds it took to start (and to compile, for the embedded one)."""
    t0 = time.perf_counter()
    backend: RolloutBackend
    if name == "vllm":
        from jax_agent_rl.backends.vllm.backend import VLLMBackend

        backend = VLLMBackend(
            setup.checkpoint,
            setup.cfg,
            max_model_len=setup.max_len,
            max_num_seqs=setup.trajectories,
            kv_cache_bytes=setup.kv_bytes,
        )
    else:
        _, weights = load_hf(setup.checkpoint, sharder=one_device_sharder())
        per_token, _, slots = setup.dense_slots()
        if name == "dense":  # one page of max_len per slot, no chunks
            engine = Engine(
                setup.cfg,
                max_concurrent_decodes=slots,
                max_len=setup.max_len,
                page_size=setup.max_len,
                num_pages=slots,
                prefill_chunk=setup.max_len,
                sharder=one_device_sharder(),
            )
        else:
            engine = Engine(
                setup.cfg,
                max_concurrent_decodes=setup.trajectories,
                max_len=setup.max_len,
                page_size=PAGE_SIZE,
                num_pages=setup.kv_bytes // (per_token * PAGE_SIZE),
                prefill_chunk=512,
                sharder=one_device_sharder(),
            )
        backend = EmbeddedBackend(
            engine,
            weights,
            steps_per_call=STEPS_PER_CALL,
            session_cache_size=setup.trajectories,
            warmup=True,
        )
    warm(backend)
    return backend, time.perf_counter() - t0


def measure(
    name: str, setup: Setup, trajectories: list[Trajectory], progress: Progress
) -> dict[str, Any]:
    backend, start_s = start(name, setup)
    if backend.capabilities.max_model_len != setup.max_len:
        raise RuntimeError(f"{name}: max_model_len {backend.capabilities.max_model_len}")
    stats = backend.stats if isinstance(backend, EmbeddedBackend) else None
    before = dataclasses.replace(stats) if stats is not None else None
    try:
        wall, meter = asyncio.run(run_workload(backend, trajectories, progress, name))
    finally:
        asyncio.run(backend.close())
    sampled = sum(u.sample for t in trajectories for u in t.turns)
    figures: dict[str, Any] = {
        "start_s": round(start_s, 1),
        "wall_s": round(wall, 2),
        "useful_tok_s": round(sampled / wall, 1),
        "sampled_tokens": sampled,
        "prefill_tokens": None,
        "prefix_hit_tokens": None,
        "peak_kv_reserved_bytes": meter.kv_reserved_bytes,
        "peak_kv_real_bytes": meter.kv_real_bytes,
        "max_requests_in_flight": meter.max_in_flight,
    }
    if stats is not None and before is not None:
        figures["prefill_tokens"] = stats.prefilled_tokens - before.prefilled_tokens
        figures["prefix_hit_tokens"] = stats.prefix_hit_tokens - before.prefix_hit_tokens
        figures["max_decoding"] = meter.decoding
        figures |= call_profile(before, stats, wall)
    else:  # vLLM's paged cache is allocated whole at start: the budget it was given
        figures["peak_kv_reserved_bytes"] = setup.kv_bytes
    return figures


def call_profile(before: BackendStats, after: BackendStats, wall: float) -> dict[str, Any]:
    """Where the embedded engine's time went between two readings of its stats: the share of
    the wall in engine calls (dispatch to tokens on the host; the rest is the host's
    scheduling and waiting for work), the calls and those with a ragged step (prompt chunks:
    the others only decode), the rows a ragged step and a decode step asked for on average,
    and the share of computed rows that were padding."""
    d = {
        f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)
    }
    calls = d["decode_calls"]
    return {
        "calls": calls,
        "step_calls": d["step_calls"],
        "call_share_of_wall": round(d["call_s"] / wall, 3),
        "mean_call_ms": round(1e3 * d["call_s"] / max(calls, 1), 1),
        "mean_step_rows": round(d["step_rows"] / max(d["step_calls"], 1), 1),
        "step_padding_share": round(1 - d["step_rows"] / max(d["step_rows_computed"], 1), 3),
        "mean_decode_batch": round(d["decode_rows"] / max(d["decode_steps"], 1), 1),
        "decode_padding_share": round(1 - d["decode_rows"] / max(d["decode_rows_computed"], 1), 3),
    }


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    add = parser.add_argument
    add("--model", choices=sorted(MODELS), default="small", help="checkpoint written at run time")
    add("--max-len", type=int, help="max_model_len (None: 2048, or the model's if shorter)")
    add("--kv-gib", type=float, default=0.25, help="KV cache budget of each backend, GiB")
    add("--prompts", type=int, default=8, help="prompts (GRPO groups)")
    add("--n", type=int, default=4, help="episodes per prompt (the group size)")
    add("--max-turns", type=int, default=16, help="cap on the turns drawn per trajectory")
    add("--seed", type=int, default=0, help="seed of the whole workload")
    add(
        "--backends",
        default="embedded,dense,vllm",
        help=f"comma-separated, of {', '.join(BACKENDS)}",
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    backends = args.backends.split(",")
    if not backends or not set(backends) <= set(BACKENDS):
        sys.exit(f"bench/agentic.py: --backends {args.backends}: of {BACKENDS}")
    if "vllm" in backends and not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        sys.exit("bench/agentic.py: .venv-vllm is missing; run `scripts/setup.sh vllm`")
    hf = MODELS[args.model]
    max_len = args.max_len or min(2048, hf["max_position_embeddings"])
    console = Console(stderr=True)
    figures: dict[str, Any] = {
        "bench": "agentic",
        "model": args.model,
        "dtype": "float32",
        "max_len": max_len,
        "kv_gib": args.kv_gib,
        "prompts": args.prompts,
        "n": args.n,
        "seed": args.seed,
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_hf_checkpoint(Path(tmp) / args.model, hf)
        cfg = ModelConfig.from_pretrained(checkpoint)
        trajectories = plan(
            args.prompts, args.n, args.max_turns, cfg.vocab_size, max_len, args.seed
        )
        setup = Setup(checkpoint, cfg, max_len, int(args.kv_gib * 2**30), len(trajectories))
        per_token, row, slots = setup.dense_slots()
        if slots < 1:
            sys.exit(f"bench/agentic.py: --kv-gib {args.kv_gib} holds no dense row of {row} bytes")
        figures.update(describe(trajectories, max_len, args.max_turns))
        figures.update(
            kv_budget_bytes=setup.kv_bytes,
            kv_bytes_per_token=per_token,
            dense_row_bytes=row,
            dense_max_concurrent_decodes=slots,
            embedded_max_concurrent_decodes=len(trajectories),
            embedded_pages=setup.kv_bytes // (per_token * PAGE_SIZE),
            embedded_page_size=PAGE_SIZE,
            embedded_session_cache_size=len(trajectories),
            embedded_steps_per_call=STEPS_PER_CALL,
            vllm_kv_cache_memory_bytes=setup.kv_bytes,
            vllm_max_num_seqs=len(trajectories),
        )
        console.print(f"# workload: {json.dumps(figures)}")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            for name in backends:
                measured = measure(name, setup, trajectories, progress)
                figures.update({f"{name}_{k}": v for k, v in measured.items()})
    figures.update(_ratios(figures))
    print(json.dumps(figures))


def _ratios(figures: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        x, y = figures.get(a), figures.get(b)
        return None if x is None or not y else round(x / y, 2)

    return {
        "useful_tok_s_ratio_vs_vllm": ratio("embedded_useful_tok_s", "vllm_useful_tok_s"),
        "kv_reserved_over_real": ratio(
            "embedded_peak_kv_reserved_bytes", "embedded_peak_kv_real_bytes"
        ),
        "useful_tok_s_ratio_vs_dense": ratio("embedded_useful_tok_s", "dense_useful_tok_s"),
    }


if __name__ == "__main__":
    main()
