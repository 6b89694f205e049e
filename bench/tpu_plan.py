"""`jarl plan` of the GSM8K tools config (configs/gsm8k_tools_qwen2.5.yaml) at real model sizes
on Cloud TPU slices, compiled on this CPU host (libtpu): does each run compile, and fit?

Runs (each its own `jarl plan` process, one at a time; `--runs` picks some):
  1.5b      Qwen2.5-1.5B on v5e:2x2 (4 chips of 16 GiB), mesh fsdp=2 tensor=2, 64 decode
            slots, rows of 4096 tokens (one trajectory each)
  7b-v5p    Qwen2.5-7B on v5p:2x2x1 (4 chips of 95 GiB), mesh fsdp=4
  7b-v5e    Qwen2.5-7B on v5e:4x4 (16 chips of 16 GiB), mesh fsdp=4 tensor=4 (kv heads: 4 at
            most), 64 decode slots, episodes and rows of 2048 tokens and no KL reference (the
            config's 4096-token episodes, 8192-token rows and KL reference need 21.3 GiB per
            chip; 2048-token rows with the rest kept, 19.1)
  32b-v5p   Qwen2.5-32B on v5p:2x2x4 (16 chips of 95 GiB), mesh fsdp=4 tensor=4: the smallest v5p
            slice that can hold it (on v5p:2x2x2, 8 chips, the learner's fp32 weights, AdamW
            moments, KL reference and gradient alone are ~82 GiB per chip, with the engine's
            bf16 weights on top)
  7b-lora-v5e
            Qwen2.5-7B with LoRA adapters of rank 32 on every projection on v5e:2x4 (8 chips, a
            v5e-8), mesh fsdp=2 tensor=4; the config's episodes, rows and KL reference (the
            LoRA run's is its own base, no copy). Its plan carries the same run training every
            weight, compiled beside it ("full_parameter")
  30b-a3b-v5p
            Qwen3-30B-A3B (48 layers, 128 experts of which 8 per token, 30.5B parameters, 3.3B
            active) on v5p:2x2x4, mesh fsdp=4 tensor=4 (the 128 experts split over fsdp), rows
            of 4096 tokens: 89.0 GiB per chip of 95 (with the config's 8192-token rows the
            update's temporaries make it 98.4, 3.4 over: docs/tpu.md)
  gemma3-1b Gemma 3 1B (26 layers, five local of a 512-position window to one global; one kv
            head, so no tensor split) on v5e:2x2, mesh fsdp=4, 64 decode slots, rows of 4096
            tokens
  gemma3-4b-v5p
            Gemma 3 4B's language model (34 layers, a 1024-position window) on v5p:2x2x1,
            mesh fsdp=4

The meshes are picked to fit by `jarl train --dry-run`'s memory plan (the engine serves on
the same chips, its weights split over ``tensor`` only). Figures are the compiler's: HBM per
chip from its memory analysis, time and MFU a roofline estimate of its counts (docs/tpu.md,
`jarl plan`), not measurements.

    .venv/bin/python bench/tpu_plan.py --runs 1.5b --compile-timeout 1800 \
        --set learner.row_tokens=1024

Prints each plan's report on stderr and ends with one JSON line on stdout:
{"runs": [{"name", "topology", "compiled", "fits", "hbm_per_chip_gib", "compile_s",
"predicted_mfu", "programs": [{"name", "compiled", "compile_s", "hbm_per_chip_gib",
"flops_per_device", "pallas_kernels", "trained_params", "predicted_s", "predicted_mfu",
"counted_flops", "counted_bytes", "compiler_flops", "compiler_bytes", "top_bytes", "top_flops",
"mesh_findings"}, ...], "full_parameter" (a LoRA run's: the same figures of the run training
every weight)}, ...]}. ``mesh_findings`` of the training steps is the check
tests/plan/test_collectives.py makes on a tiny run (the collectives the mesh implies, no
others), made here at full size; ``compiler_*`` are XLA's own counts (each loop body once,
kernels as nothing), ``counted_*`` the plan's (`jax_agent_rl.plan.hlo`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml"

# name -> (--model, --topology, overrides)
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "1.5b": (
        "qwen2.5-1.5b",
        "v5e:2x2",
        ["mesh.fsdp=2", "mesh.tensor=2", "engine.max_concurrent=64", "learner.row_tokens=4096"],
    ),
    "7b-v5p": ("qwen2.5-7b", "v5p:2x2x1", ["mesh.fsdp=4"]),
    "7b-v5e": (
        "qwen2.5-7b",
        "v5e:4x4",
        [
            "mesh.fsdp=4",
            "mesh.tensor=4",
            "engine.max_concurrent=64",
            "learner.row_tokens=2048",
            "engine.max_model_len=2048",
            "algorithm.kl_coef=0",
        ],
    ),
    "32b-v5p": ("qwen2.5-32b", "v5p:2x2x4", ["mesh.fsdp=4", "mesh.tensor=4"]),
    "7b-lora-v5e": (
        "qwen2.5-7b",
        "v5e:2x4",
        ["model.lora.rank=32", "mesh.fsdp=2", "mesh.tensor=4"],
    ),
    "30b-a3b-v5p": (
        "qwen3-30b-a3b",
        "v5p:2x2x4",
        ["mesh.fsdp=4", "mesh.tensor=4", "learner.row_tokens=4096"],
    ),
    "gemma3-1b": (
        "gemma3-1b",
        "v5e:2x2",
        ["mesh.fsdp=4", "engine.max_concurrent=64", "learner.row_tokens=4096"],
    ),
    "gemma3-4b-v5p": ("gemma3-4b", "v5p:2x2x1", ["mesh.fsdp=4"]),
}
KEYS = (
    "name",
    "compiled",
    "compile_s",
    "hbm_per_chip_gib",
    "flops_per_device",
    "pallas_kernels",
    "trained_params",
)


# the counts behind the estimate, the ops moving the most bytes and running the most FLOPs,
# and what a training step's collectives do beyond what the mesh implies (none: [])
COUNTS = (
    "counted_flops",
    "counted_bytes",
    "compiler_flops",
    "compiler_bytes",
    "top_bytes",
    "top_flops",
    "mesh_findings",
)


def plan(name: str, extra: list[str], timeout_s: float | None) -> dict[str, object]:
    """One run's `jarl plan` (its report on stderr) and its record."""
    model, topology, overrides = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        command = [
            sys.executable,
            "-m",
            "jax_agent_rl.cli",
            "plan",
            str(CONFIG),
            *overrides,
            *extra,
            "--model",
            model,
            "--topology",
            topology,
            "--no-search",
            "--json",
            str(out),
        ]
        if timeout_s is not None:
            command += ["--compile-timeout", str(timeout_s)]
        print(f"# {' '.join(command[2:])}", file=sys.stderr, flush=True)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=sys.stderr, check=False)
        if done.returncode not in (0, 1) or not out.exists():
            return {
                "name": name,
                "topology": topology,
                "compiled": False,
                "fits": False,
                "error": f"jarl plan exited {done.returncode}",
            }
        return figures(name, json.loads(out.read_text()))


def figures(name: str, record: dict[str, Any]) -> dict[str, object]:
    """The figures of run ``name`` from its `jarl plan --json` record (tests/plan reads those
    of the tiny runs' records with this); a LoRA run's with those of the same run training
    every weight."""
    full = record.get("full_parameter")
    peak = record["hbm_per_chip_gib"]  # None: a program did not compile
    return {
        "name": name,
        "topology": record["topology"],
        "compiled": record["compiled"],
        "fits": record["fits"],
        "hbm_per_chip_gib": None if peak is None else round(peak, 2),
        "compile_s": round(record["compile_s"], 1),
        "predicted_mfu": record["predicted_mfu"],
        "programs": [
            {
                **{k: p[k] for k in KEYS},
                "predicted_s": p["predicted_s"],
                "predicted_mfu": p["predicted_mfu"],
                **{k: p[k] for k in COUNTS},
            }
            for p in record["programs"]
        ],
        **({"full_parameter": figures(name, full)} if full is not None else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument(
        "--compile-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per program: a compilation taking longer is reported as not compiled",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every run (learner.row_tokens=1024, ...)",
    )
    args = parser.parse_args()
    runs = [plan(name, args.set, args.compile_timeout) for name in args.runs]
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
