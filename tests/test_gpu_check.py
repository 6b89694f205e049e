"""bench/gpu_check.py's dry run: every step at a tiny shape on CPU (the GPU-only parts left
out: the tests only collected, no peaks), so the check does not rot between GPU runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_check import STEPS, decode_roofline, peaks_of
from jax_agent_rl.plan.presets import preset_model

ROOT = Path(__file__).resolve().parent.parent


def test_peaks_of_known_and_unknown_cards() -> None:
    assert peaks_of("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert peaks_of("NVIDIA H200") == (989e12, 4.8e12)
    assert peaks_of("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert peaks_of("NVIDIA H200 NVL") == (835e12, 4.8e12)
    assert peaks_of("NVIDIA GH200 480GB") == (None, None)
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
    assert steps["moe_parity"]["collected"] == 9
    assert steps["sampler_vs_learner"]["collected"] == 2
    assert steps["paged_attention"]["max_err_over_bound"] <= 1.0
    assert steps["learner_step"]["compiles_in_timed_steps"] == 0
    assert isinstance(steps["decode"]["b2"]["decode_tokens_per_s"], float)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary
    assert "== decode: passed" in (tmp_path / "gpu_check.log").read_text()


def test_decode_roofline_of_a_1_5b_model_on_an_h100() -> None:
    """Qwen2.5-1.5B in bf16 (3.09 GB of weights; 28 KiB of keys and values a position) on an
    H100 SXM (3.35 TB/s, 989 TFLOP/s): one row reads the weights per token (~1085 tokens/s);
    256 rows of 1024 positions read 7.5 GB of cache besides, 10.6 GB a step (3.2 ms), still
    more time than their 2 * 1.54e9 * 256 FLOPs take at peak (0.8 ms): bandwidth-bound."""
    cfg = preset_model("qwen2.5-1.5b")
    assert cfg.num_params == 1_543_714_304
    flops, bandwidth = peaks_of("NVIDIA H100 80GB HBM3")
    assert flops is not None and bandwidth is not None
    one = decode_roofline(cfg, 1, 0, flops, bandwidth)
    assert abs(one - 3.35e12 / (2 * 1_543_714_304)) < 1e-6 * one
    kv = 2 * 28 * 2 * 128 * 2
    assert kv == 28672
    many = decode_roofline(cfg, 256, 1024, flops, bandwidth)
    want = 256 * 3.35e12 / (2 * 1_543_714_304 + 256 * 1024 * kv)
    assert abs(many - want) < 1e-6 * many
