"""``jarl plan``: a run's programs compiled for a Cloud TPU slice on a CPU-only host (libtpu
compiles for abstract devices of the slice), with their HBM per chip and a compiler estimate
of their time.

Modules: `topology` (slices by name, chips' HBM and peak FLOP/s), `presets` (model shapes by
name), `programs` (the trainer's programs with abstract arguments), `hlo` (a compiled
program's FLOPs, HBM bytes and collectives, read from its text with its loops' trip counts),
`report` (compiling them, the estimate, the report and the verdict; a LoRA run's beside the
same run training every weight).
"""

from jax_agent_rl.plan.presets import PRESETS, preset_model
from jax_agent_rl.plan.programs import Program, Workload, run_programs
from jax_agent_rl.plan.report import (
    Compiled,
    Plan,
    beside,
    full_parameter,
    other_meshes,
    plan_run,
)
from jax_agent_rl.plan.topology import Topology, accepted_topologies, parse_topology

__all__ = [
    "PRESETS",
    "Compiled",
    "Plan",
    "Program",
    "Topology",
    "Workload",
    "accepted_topologies",
    "beside",
    "full_parameter",
    "other_meshes",
    "parse_topology",
    "plan_run",
    "preset_model",
    "run_programs",
]
