"""Rollout strategies and training samples on the demo task, side by side from one warm start.

The learning test's task (sums and products; the calculator tool): one SFT warm start, then
from the same policy and seeds, ``--steps`` GRPO updates of 8 prompts each, with

- ``chain``: 8 independent episodes per prompt (``group.strategy=chain``),
- ``tree``: 2 roots branching into 2 at each of their first 2 tool observations
  (``group.strategy=tree``), within the budget of 8 chain episodes per prompt (8 x
  ``agent.max_response_tokens`` model tokens, 8 x ``agent.max_turns`` tool calls),
- ``per_turn``: chains trained as one sample per model turn (``algorithm.turn_mode=per_turn``).

Held-out greedy success (100 problems) is measured every ``--eval-every`` updates. Reported
per mode: the held-out curve, the model tokens sampled and tool calls made per update (what
the budget bounds), episodes (leaves) per update and seconds per update; ``--plot`` draws
held-out success against updates. Ends with one JSON line.

    .venv/bin/python bench/strategies.py [--steps 10] [--eval-every 2] [--plot F] [--smoke]

``--smoke``: the smallest run that goes through every mode (SFT of 2 steps, then 2 updates of
1 prompt x 2 samples each, 4 held-out problems): it checks the bench works, its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from jax_agent_rl.cli.demo import SMALL_OVERRIDES, SMOKE_OVERRIDES, small_task_sft
from jax_agent_rl.config import load_config
from jax_agent_rl.models import request_cpu_devices
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "chain": [],
    "tree": ["group.strategy=tree", "group.tree.n_roots=2", "group.tree.branch=2"],
    "per_turn": ["algorithm.turn_mode=per_turn"],
}


def run_mode(
    folder: Path, sft: Path, name: str, steps: int, eval_every: int, common: list[str]
) -> dict:
    run = folder / name
    overrides = [
        *SMALL_OVERRIDES,
        *common,
        *MODES[name],
        f"model.path={sft}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        f"data.val={folder / 'task' / 'val.jsonl'}",
        "sft.data=",
        "tools.config=pkg://jax_agent_rl/configs/tools_calculator.yaml",
        f"trainer.run_dir={run}",
        f"trainer.steps={steps}",
        f"trainer.eval_every={eval_every}",
        f"trainer.save_every={steps}",
    ]
    train(load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", overrides))
    updates = read_metrics(run / "metrics.jsonl", "train")
    held_out = read_metrics(run / "metrics.jsonl", "val")

    def mean(key: str) -> float:
        return round(sum(m[key] for m in updates) / len(updates), 2)

    return {
        "held_out": {int(r["step"]): r["success"] for r in held_out},
        "model_tokens_per_update": mean("rollout/model_tokens"),
        "tool_calls_per_update": mean("rollout/tool_calls"),
        "episodes_per_update": mean("rollout/episodes"),
        "rows_per_update": mean("batch/rows"),
        "seconds_per_update": round(sum(m["time/step_s"] for m in updates[1:]) / (steps - 1), 2),
        "reward_curve": [round(m["reward"], 3) for m in updates],
    }


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in (m for m in MODES if m in figures):
        curve = figures[mode]["held_out"]
        ax.plot(list(curve), list(curve.values()), marker="o", label=mode)
    ax.set(xlabel="update", ylabel="held-out greedy success", title="chain vs tree vs per-turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--modes", default=",".join(MODES), help="which of chain,tree,per_turn")
    parser.add_argument("--plot", type=Path, help="a PNG of held-out success per update")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    common = []
    if args.smoke:
        args.steps, args.eval_every, args.sft_steps = 2, 2, 2
        common = SMOKE_OVERRIDES
    if args.steps < 2:
        parser.error(
            "--steps must be at least 2: the first update compiles, and is left out of the timings"
        )
    request_cpu_devices(2)  # the demo config's mesh (data=2), before anything starts JAX
    figures: dict = {"bench": "strategies", "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small_task_sft(folder, args.sft_steps, common)
        for name in args.modes.split(","):
            sft = folder / "sft" / "hf"
            figures[name] = run_mode(folder, sft, name, args.steps, args.eval_every, common)
            print(f"# {name}: {figures[name]}", file=sys.stderr, flush=True)
    if args.plot:
        plot(figures, args.plot)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
