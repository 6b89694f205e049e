"""Asynchronous training against the synchronous loop, when tool calls have a long tail.

The learning test's task (sums and products; the calculator tool), with every calculator call
delayed by a seeded lognormal draw (median ``--median-delay`` s, ``--sigma``): a search engine
or a slow API, where a synchronous step waits for its slowest trajectory. One SFT warm start,
then from the same policy: the synchronous loop, ``trainer.max_staleness``
1 and 2, and at 1 with ``engine.keep_kv_on_update`` (``async1_keepkv``: a push lands
mid-turn, which goes on over the old weights' KV instead of waiting), and when asked, the
async1 modes with their pushes not staged (``async1_unstaged``, ``async1_keepkv_unstaged``:
the generation stall of a push before `engine.push.staged`), each ``--steps`` updates
of 8 prompts x 8 samples on the embedded engine (``--modes``: some of them; sync is always
run). Reported per mode: trajectories trained per second over the RL updates (the figure
async training is for), rollout tokens per second (async: model tokens sampled per second of
update, the first update left out, every later one following a push; sync: per second of its
rollouts), held-out greedy success after the
last update, the mean rollout and learner idle fractions, the share of trained tokens sampled
over KV older than their weights, the seconds each push held generation up and their share
of the wall time, and the per-step reward curve; then each async mode's
throughput as a ratio to the synchronous one and its held-out success minus sync's; ``--plot``
draws the reward curves and the throughputs into a PNG. Ends with one JSON line.

    .venv/bin/python bench/async.py [--steps 10] [--median-delay 1.0] [--sigma 1.2] [--plot F]
        [--modes async1,async2,async1_keepkv] [--set KEY=VALUE ...] [--smoke]

``--smoke``: the smallest run that goes through every mode (SFT of 2 steps, then 2 updates of
1 prompt x 2 samples each, 4 held-out problems, 10 ms tool delays): it checks the bench
works, its figures mean nothing.

The ratio grows with the tool latency: the engine and the learner share this machine's cores
and take turns on them, so async training can only hide the time nobody computes (the tools'
latency, the slowest trajectory's tail). At ``--median-delay 0.5`` on 2 cores the synchronous
step computes about 56% of the time, which caps the ratio near 1.8.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

from jax_agent_rl.cli import compile_cache
from jax_agent_rl.cli.demo import SMALL_OVERRIDES, SMOKE_OVERRIDES, small_task_sft
from jax_agent_rl.config import load_config
from jax_agent_rl.models import request_cpu_devices
from jax_agent_rl.tools import ToolResult, tool
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
DELAY_ENV = "JARL_BENCH_TOOL_DELAY"  # "median,sigma,seed"
_draws: list[random.Random] = []
# the async modes' overrides (each run beside the synchronous loop)
ASYNC_MODES = {
    "async1": ["trainer.max_staleness=1"],
    "async2": ["trainer.max_staleness=2"],
    "async1_keepkv": [
        "trainer.max_staleness=1",
        "engine.keep_kv_on_update=true",
    ],
    # the same two without staging a push (`engine.push.staged=false`): the old weights are
    # dropped, then the new ones placed, while generation waits (not run unless asked)
    "async1_unstaged": [
        "trainer.max_staleness=1",
        "engine.push.staged=false",
    ],
    "async1_keepkv_unstaged": [
        "trainer.max_staleness=1",
        "engine.keep_kv_on_update=true",
        "engine.push.staged=false",
    ],
}
DEFAULT_MODES = ("async1", "async2", "async1_keepkv")


@tool(name="calculator")
async def slow_calculator(expression: str) -> str | ToolResult:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: Arithmetic such as a * b or a + b.
    """
    median, sigma, seed = os.environ[DELAY_ENV].split(",")
    if not _draws:
        _draws.append(random.Random(int(seed)))
    await asyncio.sleep(_draws[0].lognormvariate(math.log(float(median)), float(sigma)))
    return await calculator.execute(None, {"expression": expression})


def tools_yaml(folder: Path) -> Path:
    """The calculator tool of the demo, through `slow_calculator` (this file as module
    ``async``: the script's folder is on the import path)."""
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "Arithmetic such as a * b or a + b.",
                    }
                },
                "required": ["expression"],
            },
        },
    }
    path = folder / "tools_slow.yaml"
    path.write_text(json.dumps([{"class": "async:slow_calculator", "schema": schema}]))
    return path


