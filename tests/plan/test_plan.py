"""``jarl plan``: a run's programs compiled for a TPU slice on this CPU host (libtpu), run as
the command a user types. The tiny demo model's whole run (RL update, SFT step, weight push,
ragged step, decode) compiles for v5e:2x2 and fits; its memory plan (`train.memory`) agrees with
the compiled figures; its LoRA run in bfloat16 compiles beside the same run training every
weight, its update smaller, its optimizer state the adapters'; a run that cannot fit is refused
naming the program; bad names are refused naming the accepted ones."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.cli.demo import PRESETS as CHECKPOINTS
from jax_agent_rl.config import load_config
from jax_agent_rl.models import ModelConfig
from jax_agent_rl.plan import parse_topology
from jax_agent_rl.plan.report import Compiled, Plan
from jax_agent_rl.train.memory import plan_memory

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_calculator_cpu.yaml"
GSM8K = ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml"
# the demo's run on the 4 chips of a v5e:2x2 (its data=2 mesh doubled), its rows shortened so
# that the RL update compiles sooner, with remat as the GSM8K config sets it
TINY_RUN = ["mesh.data=4", "sft.data=demos.jsonl", "learner.row_tokens=256", "learner.remat=true"]


def jarl_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jax_agent_rl.cli", "plan", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A checkpoint folder of the demo's model (the tests/train model): its config.json only,
    all a plan reads."""
    folder = tmp_path_factory.mktemp("tiny")
    fields, vocab = CHECKPOINTS["tiny"]
    (folder / "config.json").write_text(json.dumps({**fields, "vocab_size": vocab}))
    return folder, [f"model.path={folder}", *TINY_RUN]


LORA_RANK = 8


