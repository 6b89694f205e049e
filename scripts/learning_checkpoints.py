"""Makes the warm starts that tests/train/test_learning.py trains from with RL, into
tests/train/warm_starts/<name>/: the exported policy of an SFT-only run, and the run's held-out
success beside it (sft.json). ``tiny`` and ``tiny-moe``: the smaller demo task
(`jax_agent_rl.cli.demo.small_task_sft`), 600 steps for the dense demo model and 800 for its
Qwen3-MoE twin; ``tiny-compaction``: the compaction example's task with the dense model
(`jax_agent_rl.cli.demo.compaction_task_sft`).

The suite trains from these files rather than running the SFT itself (about 10 CPU-minutes of
every run, the MoE's most of it): what the suite measures is that RL raises a fixed policy's
held-out success. Rerun this when the task, the tokenizer or the checkpoint format changes
(`test_the_warm_starts_match_the_task` says so):

    .venv/bin/python scripts/learning_checkpoints.py [tiny|tiny-moe ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # as the suite's (tests/conftest.py)

from jax_agent_rl.cli.demo import compaction_task_sft, small_task_sft
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "train" / "warm_starts"
STEPS = {"tiny": 600, "tiny-moe": 800, "tiny-compaction": 2000}


def make(demo: str) -> Path:
    """The SFT run of ``demo`` and its exported policy in ``OUT/demo``."""
    out = OUT / demo
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if demo.endswith("-compaction"):
            compaction_task_sft(folder, STEPS[demo], demo.removesuffix("-compaction"))
        else:
            small_task_sft(folder, STEPS[demo], demo=demo)
        (val,) = read_metrics(folder / "sft" / "metrics.jsonl", "val")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(folder / "sft" / "hf", out)
        record = {"demo": demo, "sft_steps": STEPS[demo], "held_out_success": val["success"]}
        (out / "sft.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("demos", nargs="*", help=f"of {', '.join(STEPS)} (default: all)")
    demos = parser.parse_args().demos or list(STEPS)
    for bad in set(demos) - set(STEPS):
        parser.error(f"unknown demo {bad!r}: one of {', '.join(STEPS)}")
    for demo in demos:
        print(f"{demo}: {make(demo)}")


if __name__ == "__main__":
    main()