def run_mode(
    folder: Path, sft: Path, tools: Path, name: str, mode: list[str], steps: int, common: list[str]
) -> dict:
    run = folder / name
    overrides = [
        *SMALL_OVERRIDES,
        *common,
        *mode,
        f"model.path={sft}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        f"data.val={folder / 'task' / 'val.jsonl'}",
        "sft.data=",
        f"tools.config={tools}",
        f"trainer.run_dir={run}",
        f"trainer.steps={steps}",
        f"trainer.eval_every={steps}",
        f"trainer.save_every={steps}",
    ]
    importlib.import_module("async")._draws.clear()  # every mode draws the same delays
    train(load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", overrides))
    updates = read_metrics(run / "metrics.jsonl", "train")
    held_out = [r["success"] for r in read_metrics(run / "metrics.jsonl", "val")]
    seconds = sum(m["time/step_s"] for m in updates[1:])  # the first compiles: left out
    trained = sum(m["batch/trajectories"] for m in updates[1:])

    def mean(key: str) -> float:
        return round(sum(m[key] for m in updates[1:]) / max(len(updates) - 1, 1), 3)

    return {
        "trajectories_per_s": round(trained / seconds, 2),
        "rollout_tokens_per_s": mean("time/rollout_tokens_per_s"),
        "held_out_success": held_out[-1],
        "held_out_start": held_out[0],
        "rollout_idle_frac": mean("time/rollout_idle_frac"),
        "learner_idle_frac": mean("time/learner_idle_frac"),
        "staleness_max": max(m["staleness/max"] for m in updates),
        "kv_older_tokens": mean("staleness/kv_older_tokens"),
        # how long each push held generation up (`PushStats.stall_s`), and their share of
        # the updates' wall time
        "push_stall_s": mean("push/stall_s"),
        "push_stall_frac": round(sum(m["push/stall_s"] for m in updates[1:]) / seconds, 4),
        "reward_curve": [round(m["reward"], 3) for m in updates],
    }


def plot(figures: dict, path: Path) -> None:
    """Reward per update of each mode, and trajectories trained per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["sync", *figures["modes"]]
    fig, (curves, rates) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        rewards = figures[f"{mode}_reward_curve"]
        curves.plot(range(1, len(rewards) + 1), rewards, marker="o", label=mode)
    curves.set(xlabel="update", ylabel="mean reward of its trajectories", title="reward")
    curves.legend()
    rates.bar(modes, [figures[f"{m}_trajectories_per_s"] for m in modes])
    rates.set(ylabel="trajectories trained / s", title="throughput")
    fig.suptitle(
        f"tool latency lognormal (median {figures['median_delay_s']} s, "
        f"sigma {figures['sigma']}); held-out: "
        + ", ".join(f"{m} {figures[f'{m}_held_out_success']:.2f}" for m in modes)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--median-delay", type=float, default=1.0, help="seconds")
    parser.add_argument("--sigma", type=float, default=1.2, help="of the log of the delay")
    parser.add_argument("--plot", type=Path, help="a PNG of the reward curves and throughputs")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"the async modes run beside sync, of {', '.join(ASYNC_MODES)} (a mode and its "
        "_unstaged twin: the ratio of their push stalls)",
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every mode, e.g. optim.lr=5e-4 or "
        "algorithm.rollout_mask=geometric",
    )
    args = parser.parse_args()
    chosen = [m for m in args.modes.split(",") if m]
    if not chosen or set(chosen) - set(ASYNC_MODES):
        parser.error(f"--modes {args.modes!r}: some of {', '.join(ASYNC_MODES)}")
    if args.smoke:
        args.steps, args.sft_steps, args.median_delay, args.sigma = 2, 2, 0.01, 0.1
        args.set = [*SMOKE_OVERRIDES, *args.set]
    if args.steps < 2:
        parser.error(
            "--steps must be at least 2: the first update compiles, and is left out of the timings"
        )
    request_cpu_devices(2)  # the demo config's mesh (data=2), before anything starts JAX
    # every mode compiles the same programs: from the second on they load (as `jarl train`'s
    # runs do); the figures leave each mode's first update out
    compile_cache.enable(compile_cache.default_folder())
    os.environ[DELAY_ENV] = f"{args.median_delay},{args.sigma},0"
    figures: dict[str, object] = {
        "bench": "async",
        "steps": args.steps,
        "median_delay_s": args.median_delay,
        "sigma": args.sigma,
        "overrides": args.set,
        "modes": chosen,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small_task_sft(folder, args.sft_steps, args.set)
        tools = tools_yaml(folder)
        modes = {"sync": [], **{m: ASYNC_MODES[m] for m in chosen}}
        for name, mode in modes.items():
            result = run_mode(
                folder, folder / "sft" / "hf", tools, name, mode, args.steps, args.set
            )
            figures.update({f"{name}_{k}": v for k, v in result.items()})
            print(f"# {name}: {result}", file=sys.stderr, flush=True)
    if args.plot:
        plot(figures, args.plot)
    sync_rate = figures["sync_trajectories_per_s"]
    for name in chosen:
        rate = figures[f"{name}_trajectories_per_s"]
        figures[f"{name}_throughput_ratio"] = round(rate / sync_rate, 2)  # type: ignore[operator]
        gap = figures[f"{name}_held_out_success"] - figures["sync_held_out_success"]  # type: ignore[operator]
        figures[f"{name}_held_out_minus_sync"] = round(gap, 3)
        staged = name.removesuffix("_unstaged")
        if staged != name and staged in chosen:  # the stall per push, unstaged over staged
            before, after = (float(figures[f"{m}_push_stall_s"]) for m in (name, staged))  # type: ignore[arg-type]
            figures[f"{staged}_unstaged_over_staged_stall"] = round(before / max(after, 1e-6), 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
