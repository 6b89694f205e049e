"""Every benchmark in bench/ runs: its smallest configuration (``--smoke``, or tiny sizes where
its arguments allow them), in this process through its ``main()``, ends by printing one JSON
line, and that line holds the figures the docs quote. (The figures themselves are not
checked: at these sizes they mean nothing.)

bench/tpu_plan.py is not run here: what it runs, `jarl plan` of the tiny run on v5e:2x2, is
what tests/plan/test_plan.py compiles, and that test reads the bench's figures from the same
record (`test_the_tpu_plan_bench_reads_the_plan_record`). bench/weight_push.py pushes into a
vLLM engine, so it needs .venv-vllm, as the tests in tests/backends/vllm do; its ``--lora`` run
(the embedded engine) is smoked on its own, its push share checked against the parameter
count (`test_the_lora_weight_push_bench_pushes_the_adapters_alone`)."""

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.models.decoder import Layer

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def bench_figures(
    name: str, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """Runs bench/``name``.py's ``main()`` with ``argv``; the JSON object its last stdout line
    holds (everything before it may be progress)."""
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    capsys.readouterr()  # what came before is not the bench's
    module.main()
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), lines[-1]
    return figures


# bench name -> (its smallest arguments, keys its JSON line must hold)
SMOKE: dict[str, tuple[list[str], set[str]]] = {
    "decode": (
        ["--smoke"],
        {
            "peak_float32_gflops",
            "bandwidth_gb_s",
            "tiny_float32_b1_roofline_tok_s",
            "tiny_float32_b1_jax_tok_s",
            "tiny_float32_b1_jax_roofline_frac",
        },
    ),
    "exact_logprobs": (
        ["--smoke"],
        {
            f"{side}_{k}"
            for side in ("default", "exact")
            for k in ("rollout_tok_s", "learner_tok_s", "logprob_gap_max")
        }
        | {"rollout_tok_s_ratio", "learner_tok_s_ratio"},
    ),
    "forward": (
        ["--smoke"],
        {
            f"{side}_{d}_{what}"
            for side in ("jax", "torch")
            for d in ("float32", "bfloat16")
            for what in ("tok_s", "mfu")
        }
        | {"ratio_float32", "ratio_bfloat16", "ratio_best", "matmul_peak_float32_tflops"},
    ),
    "tools": (
        ["--smoke"],
        {
            "server_unix_exec_s",
            "server_http_exec_s",
            "direct_sandbox_exec_s",
            "fresh_python_exec_s",
            "fresh_bwrap_python_exec_s",
            "ratio_vs_fresh_python",
            "ratio_vs_fresh_bwrap",
        },
    ),
    "rollout": (
        ["--smoke"],
        {
            f"embedded_{k}"
            for k in (
                "async_s",
                "lockstep_s",
                "async_over_lockstep",
                "critical_path_s",
                "async_over_critical_path",
                "same_tokens_both_modes",
                "generated_tokens",
            )
        }
        | {"delay_only_speedup_bound"},
    ),
    "straggler": (
        ["--model", "tiny", "--long", "200", "--short", "3"],
        {"alone_s", "with_long_s", "penalty", "long_alone_s", "serial_penalty"},
    ),
    "agentic": (
        # tiny sizes: 1 prompt x 2 episodes of at most 2 turns, 256 positions, 1 MiB of KV
        [
            *("--model", "tiny", "--max-len", "256", "--kv-gib", "0.0009765625"),
            *("--prompts", "1", "--n", "2", "--max-turns", "2", "--backends", "embedded,dense"),
        ],
        {
            "final_len_p50",
            "long_tailed",
            "embedded_useful_tok_s",
            "embedded_peak_kv_reserved_bytes",
            "embedded_peak_kv_real_bytes",
            "embedded_call_share_of_wall",
            "embedded_step_calls",
            "embedded_step_padding_share",
            "embedded_mean_decode_batch",
            "dense_useful_tok_s",
            "kv_reserved_over_real",
            "useful_tok_s_ratio_vs_dense",
            "useful_tok_s_ratio_vs_vllm",
        },
    ),
    # long_tail runs every variant (uniform runs two of them), in fp32 only when smoked
    "learner": (
        ["--smoke", "--workload", "long_tail"],
        {
            *(
                f"{v}_tok_s"
                for v in (
                    "torch_sorted_fp32",
                    "jax_packed_fp32",
                    "torch_packed_fp32",
                    "jax_padded_fp32",
                )
            ),
            "mfu_jax_packed_fp32",
            "recompiles_jax_packed_fp32",
            "real_token_frac",
            "ratio_vs_torch",
            "ratio_vs_padded",
            "skipped",
        },
    ),
    "traces": (["--smoke"], {"untraced_step_s", "traced_step_s", "overhead"}),
    "strategies": (
        ["--smoke"],
        {"chain", "tree", "per_turn"},
    ),
    "async": (
        ["--smoke"],
        {
            *(
                f"{m}_{k}"
                for m in ("sync", "async1", "async2", "async1_keepkv")
                for k in (
                    "trajectories_per_s",
                    "rollout_tokens_per_s",
                    "held_out_success",
                    "kv_older_tokens",
                    "push_stall_s",
                    "reward_curve",
                )
            ),
            "async1_throughput_ratio",
            "async2_throughput_ratio",
            "async2_held_out_minus_sync",
            "async1_keepkv_held_out_minus_sync",
        },
    ),
    "weight_push": (
        ["--model", "tiny", "--pushes", "1"],
        {"bytes", "write_s", "load_s", "total_s", "gb_per_s"},
    ),
}


