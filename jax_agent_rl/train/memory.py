"""What a run keeps on each device (`memory_plan`, printed by ``jarl train --dry-run``): the
learner's state and the embedded engine's weights and KV cache, laid out as `ShardingRules`
lays them, and the activations of one micro-batch (`activation_bytes`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from jax_agent_rl.config import JarlConfig, MeshSection
from jax_agent_rl.engine import page_bytes, pool_pages
from jax_agent_rl.models import ModelConfig, ShardingRules, param_specs
from jax_agent_rl.models.decoder import is_spec
from jax_agent_rl.models.paged import PAGE_AXES


def _parts(logical_axes: Sequence[str | None], mesh: MeshSection) -> int:
    """Into how many shards `ShardingRules` splits an array with ``logical_axes`` over ``mesh``."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    parts = 1
    for axes in ShardingRules().spec(logical_axes):
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            parts *= sizes[axis]
    return parts


def _per_device_bytes(model: ModelConfig, mesh: MeshSection, bytes_per_value: int) -> float:
    """Bytes of one copy of the parameters on the busiest device when laid out by
    `ShardingRules` over ``mesh`` (each tensor divided by the mesh axes that shard it)."""
    return sum(
        math.prod(spec.shape) * bytes_per_value / _parts(spec.logical_axes, mesh)
        for spec in jax.tree.leaves(param_specs(model), is_leaf=is_spec)
    )


def memory_plan(cfg: JarlConfig, model: ModelConfig, processes: int = 1) -> list[str]:
    """What the run keeps on each device of its mesh, one line a part, for ``--dry-run``:
    the learner's state (fp32 master weights, AdamW's two fp32 moments, the KL reference, the
    critic), sharded by the parameters' logical axes; and the embedded engine's weights and KV
    cache on the same devices, laid out on the inference mesh (``fsdp`` folded into ``data``:
    weights split over ``tensor`` only, KV pages over ``data x fsdp`` and kv heads over
    ``tensor``). Then the activations of one micro-batch (`activation_bytes`: its tokens per
    device, with and without ``learner.remat``); XLA's workspace comes on top. Over several
    ``processes``, each serves its own ``rollout.max_concurrent`` slots on its share of the
    devices."""
    m = cfg.mesh
    n = m.data * m.fsdp * m.tensor
    fp32 = _per_device_bytes(model, m, 4)
    parts = [
        ("policy weights (fp32 master)", fp32),
        ("AdamW moments (2 x fp32)", 2 * fp32),
        ("gradient accumulator (fp32)", fp32),
    ]
    if cfg.algorithm.kl_coef:
        parts.append(("KL reference (fp32)", fp32))
    if cfg.algorithm.adv_estimator == "gae":
        parts.append(("critic weights + AdamW moments", 3 * fp32))
    learner = sum(b for _, b in parts)
    lines = [f"memory per device, mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} ({n}):"]
    lines += [f"  learner  {name:<34} {b / 2**30:8.2f} GiB" for name, b in parts]
    engine: list[tuple[str, float]] = []
    if cfg.rollout.backend == "embedded":
        serving = MeshSection(data=m.data * m.fsdp // processes, fsdp=1, tensor=m.tensor)
        width = 2 if cfg.model.dtype == "bfloat16" else 4
        r = cfg.rollout
        pages = pool_pages(
            model, r.page_size, width, r.kv_cache_gib, r.max_concurrent, r.max_model_len
        )
        kv = pages * page_bytes(model, r.page_size, width)
        engine = [
            (f"weights ({cfg.model.dtype})", _per_device_bytes(model, serving, width)),
            (
                f"KV cache ({pages} pages x {r.page_size}"
                + (", per process)" if processes > 1 else ")"),
                kv / _parts(PAGE_AXES, serving),
            ),
        ]
        lines += [f"  engine   {name:<34} {b / 2**30:8.2f} GiB" for name, b in engine]
    busiest = learner + sum(b for _, b in engine)
    lines.append(f"  total per device: {busiest / 2**30:.2f} GiB, before activations")
    L = cfg.learner
    if L.packing:
        tokens, what = L.row_tokens, f"learner.row_tokens={L.row_tokens}"
    else:
        rows = max(L.micro_batch_size // (m.data * m.fsdp), 1)
        tokens = rows * cfg.rollout.max_model_len
        what = f"{rows} row(s) of rollout.max_model_len={cfg.rollout.max_model_len}"
    width = 2 if cfg.model.dtype == "bfloat16" else 4
    chosen, other = (True, False) if L.remat else (False, True)
    lines.append(
        f"  activations per micro-batch ({tokens} tokens per device: {what}): "
        f"{activation_bytes(model, tokens, width, chosen, m.tensor) / 2**30:.2f} GiB"
        f" (with remat={str(other).lower()}: "
        f"{activation_bytes(model, tokens, width, other, m.tensor) / 2**30:.2f} GiB)"
    )
    return lines


def activation_bytes(
    model: ModelConfig, tokens: int, width: int, remat: bool, tensor: int = 1
) -> float:
    """About what one micro-batch of ``tokens`` tokens keeps for its backward pass, per device.
    Per layer and token, the values a layer's backward reads again: the residual and the two
    norms (in and out), q / k / v before and after rotary embedding and in the attention's
    layout, the attention output both ways, the MLP's gate, up, activation and product:
    ``5 D + 5 H K + 5 G K + 4 F`` in the compute dtype, heads and F split over ``tensor``; with
    remat only each layer's input (D) plus one layer's set, recomputed in turn. On top: the
    head's fp32 logits (its vocabulary chunks are all kept for the backward), 4 V per token.
    XLA:CPU's own plan for the small test model (with the gradient it returns) is within 2x
    of this (`tests/train/test_check.py`); a TPU's fuses more."""
    D, F, K = model.hidden_size, model.intermediate_size, model.head_dim
    H, G = model.num_heads / tensor, max(model.num_kv_heads / tensor, 1)
    per_layer = width * (5 * D + 5 * H * K + 5 * G * K + 4 * F / tensor)
    kept = model.num_layers * (width * D if remat else per_layer) + (per_layer if remat else 0)
    logits = 4 * model.vocab_size / tensor
    return tokens * (kept + logits)
