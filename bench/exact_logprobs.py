"""What exact logprobs cost: the demo task's GRPO steps in bfloat16 from its warm start, with
``model.exact_logprobs`` off and on, in one run (the learning test's task,
`tests/train/test_learning.py`: 8 prompts x 8 episodes of up to 3 turns with calculator calls,
`SMALL_OVERRIDES`).

Reported per side, as the median over the steps after the first (which compiles): rollout
tokens per second (model tokens sampled per second of rollout: the engine's decode and
prefill, tool latency included alike on both sides), learner tokens per second (trained
tokens per second of update), the sampler-vs-learner logprob gap (max over the steps: 0 with
exact logprobs), then each rate's ratio exact / default. The two sides sample different
tokens (their logprobs differ in the last bits), so their episodes differ in length: the rates
are per token. Ends with one JSON line.

    .venv/bin/python bench/exact_logprobs.py [--steps 4] [--smoke]

``--smoke``: 2 steps of 1 prompt x 2 samples a side: it checks the bench works, its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from jax_agent_rl.cli.demo import SMALL_OVERRIDES, SMOKE_OVERRIDES, small_task
from jax_agent_rl.config import load_config
from jax_agent_rl.models import request_cpu_devices
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "tests" / "train" / "warm_starts" / "tiny"


def run_side(folder: Path, exact: bool, steps: int, smoke: bool) -> dict[str, float]:
    """``steps`` GRPO steps of the demo task in bf16 with exact logprobs ``exact``: its
    median rates over the steps after the first, and its largest logprob gap."""
    run = folder / ("exact" if exact else "default")
    overrides = [
        *SMALL_OVERRIDES,
        *(SMOKE_OVERRIDES if smoke else []),
        f"model.path={WARM_START}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        "data.val=",
        "sft.data=",
        "tools.config=pkg://jax_agent_rl/configs/tools_calculator.yaml",
        f"trainer.run_dir={run}",
        f"trainer.steps={steps}",
        "engine.warmup=false",
        "model.dtype=bfloat16",
        f"model.exact_logprobs={str(exact).lower()}",
        "engine.page_size=16",  # the same pages on both sides
        "engine.max_concurrent=128",  # exact: 64 rows on each of the mesh's 2 shards
    ]
    train(load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", overrides))
    m = read_metrics(run / "metrics.jsonl", "train")
    timed = m[1:] or m
    return {
        "rollout_tok_s": statistics.median(x["time/rollout_tokens_per_s"] for x in timed),
        "learner_tok_s": statistics.median(x["time/train_tokens_per_s"] for x in timed),
        "logprob_gap_max": max(x.get("logprob_gap/max", 0.0) for x in m),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=4, help="GRPO steps a side (the first compiles)"
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    steps = 2 if args.smoke else args.steps
    request_cpu_devices(2)  # the demo config's mesh (data=2), before anything starts JAX
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small_task(folder / "task", "tiny")
        sides = {
            name: run_side(folder, name == "exact", steps, args.smoke)
            for name in ("default", "exact")
        }
    figures: dict[str, object] = {"bench": "exact_logprobs", "steps": steps}
    figures.update({f"{side}_{k}": v for side, got in sides.items() for k, v in got.items()})
    for rate in ("rollout_tok_s", "learner_tok_s"):
        figures[f"{rate}_ratio"] = sides["exact"][rate] / sides["default"][rate]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