# the MoE presets (bench/learner.py --model, bench/decode.py --models): the MoE beside its dense
# twin of the same active parameters, and for the learner beside transformers' Qwen3-MoE
MOE_SMOKE: dict[str, tuple[list[str], set[str]]] = {
    "learner": (
        ["--smoke", "--model", "tiny-moe"],
        {
            *(
                f"{v}_tok_s"
                for v in (
                    "torch_sorted_fp32",
                    "jax_packed_fp32",
                    "dense_jax_packed_fp32",
                )
            ),
            "mfu_dense_jax_packed_fp32",
            "recompiles_dense_jax_packed_fp32",
            "active_params",
            "dense_params",
            "torch_experts_implementation",
            "moe_over_dense_fp32",
            "moe_over_dense_best",
            "ratio_vs_torch",
            "ratio_vs_torch_fp32",
        },
    ),
    "decode": (
        ["--smoke", "--models", "tiny-moe"],
        {
            "tiny-moe_active_params",
            "tiny-moe_dense_active_params",
            "tiny-moe_float32_b1_roofline_tok_s",
            "tiny-moe_float32_b1_jax_tok_s",
            "tiny-moe_float32_b1_dense_jax_tok_s",
            "tiny-moe_float32_b1_moe_over_dense",
        },
    ),
}


@pytest.mark.parametrize("name", list(MOE_SMOKE))
def test_the_learner_and_decode_benches_time_a_moe_beside_its_dense_twin(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, keys = MOE_SMOKE[name]
    figures = bench_figures(name, argv, capsys, monkeypatch)
    assert figures["bench"] == name
    assert keys <= figures.keys(), sorted(keys - figures.keys())


@pytest.mark.parametrize("name", list(SMOKE))
def test_a_bench_ends_with_its_figures_as_one_json_line(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, keys = SMOKE[name]
    if name == "async":
        # its tools config names `async:slow_calculator`: the bench's folder is on the path
        # when it runs as a script; the delays' setting goes back as it was
        monkeypatch.syspath_prepend(str(BENCH))
        monkeypatch.setenv("JARL_BENCH_TOOL_DELAY", "")
    figures = bench_figures(name, argv, capsys, monkeypatch)
    assert figures["bench"] == name
    assert keys <= figures.keys(), sorted(keys - figures.keys())
    if name == "strategies":
        for mode in ("chain", "tree", "per_turn"):
            assert {"held_out", "model_tokens_per_update", "seconds_per_update"} <= set(
                figures[mode]
            )


def test_every_bench_is_smoked() -> None:
    """Each file of bench/ is smoked here, or by a test of its own: tpu_plan (see above), the
    GPU checks' dry runs (tests/test_gpu_check.py, tests/test_cuda_push_check.py)."""
    elsewhere = {"tpu_plan", "gpu_check", "cuda_push_check"}
    assert {p.stem for p in BENCH.glob("*.py")} == {*SMOKE, *elsewhere}


def _adapter_share(hf: dict[str, Any], rank: int) -> float:
    """The share of a LoRA policy's parameters (rank ``rank`` on every projection of the model
    ``hf``) that its adapters are: what a push of the adapters alone moves, over a push of the
    whole policy, both fp32."""
    import dataclasses
    import math

    import jax

    from jax_agent_rl.models import Lora, ModelConfig
    from jax_agent_rl.models.decoder import is_spec, param_specs

    cfg = dataclasses.replace(ModelConfig.from_hf(hf), lora=Lora(rank, 2.0 * rank))
    specs = param_specs(cfg)
    assert isinstance(specs.layers, Layer)

    def size(tree: object) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(tree, is_leaf=is_spec))

    return size(specs.layers.lora) / size(specs)


def test_the_lora_weight_push_bench_pushes_the_adapters_alone(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/weight_push.py --lora at its smallest (the tiny model, one push, rank 16): its
    adapter push moves the adapters' share of the policy's bytes, 10.4% there (2 layers of
    width 256, a 512-token vocabulary); the small model it runs by default, whose figure the
    docs quote (docs/engine.md: 2.9%), pushes under 5% of its bytes."""
    from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2

    argv = ["--lora", "--model", "tiny", "--pushes", "1"]
    figures = bench_figures("weight_push", argv, capsys, monkeypatch)
    assert figures["bench"] == "weight_push_lora" and figures["rank"] == 16
    keys = {"full_bytes", "adapter_bytes", "unmerged_decode_tok_s", "merged_decode_tok_s"}
    assert keys <= figures.keys(), sorted(keys - figures.keys())
    assert figures["adapter_over_full"] == round(_adapter_share(TINY_QWEN2, 16), 4) == 0.1038
    assert _adapter_share(SMALL_QWEN2, 16) < 0.05
