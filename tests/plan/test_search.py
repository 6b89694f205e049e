"""``jarl plan``'s search for a setting that fits, over planted plans: the order it tries
settings and meshes in, what it skips uncompiled by a floor, and that a fit needing another
mesh *and* less memory per chip is found. (The compiles themselves: tests/plan/test_plan.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.cli import plan as cli_plan
from jax_agent_rl.config import JarlConfig, load_config
from jax_agent_rl.plan import parse_topology
from jax_agent_rl.plan.report import Compiled, Plan, least_peak

GIB = 2**30
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_calculator_cpu.yaml"
ROWS, KV = 1024, 4.0
SLICE = parse_topology("v5e:2x2")  # 16 GiB a chip
REQUIRED = ["model.path=/nowhere", "data.train=train.jsonl"]  # (a plan reads neither)


def planted(cfg: JarlConfig) -> Plan:
    """A run's plan by a made-up law: the learner's state is 14 GiB a chip unsplit over
    `tensor` and 6 split over it, its update's temporaries 8 GiB at ``ROWS`` rows and linear
    in rows; the engine's arguments 2 GiB of weights and 4.5 of KV at ``KV`` GiB."""
    rows = cfg.learner.row_tokens / ROWS
    kv = cfg.engine.kv_cache_gib / KV
    state = 14 if cfg.mesh.tensor == 1 else 6
    programs = [
        Compiled("rl_update", "w", arguments=state * GIB, temps=int(8 * rows * GIB)),
        Compiled("step", "w", arguments=int((2 + 4.5 * kv) * GIB), temps=GIB),
    ]
    m = cfg.mesh
    return Plan(SLICE, (m.data, m.fsdp, m.tensor), programs)


@pytest.fixture
def searched(monkeypatch: pytest.MonkeyPatch) -> tuple[JarlConfig, list[str]]:
    """The planted plans stand in for the compiler; the search is the command's own."""
    planned: list[str] = []

    def plan_of(cfg: JarlConfig, *_: Any) -> Plan:
        m = cfg.mesh
        planned.append(f"{m.data}x{m.fsdp}x{m.tensor} {cfg.learner.row_tokens} ")
        planned[-1] += f"{cfg.engine.kv_cache_gib:g}"
        return planted(cfg)

    monkeypatch.setattr(cli_plan, "_planned", plan_of)
    cfg = load_config(
        DEMO,
        [
            *REQUIRED,
            "mesh.data=1",
            "mesh.fsdp=4",
            f"learner.row_tokens={ROWS}",
            f"engine.kv_cache_gib={KV}",
        ],
    )
    return cfg, planned


def test_the_search_finds_a_fit_that_needs_another_mesh_and_less_memory(
    searched: tuple[JarlConfig, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """No setting fits the run's own mesh (its state alone is 14 GiB a chip), nor any mesh as
    configured; on fsdp 2 x tensor 2, rows halved and the KV cache halved together fit (6 +
    4.25 + 4 = 14.25 GiB), and the search names that, after skipping uncompiled every setting
    whose floor is over 16 GiB."""
    cfg, planned = searched
    args = argparse.Namespace()
    said = cli_plan._search(cfg, None, SLICE, args, planted(cfg), {})  # type: ignore[arg-type]
    assert said == (
        "learner.row_tokens=512 engine.kv_cache_gib=2 mesh.data=1 mesh.fsdp=2 mesh.tensor=2 "
        "fits: 14.2 GiB per chip"
    )
    out = capsys.readouterr().out.splitlines()
    # the own mesh: every setting's floor is over the chip (state 14 + engine / cut + ...),
    # but rows and KV both an eighth: 14 + 0.81 + 1 = 15.8, which compiles and does not fit
    own = [line for line in out if "(mesh.data=1 mesh.fsdp=4" in line]
    assert [line.split(":")[0] for line in own if line.startswith("# planning")] == [
        "# planning learner.row_tokens=128 engine.kv_cache_gib=0.5 (mesh.data=1 mesh.fsdp=4 "
        "mesh.tensor=1)"
    ]
    assert len([line for line in own if line.startswith("# skipping")]) == 8
    # the plans made, in order: the own mesh's one setting, then each other mesh as
    # configured (the tensor=1 ones' settings all skipped), until fsdp 2 x tensor 2's
    assert planned == [
        "1x4x1 128 0.5",  # (data x fsdp x tensor, rows, KV GiB)
        "2x2x1 1024 4",
        "2x2x1 128 0.5",
        "4x1x1 1024 4",
        "4x1x1 128 0.5",
        "1x2x2 1024 4",  # 6 + 6.5 + 8: over; rows halved alone: 16.5, its floor says so
        "1x2x2 512 2",
    ]


def test_a_setting_skipped_by_its_floor_could_not_have_fit() -> None:
    """`least_peak` is a floor: under the planted law (temporaries linear in rows, the KV
    part of the engine's arguments linear in its cache) every setting's real peak is at or
    above it."""
    cfg = load_config(DEMO, [*REQUIRED, f"learner.row_tokens={ROWS}", f"engine.kv_cache_gib={KV}"])
    base = planted(cfg)
    for row_cut in (1, 2, 4, 8):
        for kv_cut in (1, 2, 4, 8):
            other = dataclasses.replace(
                cfg,
                learner=dataclasses.replace(cfg.learner, row_tokens=ROWS // row_cut),
                engine=dataclasses.replace(cfg.engine, kv_cache_gib=KV / kv_cut),
            )
            assert least_peak(base, row_cut, kv_cut) <= planted(other).peak[0]
    # what the compiler said a program that did not compile needs does not scale: such a
    # program counts by its arguments alone
    oom = Compiled("step", "w", error="Ran out of memory. Used 40G of 16G hbm", arguments=GIB)
    assert least_peak(Plan(SLICE, (4, 1, 1), [oom]), 1, 2) == GIB / 2


def test_a_program_on_another_mesh_is_not_taken_for_the_same() -> None:
    """The search reuses a compiled program whose key (`program_key`) it has seen: a weight
    split over fsdp 4 and the same weight over data 2 x fsdp 2 have one spec and differ only
    in the mesh's shape (taken for the same, every mesh of a slice got the first's figures)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_agent_rl.plan import Program
    from jax_agent_rl.plan.report import program_key

    devices = np.array(jax.devices()[:4])

    def on(shape: tuple[int, int, int]) -> Program:
        mesh = Mesh(devices.reshape(shape), ("data", "fsdp", "tensor"))
        weight = jax.ShapeDtypeStruct((64, 64), "float32", sharding=NamedSharding(mesh, P("fsdp")))
        return Program("rl_update", jax.jit(lambda w: w), (weight,), {}, 1.0, 1.0, "w")

    assert program_key(on((1, 4, 1))) != program_key(on((2, 2, 1)))
    assert program_key(on((1, 4, 1))) == program_key(on((1, 4, 1)))
