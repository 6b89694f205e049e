"""bench/gpu_check.py's dry run: every step at a tiny shape on CPU (the GPU-only parts left
out: the tests only collected, no peaks), so the check does not rot between GPU runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_check import STEPS, peaks_of

ROOT = Path(__file__).resolve().parent.parent


def test_peaks_of_known_and_unknown_cards() -> None:
    assert peaks_of("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert peaks_of("NVIDIA H200") == (989e12, 4.8e12)
    assert peaks_of("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert peaks_of("NVIDIA A100-SXM4-80GB") == (None, None)


def test_dry_run_passes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run"],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])["gpu_check"]
    assert summary["dry_run"] and summary["passed"]
    assert list(summary["steps"]) == [s.name for s in STEPS]
    for name, step in summary["steps"].items():
        assert step["status"] == "passed", (name, step)
    steps = summary["steps"]
    assert steps["hf_parity"]["collected"] == 12
    assert steps["sampler_vs_learner"]["collected"] == 2
    assert steps["paged_attention"]["max_err_over_bound"] <= 1.0
    assert steps["learner_step"]["compiles_in_timed_steps"] == 0
    assert steps["decode"]["b2"]["tokens_per_s"] > 0
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary
    assert "== decode: passed" in (tmp_path / "gpu_check.log").read_text()
