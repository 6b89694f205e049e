"""How a run's processes, mesh and settings fit the devices and the model (`train.check`'s
part that reads only the config and the model's ``config.json``)."""

from __future__ import annotations

import math

import jax

from jax_agent_rl.config import JarlConfig, MeshSection
from jax_agent_rl.models import (
    DecoderPolicy,
    Gemma3Policy,
    ModelConfig,
    Policy,
    ShardingRules,
    policy_of,
)
from jax_agent_rl.models.decoder import is_spec

# the ModelConfig field behind each logical axis a mesh axis may shard
_MODEL_FIELDS = {
    "vocab": "vocab_size",
    "embed": "hidden_size",
    "mlp": "intermediate_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "layers": "num_layers",
    "experts": "num_experts",
    "expert_mlp": "moe_intermediate_size",
}
# the mesh axis to grow when this one must shrink (the device count stays)
_TRADE = {"tensor": "fsdp", "fsdp": "data"}


def processes_fit(cfg: JarlConfig, processes: int) -> list[str]:
    """A multi-process run splits each step's prompts, and each micro-batch's rows (the
    mesh's data x fsdp devices), evenly over the processes; it trains synchronously, on its
    processes' own engines, and pushes whole weights."""
    if processes == 1:
        return []
    problems = []
    if cfg.trainer.max_staleness:
        problems.append(
            f"trainer.max_staleness={cfg.trainer.max_staleness} (asynchronous) runs in one "
            f"process; {processes} processes train synchronously (trainer.max_staleness=0)"
        )
    if cfg.engine.ray.address:
        problems.append(
            f"engine.ray.address={cfg.engine.ray.address!r} serves one process's rollouts; "
            f"{processes} processes each roll out on their own engines (engine.ray.address=)"
        )
    if cfg.engine.push.full_every > 1:
        problems.append(
            f"engine.push.full_every={cfg.engine.push.full_every}: delta pushes run in one "
            "process (the kept copy of the served weights sits on one of its devices); "
            f"{processes} processes push whole (engine.push.full_every=1)"
        )
    prompts = cfg.data.prompts_per_step
    if prompts % processes:
        problems.append(
            f"data.prompts_per_step={prompts} does not split over {processes} processes: "
            f"use a multiple of {processes}"
        )
    dp = cfg.mesh.data * cfg.mesh.fsdp
    if dp % processes:
        problems.append(
            f"mesh.data x mesh.fsdp = {dp} devices do not split over {processes} processes "
            "(each holds whole tensor groups and a share of every micro-batch): use a multiple "
            f"of {processes}"
        )
    return problems


def spans_every_device(cfg: JarlConfig, processes: int, devices: int) -> list[str]:
    m = cfg.mesh
    n = m.data * m.fsdp * m.tensor
    if processes == 1 or n >= devices:  # more than there are: `mesh_problems` says so
        return []
    return [
        f"mesh.data={m.data} x mesh.fsdp={m.fsdp} x mesh.tensor={m.tensor} = {n} devices, but "
        f"the {processes} processes have {devices}: a multi-process mesh spans every device"
    ]


def model_fit(cfg: JarlConfig, policy: ModelConfig | Policy, devices: int) -> list[str]:
    """How the run's settings fit the model (a checkpoint's config, or a custom policy): the
    context length, then the mesh."""
    model = policy_of(policy).cfg
    problems = []
    coef = cfg.algorithm.router_aux_loss_coef
    if coef and not any(model.moe_layers):
        problems.append(
            f"algorithm.router_aux_loss_coef={coef}: the {model.family} model has no "
            "mixture-of-experts layers, so no router to balance: use 0"
        )
    limit = model.max_position_embeddings
    if cfg.engine.max_model_len > limit:
        problems.append(
            f"engine.max_model_len={cfg.engine.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}: use engine.max_model_len <= {limit}"
        )
    return problems + mesh_problems(cfg.mesh, policy, devices)


def mesh_problems(mesh: MeshSection, model: ModelConfig | Policy, devices: int) -> list[str]:
    """The mesh against the run's ``devices`` (every process's), and against every parameter
    dimension a mesh axis shards (by `ShardingRules`, the table the learner lays weights out
    with), each problem with the axis sizes that would divide all of that axis's dimensions."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    n = math.prod(sizes.values())
    problems = []
    if n > devices:
        problems.append(
            f"mesh.data={mesh.data} x mesh.fsdp={mesh.fsdp} x mesh.tensor={mesh.tensor} needs "
            f"{n} devices, the run has {devices}: make the product at most {devices}"
        )
    for axis, dims in _sharded_dims(model).items():
        common = math.gcd(*dims.values())
        fits = ", ".join(str(v) for v in range(1, common + 1) if common % v == 0)
        hint = f" (and more {_TRADE[axis]})" if axis in _TRADE else ""
        problems += [
            f"mesh.{axis}={sizes[axis]} does not divide {_dimension(model, logical, size)}: "
            f"use mesh.{axis} in {{{fits}}}{hint}"
            for logical, size in dims.items()
            if size % sizes[axis]
        ]
    return problems


def _dimension(model: ModelConfig | Policy, logical: str, size: int) -> str:
    """A sharded dimension as the user knows it: a decoder's config field, a custom policy's
    logical axis (its sizes are its module's, not the config's fields)."""
    family = isinstance(policy_of(model), DecoderPolicy | Gemma3Policy)
    if not family or logical not in _MODEL_FIELDS:
        return f"the policy's {logical!r} dimension ({size})"
    return f"model {_MODEL_FIELDS[logical]}={size}"


def _sharded_dims(model: ModelConfig | Policy) -> dict[str, dict[str, int]]:
    """Mesh axis -> the parameter dimensions it shards (logical axis -> size)."""
    rules = ShardingRules()
    out: dict[str, dict[str, int]] = {}
    for spec in jax.tree.leaves(policy_of(model).specs(), is_leaf=is_spec):
        for logical, size in zip(spec.logical_axes, spec.shape, strict=True):
            if logical is None:  # (a custom policy's dimension that no mesh axis splits)
                continue
            axes = getattr(rules, logical)
            for axis in (axes,) if isinstance(axes, str) else axes or ():
                out.setdefault(axis, {})[logical] = size
    return out
