"""Agentic rollout wall time: the asynchronous per-trajectory loop against a lockstep batch loop.

Fixed workload: 64 trajectories on the tiny model, 8 tool turns each, up to 16 new tokens
per turn. Every tool call is a real sandboxed python execution plus a seeded extra delay
drawn from a lognormal with median 0.1 s and sigma 0.5 (an API, a search engine: mostly
near the median, a few times it at worst). The agent code is the project's `run_tool_agent`
in both modes, with a parser that makes every model turn call the python tool (a random
model writes no real calls; the work done per turn is what matters here).

- async: every trajectory runs on its own; generation of one overlaps tools of others.
- lockstep: every trajectory waits at each turn until all have reached their tool call, and
  again until the slowest call of the turn is done (what a synchronous batch loop does).

Why this shape. A trajectory's tool time is a sum over its turns, so with many short, light-
tailed delays every trajectory's total is close to the mean and no single draw sets the
result; lockstep still pays the slowest of 64 draws at every turn (~3x the median here). Eight
turns is what the tiny model's 1024-token context holds (a turn and its tool output are ~90
tokens); a trajectory that ran out of context early would leave lockstep's barrier waiting.
With few heavy-tailed delays (3 turns, sigma 1.0, as this bench had before) the one longest
trajectory was the whole result: every scheduler sat at the same critical path, capped at
1.31x over lockstep. Here the critical-path lower bound (the longest trajectory's own tool
time plus the generation time of one trajectory running alone) is far below both modes, so
what the ratios show is the schedule: how well generation of some overlaps the tools of
others, and what batching the generation costs. ``delay_only_speedup_bound`` is the ceiling
the delays alone allow (lockstep's sum of per-turn maxima over async's longest sum).

Same backend, same seeds: both modes sample the same tokens and draw the same delays.
``--backends embedded,vllm`` runs the same workload on each backend in turn (vLLM: engine
processes under .venv-vllm), its figures prefixed with the backend's name. Reports wall-time
ratios: ``async_over_lockstep`` (below 1: async is faster; 0.8 is a 1.25x speedup) and
``async_over_critical_path`` (1.0 is the bound). Ends with one JSON line.

    .venv/bin/python bench/rollout.py [--trajectories 64] [--turns 8] [--backends embedded,vllm]
                                      [--smoke]

``--smoke``: the smallest run that goes through every part (2 trajectories, 1 tool turn of 4
tokens, 10 ms delays, one sandbox): it checks the bench works, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from jax_agent_rl.agent import AgentConfig, AgentContext, run_tool_agent
from jax_agent_rl.data import Sample
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, RolloutBackend
from jax_agent_rl.tokenization import (
    ParsedCall,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tool_calls import Style
from jax_agent_rl.tools import Tool, ToolResult
from jax_agent_rl.tools.sandbox import PythonSandbox, PythonTool

SNIPPET = "print(sum(i * i for i in range(2000)))"


class EveryTurnCalls:
    """An inline parser for which every model turn is one python call (the bench workload)."""

    name = "every_turn_calls"
    style: Style = "inline"
    stop_tokens: tuple[str, ...] = ()

    def parse(self, text: str) -> list[ParsedCall]:
        del text
        return [ParsedCall("python", {"code": SNIPPET})]

    def needs_more(self, text: str) -> bool:
        del text
        return False

    def format_output(self, result_text: str) -> str:
        return f"\n<output>\n{result_text}\n</output>\n"


class DelayedPython(Tool):
    """The sandboxed python tool plus a seeded lognormal delay per (trajectory, call)."""

    def __init__(self, python: PythonTool, median_s: float, sigma: float, seed: int) -> None:
        self.python, self.schema, self.name = python, python.schema, "python"
        self.median_s, self.sigma, self.seed = median_s, sigma, seed
        self.spent: dict[str, float] = {}

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> Any:
        del create_kwargs
        return {"id": trajectory_id, "calls": 0}

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        t0 = time.perf_counter()
        rng = random.Random(f"{self.seed}/{state['id']}/{state['calls']}")
        state["calls"] += 1
        result = await self.python.execute(state["id"], arguments)
        await asyncio.sleep(self.median_s * rng.lognormvariate(0.0, self.sigma))
        self.spent[state["id"]] = self.spent.get(state["id"], 0.0) + time.perf_counter() - t0
        return result


class LocalExecutor:
    """In-process executor; with ``lockstep`` every call waits for the whole batch twice."""

    def __init__(self, tool: DelayedPython, parties: int, lockstep: bool) -> None:
        self.tool = tool
        self.states: dict[str, Any] = {}
        self.before = asyncio.Barrier(parties) if lockstep else None
        self.after = asyncio.Barrier(parties) if lockstep else None

    async def schemas(self) -> list[dict[str, Any]]:
        return [self.tool.schema]

    async def call(
        self, trajectory_id: str, name: str, arguments: Any, create_kwargs: Any = None
    ) -> ToolResult:
        del name
        if self.before is not None:
            await self.before.wait()  # all trajectories finished generating this turn
        created = await self.tool.create(trajectory_id, **(create_kwargs or {}))
        state = self.states.setdefault(trajectory_id, created)
        result = await self.tool.execute(state, arguments)
        if self.after is not None:
            await self.after.wait()  # the slowest call of the turn is done
        return result

    async def release(self, trajectory_id: str) -> None:
        self.states.pop(trajectory_id, None)

    def counters(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        self.states.clear()


async def rollout(
    backend: RolloutBackend,
    tokenizer: Tokenizer,
    tool: DelayedPython,
    n: int,
    turns: int,
    tokens_per_turn: int,
    lockstep: bool,
) -> tuple[float, list[Any]]:
    executor = LocalExecutor(tool, n, lockstep)
    config = AgentConfig(
        max_turns=turns + 1,  # the turn after the last tool result ends the episode
        max_tokens_per_turn=tokens_per_turn,
        max_response_tokens=4096,
        max_model_len=backend.capabilities.max_model_len,
        temperature=1.0,
    )
    ctx = await AgentContext.create(backend, tokenizer, executor, EveryTurnCalls(), config, seed=0)
    samples = [
        Sample(uid=f"traj-{i}", messages=[{"role": "user", "content": f"Task {i}: compute."}])
        for i in range(n)
    ]
    t0 = time.perf_counter()
    trajectories = await asyncio.gather(*(run_tool_agent(s, ctx) for s in samples))
    return time.perf_counter() - t0, list(trajectories)


def make_backend(name: str, ckpt: Path, n: int, warmup: bool) -> RolloutBackend:
    """``warmup``: the embedded engine compiles every serving program first (the measured
    rollouts follow a warm-up rollout either way; a smoke run reaches few of them)."""
    cfg, weights = load_hf(ckpt, sharder=one_device_sharder())
    if name == "vllm":
        from jax_agent_rl.backends.vllm.backend import VLLMBackend

        return VLLMBackend(ckpt, cfg, max_model_len=1024, max_num_seqs=n)
    engine = Engine(cfg, max_concurrent_decodes=n, max_len=1024, sharder=one_device_sharder())
    return EmbeddedBackend(engine, weights, steps_per_call=4, warmup=warmup)


def measure(
    backend: RolloutBackend, tokenizer: Tokenizer, python: PythonTool, args: argparse.Namespace
) -> dict[str, Any]:
    """The async and lockstep rollouts of the workload on ``backend``, and their bounds."""

    def tool(seed: int, median: float) -> DelayedPython:
        return DelayedPython(python, median, args.sigma, seed)

    n, turns, k = args.trajectories, args.turns, args.tokens_per_turn
    # warm-up (compilations), and one trajectory alone without delays: its generation time
    asyncio.run(rollout(backend, tokenizer, tool(1, 0.0), n, turns, k, False))
    alone_tool = tool(0, 0.0)
    alone_s, _ = asyncio.run(rollout(backend, tokenizer, alone_tool, 1, turns, k, False))
    alone_gen_s = alone_s - sum(alone_tool.spent.values())

    async_tool = tool(0, args.median_delay)
    async_s, async_trajs = asyncio.run(rollout(backend, tokenizer, async_tool, n, turns, k, False))
    lock_tool = tool(0, args.median_delay)
    lock_s, lock_trajs = asyncio.run(rollout(backend, tokenizer, lock_tool, n, turns, k, True))
    same_tokens = all(
        a.response_ids == b.response_ids for a, b in zip(async_trajs, lock_trajs, strict=True)
    )
    critical = max(async_tool.spent.values()) + alone_gen_s
    return {
        "tool_calls": sum(t.tool_calls for t in async_trajs),
        "async_s": round(async_s, 2),
        "lockstep_s": round(lock_s, 2),
        "async_over_lockstep": round(async_s / lock_s, 2),
        "critical_path_s": round(critical, 2),
        "async_over_critical_path": round(async_s / critical, 2),
        "lockstep_over_critical_path": round(lock_s / critical, 2),
        "alone_generation_s": round(alone_gen_s, 2),
        "same_tokens_both_modes": same_tokens,
        "generated_tokens": sum(t.num_model_tokens for t in async_trajs),
        **{
            f"stop_{r}": sum(t.stop_reason == r for t in async_trajs)
            for r in {t.stop_reason for t in async_trajs}
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=16)
    parser.add_argument("--median-delay", type=float, default=0.1)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--sandboxes", type=int, default=8)
    parser.add_argument("--backends", default="embedded", help="comma-separated: embedded,vllm")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    if args.smoke:
        args.trajectories, args.turns, args.tokens_per_turn = 2, 1, 4
        args.median_delay, args.sandboxes = 0.01, 1

    figures: dict[str, Any] = {
        "bench": "rollout",
        "trajectories": args.trajectories,
        "tool_turns": args.turns,
        "tokens_per_turn": args.tokens_per_turn,
        "median_delay_s": args.median_delay,
        "delay_sigma": args.sigma,
    }
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / "tiny", TINY_QWEN2)
        corpus = ["Task 1: compute. <output> 2664667000 </output>"] * 50
        tok = train_bpe(corpus, TINY_QWEN2["vocab_size"])
        tokenizer = Tokenizer.from_pretrained(
            save_tokenizer(Path(tmp) / "tok", tok, chat_template("chatml_tools"))
        )
        sandbox = PythonSandbox(args.sandboxes)
        python = PythonTool(sandbox)
        for name in args.backends.split(","):
            backend = make_backend(name, ckpt, args.trajectories, warmup=not args.smoke)
            try:
                measured = measure(backend, tokenizer, python, args)
            finally:
                asyncio.run(backend.close())
            figures.update({f"{name}_{k}": v for k, v in measured.items()})
        sandbox.close()

    # What the seeded delays alone allow: lockstep waits for each turn's slowest call, async
    # for the slowest trajectory's own calls; no scheduler beats this ratio on this workload.
    def delay(i: int, c: int) -> float:
        return args.median_delay * random.Random(f"0/traj-{i}/{c}").lognormvariate(0.0, args.sigma)

    turns = range(args.turns)
    lockstep_delays = sum(max(delay(i, c) for i in range(args.trajectories)) for c in turns)
    async_delays = max(sum(delay(i, c) for c in turns) for i in range(args.trajectories))
    figures["delay_only_speedup_bound"] = round(lockstep_delays / async_delays, 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