@pytest.fixture(scope="module")
def tiny_bf16_plan(
    tiny: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelConfig, subprocess.CompletedProcess[str], dict[str, Any]]:
    """The tiny run in bfloat16 (a 16-bit KV cache) with heads of 128 (what TPU kernels lay
    out in lanes, as real models' heads are), training LoRA adapters of rank 8 on every
    projection: its plan, and beside it the same run's training every weight."""
    folder = tmp_path_factory.mktemp("tiny_bf16")
    config = json.loads((tiny[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": 128}))
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    run = [*tiny[1], f"model.path={folder}", "model.dtype=bfloat16", f"model.lora.rank={LORA_RANK}"]
    done = jarl_plan(str(DEMO), *run, "--topology", "v5e:2x2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "  Pallas kernels: paged_attention" in done.stdout.splitlines()
    return ModelConfig.from_pretrained(folder), done, dict(json.loads(out.read_text()))


def test_the_tpu_programs_run_the_pallas_kernels(
    tiny_bf16_plan: tuple[ModelConfig, subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """On TPU the kernels run, not their XLA stand-ins: splash attention (forward and both
    backward kernels) in the learner's steps, the paged-attention kernel in the engine's
    ragged step (its decode rows, each shard's own, under shard_map), with LoRA adapters as
    without."""
    _, _, lora = tiny_bf16_plan
    for record in (lora, lora["full_parameter"]):
        kernels = {p["name"]: p["pallas_kernels"] for p in record["programs"]}
        for name in ("rl_update", "sft_step"):
            for part in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
                assert any(k.startswith(part) for k in kernels[name]), kernels
        assert kernels["step"] == kernels["decode"] == ["paged_attention"], kernels
        assert kernels["weight_push"] == [] and record["fits"]


def test_a_lora_run_is_planned_beside_training_every_weight(
    tiny_bf16_plan: tuple[ModelConfig, subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """The LoRA run's update trains the adapters alone: r (in + out) parameters per target
    projection and layer, their AdamW state two fp32 moments each (replicated over the mesh's
    4 data devices; a few scalar counters beside), and its push sends them alone (fp32).
    Its update needs less HBM per chip than the same run's training every weight, compiled
    beside it, whose optimizer covers every parameter; the table prints both."""
    model, done, lora = tiny_bf16_plan
    full = lora["full_parameter"]
    D, F, L = model.hidden_size, model.intermediate_size, model.num_layers
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    # (in, out) of q, k, v, o, gate, up, down
    shapes = [(D, q), (D, kv), (D, kv), (q, D), (D, F), (D, F), (F, D)]
    adapters = L * LORA_RANK * sum(i + o for i, o in shapes)
    by_name = {p["name"]: p for p in lora["programs"]}
    full_by_name = {p["name"]: p for p in full["programs"]}
    gib, counters = 2**30, 64  # bytes: AdamW's and the schedule's step counts
    for name in ("rl_update", "sft_step"):
        p, f = by_name[name], full_by_name[name]
        assert p["trained_params"] == adapters and f["trained_params"] == model.num_params
        assert 8 * adapters <= p["optimizer_gib"] * gib <= 8 * adapters + counters
        assert 8 * model.num_params <= f["optimizer_gib"] * gib <= 8 * model.num_params + counters
    assert by_name["weight_push"]["arguments_gib"] * gib == 4 * adapters
    assert by_name["rl_update"]["hbm_per_chip_gib"] < full_by_name["rl_update"]["hbm_per_chip_gib"]
    lines = done.stdout.splitlines()
    table = lines.index("  HBM per chip            LoRA            every weight")
    assert lines[table - 1].startswith("LoRA beside training every weight")
    assert re.fullmatch(r"  rl_update +[\d.]+ MiB +[\d.]+ MiB", lines[table + 1]), lines[table + 1]
    assert re.fullmatch(rf"  trained parameters +{adapters:,} +{model.num_params:,}", lines[-4])


@pytest.fixture(scope="module")
def tiny_plan(
    tiny: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    done = jarl_plan(str(DEMO), *tiny[1], "--topology", "v5e:2x2", "--json", str(out))
    assert out.exists(), done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_a_tiny_run_compiles_for_a_tpu_and_fits(
    tiny_plan: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    done, record = tiny_plan
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(
        r"fits: [\d.]+ GiB per chip of 16 on v5e:2x2 \(mesh data=4 fsdp=1 tensor=1\)", lines[-1]
    )
    names = [p["name"] for p in record["programs"]]
    assert names == ["rl_update", "sft_step", "weight_push", "step", "decode"]
    assert record["compiled"] and all(p["compiled"] for p in record["programs"])
    for name in names:  # each program's report: compiled, its bytes per chip
        i = lines.index(next(line for line in lines if line.startswith(f"{name}: ")))
        assert lines[i + 1].startswith("  compiled in "), lines[i : i + 3]
    assert any(line.startswith("run peak per chip: learner state") for line in lines)
    # the RL update's arguments: its state donated, returned in place (aliased)
    rl = record["programs"][0]
    assert rl["aliased_gib"] > 0.9 * rl["arguments_gib"] - 0.001


def test_the_tpu_plan_bench_reads_the_plan_record(
    tiny_plan: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
    tiny_bf16_plan: tuple[ModelConfig, subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """bench/tpu_plan.py runs `jarl plan --json` as this module does (its smoke run would
    compile the same programs again): its figures come out of the tiny runs' records, a LoRA
    run's with those of the run training every weight."""
    spec = importlib.util.spec_from_file_location("bench_tpu_plan", ROOT / "bench" / "tpu_plan.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _, record = tiny_plan
    out = bench.figures("tiny", record)
    assert out["topology"] == "v5e:2x2" and out["compiled"] and out["fits"]
    assert [p["name"] for p in out["programs"]] == [p["name"] for p in record["programs"]]
    json.dumps(out)  # what the bench prints
    lora = bench.figures("tiny-lora", tiny_bf16_plan[2])
    assert (
        lora["programs"][0]["trained_params"]
        < lora["full_parameter"]["programs"][0]["trained_params"]
    )
    assert lora["fits"] and lora["full_parameter"]["fits"] and "full_parameter" not in out


def test_the_memory_plan_agrees_with_the_compiled_run(
    tiny: tuple[Path, list[str]],
    tiny_plan: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """`plan_memory` (what ``jarl train --dry-run`` prints) against the compiled programs'
    memory analysis for TPU: the learner's state, the engine's weights and KV cache, and the
    run's peak, each within 15%."""
    _, record = tiny_plan
    cfg = load_config(DEMO, tiny[1], unread=("data.train", "data.val"))
    memory = plan_memory(cfg, ModelConfig.from_pretrained(tiny[0]))
    gib = 2**30
    by_name = {p["name"]: p for p in record["programs"]}
    assert memory.learner_bytes / gib == pytest.approx(
        by_name["rl_update"]["arguments_gib"], rel=0.15
    )
    assert memory.engine_bytes / gib == pytest.approx(by_name["step"]["arguments_gib"], rel=0.15)
    assert memory.peak_bytes / gib == pytest.approx(record["hbm_per_chip_gib"], rel=0.15)


def test_a_run_that_cannot_fit_is_refused_naming_the_program() -> None:
    """Qwen2.5-32B's learner alone is ~490 GiB of fp32 state: no mesh of 4 v5e chips holds it."""
    done = jarl_plan(str(GSM8K), "mesh.fsdp=4", "--model", "qwen2.5-32b", "--topology", "v5e-4")
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"does not fit: rl_update needs [\d.]+ GiB per chip of 16 \(over by [\d.]+\); "
        r"no smaller setting fits, nor any mesh of 4 chips: rl_update's arguments alone, split "
        r"over all 4, are [\d.]+ GiB per chip",
        last,
    ), last


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--topology", "v5e-3"], "use one of v5e-4, v5e:2x2, v5e-8, v5e:2x4"),
        (["--topology", "v4-8"], "v5p-8, v5p:2x2x1"),
        (["--topology", "v5e:4x4", "--model", "llama-9b"], "use one of qwen2.5-0.5b, "),
    ],
)
def test_bad_names_are_refused_naming_the_accepted_ones(args: list[str], named: str) -> None:
    done = jarl_plan(str(GSM8K), "--model", "qwen2.5-0.5b", *args)
    assert done.returncode == 2
    assert done.stderr.startswith("jarl: ") and named in done.stderr, done.stderr


def test_libtpu_says_nothing_of_the_tpu_vm_this_host_is_not() -> None:
    """libtpu's first load on a host that is no TPU VM wrote five lines (no accelerator type,
    no worker hostnames, an ``E0000 ... unexpected worker hostname``) on the user's terminal
    before ``jarl plan``'s report; they are dropped, and anything else it writes is kept."""
    code = "from jax_agent_rl.plan import parse_topology\n"
    code += "print(len(parse_topology('v5e:2x2').devices))"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "4\n", done.stderr
    assert "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr


def test_both_spellings_name_the_same_slice() -> None:
    """v5e / v6e names count chips, v5p names TensorCores (two per chip)."""
    assert parse_topology("v5e-16") == parse_topology("v5e:4x4")
    assert parse_topology("v5p-32") == parse_topology("v5p:2x2x4")
    assert parse_topology("v5p-32").chips == 16
    assert parse_topology("v6e-8").name == "v6e:2x4"


def test_the_other_meshes_are_those_the_config_checks_accept() -> None:
    """A run that does not fit is planned again on the slice's other (data, fsdp, tensor)
    factorizations, least tensor and data first, skipping those the config refuses (here the
    2 decode slots, which must split over data x fsdp)."""
    from jax_agent_rl.plan import other_meshes

    def meshes(*overrides: str) -> list[tuple[int, int, int]]:
        cfg = load_config(DEMO, list(overrides), unread=("data.train", "data.val", "sft.data"))
        return [(c.mesh.data, c.mesh.fsdp, c.mesh.tensor) for c in other_meshes(cfg, 4)]

    assert meshes("model.path=m", "mesh.data=4") == [
        (1, 4, 1),
        (2, 2, 1),
        (1, 2, 2),
        (2, 1, 2),
        (1, 1, 4),
    ]
    slots = ["model.path=m", "mesh.data=1", "mesh.tensor=4", "engine.max_concurrent=2"]
    assert meshes(*slots) == [(1, 2, 2), (2, 1, 2)]


def test_the_qwen3_moe_preset_and_its_run_in_the_tpu_plan_bench() -> None:
    """The Qwen3-30B-A3B preset counts the parameters its model card states (30.5B, 29.9B
    without the embedding and the head, 3.3B activated: one decimal, truncated), and the bench's
    run of it (bench/tpu_plan.py; compiling it took 6 minutes on a 2-core host: docs/tpu.md)
    covers the slice's 16 chips and splits the 128 experts over fsdp. On the 8 chips of a
    v5p:2x2x2 even the memory plan, which counts less than the compiled run (65.6 against 98.4
    GiB per chip on the bench's slice with 8192-token rows: the MoE update's temporaries), is
    over the HBM without the KL reference."""
    from jax_agent_rl.plan import preset_model

    spec = importlib.util.spec_from_file_location("bench_tpu_plan", ROOT / "bench" / "tpu_plan.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    name, topology, overrides = bench.RUNS["30b-a3b-v5p"]
    model = preset_model(name)
    embedding = model.vocab_size * model.hidden_size
    assert int(model.num_params / 1e8) == 305
    assert int((model.num_params - 2 * embedding) / 1e8) == 299
    assert int(model.active_params / 1e8) == 33
    assert (model.num_experts, model.num_experts_per_tok, model.num_kv_heads) == (128, 8, 4)
    unread = ("data.train", "data.val", "sft.data", "model.path")
    cfg = load_config(GSM8K, overrides, unread=unread)
    slice_ = parse_topology(topology)
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == slice_.chips == 16
    assert model.num_experts % cfg.mesh.fsdp == 0
    smaller = ["mesh.fsdp=2", "mesh.tensor=4", "algorithm.kl_coef=0"]
    assert plan_memory(load_config(GSM8K, smaller, unread=unread), model).peak_bytes > (
        parse_topology("v5p:2x2x2").chip.hbm_bytes
    )


def test_an_out_of_memory_compile_is_read_for_what_it_needs() -> None:
    """XLA:TPU says how much a program that does not fit needs in two ways: the whole ("Used
    20.1G of 15.7G hbm") or its temporaries alone, to which the arguments add (a floor). Both
    become the verdict and the LoRA table's cell; another compiler error is named as is."""
    from jax_agent_rl.plan import Compiled, Plan

    slice_, gib = parse_topology("v5e:2x4"), 2**30
    temps = (
        "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries (23.47G) exceeds available HBM (15.75G)."
    )
    floor = Compiled("rl_update", "", error=temps, arguments=int(14.25 * gib))
    assert floor.needs == ((14.25 + 23.47) * gib, False)
    assert Plan(slice_, (1, 2, 4), [floor]).verdict() == (
        False,
        "does not fit: rl_update needs at least 37.7 GiB per chip of 16 (over by at least 21.7)",
    )
    used = Compiled("step", "", error="XlaRuntimeError: Ran out of memory. Used 20.1G of 15.7G hbm")
    assert used.needs == (20.1 * gib, True)
    assert Plan(slice_, (1, 2, 4), [used]).verdict()[1].startswith("does not fit: step needs 20.1 ")
    assert Compiled("step", "", error="ValueError: bad").needs is None


def test_a_run_that_does_not_fit_is_told_the_setting_that_does(
    tiny: tuple[Path, list[str]],
) -> None:
    """The tiny run with a KV cache of 32 GiB over the 4 chips (8 per chip, and the engine's
    programs' temporaries more: it does not fit): the search tries the run's memory settings on
    its mesh before other meshes, least change first: rows halved is skipped uncompiled (its
    floor: the engine's 8 GiB of arguments and its step's 9.4 of temporaries, which rows
    do not change), then the KV cache halved (only the engine's step and decode compile
    again), which fits; each plan says how far its compiles are."""
    done = jarl_plan(str(DEMO), *tiny[1], "engine.kv_cache_gib=32", "--topology", "v5e:2x2")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(
        r"does not fit: .*; engine\.kv_cache_gib=16 \(mesh\.data=4 mesh\.fsdp=1 "
        r"mesh\.tensor=1\) fits: 1[0-5]\.\d GiB per chip",
        lines[-1],
    ), lines[-1]
    planned = [line for line in lines if line.startswith(("# planning ", "# skipping "))]
    assert planned == [
        "# skipping learner.row_tokens=128 (mesh.data=4 mesh.fsdp=1 mesh.tensor=1): it needs "
        "at least 17.4 GiB per chip of 16",
        "# planning engine.kv_cache_gib=16 (mesh.data=4 mesh.fsdp=1 mesh.tensor=1)",
    ]
    # the smaller cache compiles the engine's step and decode again, nothing else
    reused = [line for line in lines if line.endswith("programs compiled, the rest reused")]
    assert reused == ["#   2 of 5 programs compiled, the rest reused"]
    assert "compiling the run's programs for v5e:2x2: started" in lines


def test_the_verdict_names_the_runs_peak_as_the_runs() -> None:
    """Every program fits alone, the run does not: its resident state (the learner's, the
    engine's) plus the largest program's extra. The verdict says the run needs it, and of
    what (it said "rl_update needs 19.1 GiB" of a program whose own line said 12.33)."""
    gib = 2**30
    programs = [
        Compiled(
            "rl_update", "w", arguments=6 * gib, temps=6 * gib, outputs=6 * gib, aliased=6 * gib
        ),
        Compiled("step", "w", arguments=7 * gib, temps=1 * gib, outputs=7 * gib, aliased=7 * gib),
    ]
    plan = Plan(parse_topology("v5e:2x2"), (4, 1, 1), programs)
    assert plan.verdict() == (
        False,
        "does not fit: the run needs 19.0 GiB per chip of 16 (over by 3.0) (resident 13.0 + "
        "rl_update's temporaries and outputs 6.0)",
    )


def test_a_gemma3_run_compiles_for_a_tpu_and_fits(tmp_path: Path) -> None:
    """Gemma 3 through the same programs (`models.gemma3`: its local layers' windows in the
    RL update, the ragged step and decode; the decode kernel for its global layers only): the
    demo's run with the demo-sized Gemma 3 compiles for v5e:2x2 and fits."""
    from jax_agent_rl.models.hf_local import DEMO_GEMMA3

    (tmp_path / "config.json").write_text(
        json.dumps({**DEMO_GEMMA3, "vocab_size": CHECKPOINTS["tiny"][1]})
    )
    done = jarl_plan(str(DEMO), *TINY_RUN, f"model.path={tmp_path}", "--topology", "v5e:2x2")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(
        r"fits: [\d.]+ GiB per chip of 16 on v5e:2x2 \(mesh data=4 fsdp=1 tensor=1\)", lines[-1]
    )
    assert all(
        any(line.startswith(f"{name}: ") for line in lines)
        for name in ("rl_update", "sft_step", "weight_push", "step", "decode")
    )
