"""bench/gpu_check.py's dry run: every step at a tiny shape on CPU (the GPU-only parts left
out: the tests only collected, no peaks), so the check does not rot between GPU runs; and its
reduction of a profiler trace to the top ops, on traces built by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import STEPS, decode_roofline, peaks_of, profile_table, top_ops
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
    assert steps["hf_parity"]["collected"] == 14
    assert steps["moe_parity"]["collected"] == 9
    assert steps["sampler_vs_learner"]["collected"] == 4
    assert steps["paged_attention"]["max_err_over_bound"] <= 1.0
    # on CPU the push's weights sit on no GPU: /dev/shm, and every tensor arrives bit for bit
    assert steps["cuda_push"]["transport"] == "shm" and steps["cuda_push"]["equal"]
    assert steps["learner_step"]["compiles_in_timed_steps"] == 0
    assert isinstance(steps["decode"]["b2"]["decode_tokens_per_s"], float)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary
    assert "== decode: passed" in (tmp_path / "gpu_check.log").read_text()
    # a profile of each timed program, named by its step's figures
    programs = {
        "device": ["matmul", "reduction"],
        "paged_attention": ["kernel", "xla_ragged"],
        "learner_step": ["rl_update"],
        "decode": ["b2"],
    }
    for name, want in programs.items():
        assert list(steps[name]["profiles"]) == want, name
        for program, entry in steps[name]["profiles"].items():
            assert entry["summary"] == f"profiles/{name}.{program}.json", entry
            assert entry["table"] == f"profiles/{name}.{program}.txt", entry
            profile = json.loads((tmp_path / entry["summary"]).read_text())
            assert profile["source"] == "host" and profile["platform"] == "cpu"
            assert 0 < len(profile["ops"]) <= 15 and profile["total_us"] > 0
            assert profile["ops"][0]["us"] >= profile["ops"][-1]["us"] > 0
            table = (tmp_path / entry["table"]).read_text()
            assert f"{name}.{program}: top {len(profile['ops'])} of" in table
            assert profile["ops"][0]["op"] in table
    kept = sum(f.stat().st_size for f in (tmp_path / "profiles").iterdir())
    assert kept < 2**20, kept  # small enough to copy back from a GPU machine


def test_top_ops_ranks_device_kernels_by_time_per_step() -> None:
    """Two steps on a GPU: dot.2 runs as two kernels (50 + 10 us) a step, fusion.1 as one
    of 30 us; another module's fusion.1 ran once (10 us); a host-to-device copy names no op
    (not the program's), and the host's events are not counted where the device has some.
    Per step: dot.2 60 us (2 kernels), jit_f's fusion.1 30, jit_g's 5 (half a kernel);
    total 95: 60/95 = 63.2 %, 30/95 = 31.6 %, 5/95 = 5.3 %."""

    def kernel(ts: float, dur: float, op: str, module: str = "jit_f", tid: int = 7) -> dict:
        args = {"hlo_op": op, "hlo_module": module}
        return {"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": "k", "args": args}

    host_op = {"hlo_op": "fusion.1", "hlo_module": "jit_f"}
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 900, "name": "thunk", "args": host_op},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 0, "dur": 500, "name": "MemcpyH2D"},
        kernel(0, 30, "fusion.1"),
        kernel(30, 50, "dot.2"),
        kernel(80, 10, "dot.2"),
        kernel(100, 30, "fusion.1"),
        kernel(130, 50, "dot.2"),
        kernel(180, 10, "dot.2"),
        kernel(200, 10, "fusion.1", module="jit_g", tid=9),
    ]
    summary = top_ops(events, repeats=2)
    assert summary["source"] == "device" and summary["processes"] == ["/device:GPU:0"]
    assert summary["events"] == 7 and summary["ops_seen"] == 3
    assert summary["total_us"] == 95.0 and summary["rest_us"] == 0.0
    assert summary["ops"] == [
        {"op": "dot.2", "module": "jit_f", "us": 60.0, "percent": 63.2, "count": 2.0},
        {"op": "fusion.1", "module": "jit_f", "us": 30.0, "percent": 31.6, "count": 1.0},
        {"op": "fusion.1", "module": "jit_g", "us": 5.0, "percent": 5.3, "count": 0.5},
    ]
    top2 = top_ops(events, repeats=2, top=2)
    assert [op["us"] for op in top2["ops"]] == [60.0, 30.0] and top2["rest_us"] == 5.0
    table = profile_table("learner_step.rl_update", top2)
    assert "top 2 of 3 ops" in table and "device streams: /device:GPU:0" in table
    assert "(the rest: 1 ops)" in table


def test_top_ops_times_host_xla_ops_by_self_time_without_a_device() -> None:
    """One step on the CPU: while.6 (100 us) holds fusion.2 (30) and fusion.3 (40), which
    holds custom-call.1 (15); fusion.2 also ran 30 us on another thread; the runtime's own
    events name no op. Self times: while.6 100 - 30 - 40 = 30, fusion.3 40 - 15 = 25,
    fusion.2 30 + 30 = 60, custom-call.1 15; total 130 (the events' 130 us of CPU time):
    60/130 = 46.2 %, 30/130 = 23.1 %, 25/130 = 19.2 %, 15/130 = 11.5 %."""

    def op(tid: int, ts: float, dur: float, name: str) -> dict:
        args = {"hlo_op": name, "hlo_module": "jit_step"}
        return {"ph": "X", "pid": 5, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}

    events = [
        {"ph": "M", "pid": 5, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 5, "tid": 1, "ts": -5, "dur": 200, "name": "ThunkExecutor::Execute"},
        op(1, 0, 100, "while.6"),
        op(1, 10, 30, "fusion.2"),
        op(1, 50, 40, "fusion.3"),
        op(1, 60, 15, "custom-call.1"),
        {"ph": "X", "pid": 5, "tid": 1, "ts": 100, "dur": 0.2, "name": "end: while.6"},
        op(2, 20, 30, "fusion.2"),
    ]
    summary = top_ops(events, repeats=1)
    assert summary["source"] == "host" and summary["processes"] == ["/host:CPU"]
    assert summary["total_us"] == 130.0
    assert [(o["op"], o["us"], o["percent"], o["count"]) for o in summary["ops"]] == [
        ("fusion.2", 60.0, 46.2, 2.0),
        ("while.6", 30.0, 23.1, 1.0),
        ("fusion.3", 25.0, 19.2, 1.0),
        ("custom-call.1", 15.0, 11.5, 1.0),
    ]
    assert "host XLA op events" in profile_table("decode.b2", summary)


def test_top_ops_of_a_trace_without_xla_ops_says_so() -> None:
    events = [
        {"ph": "M", "pid": 5, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 5, "tid": 1, "ts": 0, "dur": 200, "name": "PjitFunction(f)"},
    ]
    with pytest.raises(ValueError, match="no device events and no host events of XLA ops"):
        top_ops(events, repeats=1)


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
