"""Logical axes -> mesh axes: the one table that decides how models are laid out on devices.

Model code names every dimension with a logical axis ("embed", "heads", "batch", ...). The
`ShardingRules` table maps each logical axis to zero, one or several mesh axes of a 3-axis mesh
(``data``, ``fsdp``, ``tensor``). Translating a logical shape raises if one mesh axis would shard
two dimensions of the same array, or if a dimension does not divide evenly over its mesh axes:
layouts are never silently dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes shard each logical axis. ``None`` replicates the dimension."""

    # activations
    batch: MeshAxes = ("data", "fsdp")
    seq: MeshAxes = None
    act_embed: MeshAxes = None
    act_heads: MeshAxes = "tensor"
    act_mlp: MeshAxes = "tensor"
    act_vocab: MeshAxes = "tensor"
    cache_seq: MeshAxes = None
    # parameters
    layers: MeshAxes = None
    vocab: MeshAxes = "tensor"
    embed: MeshAxes = "fsdp"
    heads: MeshAxes = "tensor"
    kv_heads: MeshAxes = "tensor"
    head_dim: MeshAxes = None
    lora_rank: MeshAxes = None  # a LoRA adapter's rank r (tens): never split
    mlp: MeshAxes = "tensor"
    # Qwen3-MoE: experts split over fsdp (each device holds E / fsdp experts, their M split
    # over tensor); an expert's D is not split, as fsdp already splits E
    experts: MeshAxes = "fsdp"
    expert_embed: MeshAxes = None
    expert_mlp: MeshAxes = "tensor"

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array whose dimensions carry ``logical_axes``."""
        names = {f.name for f in dataclasses.fields(self)}
        spec: list[MeshAxes] = []
        used: dict[str, str] = {}
        for axis in logical_axes:
            if axis is None:
                spec.append(None)
                continue
            if axis not in names:
                raise KeyError(f"unknown logical axis {axis!r} (known: {sorted(names)})")
            mesh_axes = getattr(self, axis)
            for m in (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ():
                if m in used:
                    raise ValueError(
                        f"mesh axis {m!r} shards both {used[m]!r} and {axis!r} "
                        f"in {tuple(logical_axes)}"
                    )
                used[m] = axis
            spec.append(mesh_axes)
        return PartitionSpec(*spec)

    def sharding(
        self, mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
    ) -> NamedSharding:
        """NamedSharding on ``mesh``; with ``shape``, checks each dimension divides evenly."""
        spec = self.spec(logical_axes)
        if shape is not None:
            for dim, axis, mesh_axes in zip(shape, logical_axes, spec, strict=True):
                if mesh_axes is None:
                    continue
                parts = math.prod(
                    mesh.shape[m]
                    for m in ((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes)
                )
                if dim % parts:
                    raise ValueError(
                        f"dimension {axis!r} of size {dim} does not divide over mesh axes "
                        f"{mesh_axes} ({parts} devices) for shape {tuple(shape)}"
                    )
        return NamedSharding(mesh, spec)


def request_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices (one thread each), so a ``data=n`` mesh runs data-parallel on
    a multi-core host without accelerators. Only possible before JAX's first operation; after
    it, the devices are what they are and `make_mesh` checks the count. No effect on TPU/GPU
    backends, whose devices are the accelerators."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", max(n, 1))


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (default: all), their count checked."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * fsdp * tensor
    if n != len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {n} devices, "
            f"have {len(devices)}"
        )
    grid = np.array(devices, dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def one_device_sharder() -> Sharder:
    """A `Sharder` over a one-device mesh of this process's first device: where no mesh is
    configured (a test, a bench, a Ray replica), the code runs the same layouts as on a pod,
    each of them whole on that device."""
    return Sharder(make_mesh(devices=jax.local_devices()[:1]))


def inference_mesh(mesh: Mesh) -> Mesh:
    """The same devices as ``mesh`` with ``fsdp`` folded into ``data``, for serving: every
    ``tensor`` group holds whole weights (no all-gather of parameters per decoded token) and
    the decode slots split over ``data x fsdp`` devices."""
    data, fsdp, tensor = (mesh.shape[a] for a in MESH_AXES)
    return make_mesh(data * fsdp, 1, tensor, devices=list(mesh.devices.flat))


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh plus its rules: lays out arrays and constrains activations inside jit."""

    mesh: Mesh
    rules: ShardingRules = ShardingRules()

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.rules.sharding(self.mesh, logical_axes))

    def sharding(
        self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
    ) -> NamedSharding:
        return self.rules.sharding(self.mesh, logical_axes, shape)

    def shards(self, logical_axis: str) -> int:
        """Into how many parts ``logical_axis`` splits."""
        return math.prod(self.mesh.shape[m] for m in self._mesh_axes(logical_axis))

    def shard_index(self, logical_axis: str) -> jax.Array:
        """Inside ``jax.shard_map`` over this mesh: which part of ``logical_axis`` this
        device holds (0 .. shards - 1, in the order a NamedSharding lays the parts out)."""
        names = self._mesh_axes(logical_axis)
        return jax.lax.axis_index(names) if names else jnp.int32(0)

    def _mesh_axes(self, logical_axis: str) -> tuple[str, ...]:
        axes = self.rules.spec((logical_axis,))[0]
        return (axes,) if isinstance(axes, str) else tuple(axes or ())
