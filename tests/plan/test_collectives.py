"""The RL update compiled for a TPU slice holds only the collectives its mesh implies (FSDP
all-gathers of the weights and reductions of their gradients, tensor all-reduces of
activations: `plan.report.mesh_findings`) and runs splash attention's kernels, checked on the
smallest run that has both mesh axes: the tiny demo model on v5e:2x2 with fsdp 2 x tensor 2,
its vocabulary (16,384) long enough for the head to take two steps of vocabulary chunks per
device, compiled in this process (about a minute on a 2-core host).

The full-size updates (Qwen2.5-1.5B on v5e:2x2, fsdp 2 x tensor 2; Qwen2.5-7B on v5p:2x2x1,
fsdp 4) take 5 to 15 minutes each to compile here, too long for CI: ``bench/tpu_plan.py
--runs 1.5b 7b-v5p`` prints the same findings for them (``mesh_findings``, docs/tpu.md).

Compiled at full optimization (the module is `compute_bound`): the collectives are what
XLA:TPU's passes make of the program, as a user's ``jarl plan`` and a TPU run compile it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_agent_rl.cli.demo import PRESETS as CHECKPOINTS
from jax_agent_rl.config import JarlConfig, load_config
from jax_agent_rl.models import ModelConfig
from jax_agent_rl.plan import parse_topology, run_programs
from jax_agent_rl.plan.report import _compile

pytestmark = pytest.mark.compute_bound

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_calculator_cpu.yaml"


def test_the_rl_update_holds_only_the_collectives_its_mesh_implies(tmp_path: Path) -> None:
    """No all-to-all, no collective-permute inside a loop, all-gathers moving at most twice
    the weights' bytes per pass over a micro-batch (a head gathered whole at each vocabulary
    chunk, as the update did before its chunks were laid out per device, made 5 times here),
    no copy of a stacked weight at every micro-batch; the loops' trip counts all known, every
    collective kind one of the mesh's, and the three splash kernels run."""
    fields, _ = CHECKPOINTS["tiny"]
    config = {**fields, "vocab_size": 16384, "head_dim": 128, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    overrides = [
        f"model.path={tmp_path}",
        "model.dtype=bfloat16",
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "learner.row_tokens=256",
        "learner.remat=true",
    ]
    cfg: JarlConfig = load_config(DEMO, overrides, unread=("data.train", "data.val", "sft.data"))
    slice_ = parse_topology("v5e:2x2")
    _, programs = run_programs(cfg, ModelConfig.from_pretrained(tmp_path), slice_, None)
    update = _compile(programs[0], slice_, None)
    assert update.name == "rl_update" and update.error is None, update.error
    assert update.mesh_findings == (), update.mesh_findings
    assert update.uncounted_loops == 0
    assert {o.kind for o in update.collectives} <= {
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "collective-permute",
    }
    for part in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
        assert any(k.startswith(part) for k in update.kernels), update.kernels
