"""What a run keeps on each device (`plan_memory`; its lines are printed by ``jarl train
--dry-run``, with `fits_here`'s verdict on this process's devices): the learner's state and
the embedded engine's weights and KV cache, laid out as `ShardingRules` lays them, and what the
RL update (one micro-batch's activations: `activation_bytes`) and the weight push add while
they run. ``jarl plan`` holds it to the
figures compiled for TPU (tests/plan)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax

from jax_agent_rl.config import JarlConfig, MeshSection
from jax_agent_rl.engine import page_bytes, pool_pages
from jax_agent_rl.engine.sampling import VOCAB_CHUNK
from jax_agent_rl.models import ModelConfig, Policy, ShardingRules, policy_of
from jax_agent_rl.models.decoder import is_spec
from jax_agent_rl.models.paged import PAGE_AXES
from jax_agent_rl.train.learners import run_model


def _parts(logical_axes: Sequence[str | None], mesh: MeshSection) -> int:
    """Into how many shards `ShardingRules` splits an array with ``logical_axes`` over ``mesh``."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    parts = 1
    for axes in ShardingRules().spec(logical_axes):
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            parts *= sizes[axis]
    return parts


def _per_device_bytes(specs: Any, mesh: MeshSection, bytes_per_value: int) -> float:
    """Bytes of one copy of the parameters ``specs`` declares on the busiest device when laid
    out by `ShardingRules` over ``mesh`` (each tensor divided by the mesh axes that shard it)."""
    return sum(
        math.prod(spec.shape) * bytes_per_value / _parts(spec.logical_axes, mesh)
        for spec in jax.tree.leaves(specs, is_leaf=is_spec)
    )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a run keeps on each device (`plan_memory`), bytes per part: resident between
    programs (the learner's, the engine's), and what the RL update and the weight push need
    on top while they run (one program runs at a time)."""

    mesh: MeshSection
    learner: list[tuple[str, float]]
    engine: list[tuple[str, float]]
    update: list[tuple[str, float]]  # the RL update's temporaries
    push: list[tuple[str, float]]  # the weight push's temporaries and new weights
    other_activations: float  # `update`'s activations with the other remat setting
    tokens: int  # a micro-batch's tokens per device
    what: str  # where those come from
    lora_saved: float = 0.0  # a LoRA run: what training every weight would keep on top

    @property
    def learner_bytes(self) -> float:
        return sum(b for _, b in self.learner)

    @property
    def engine_bytes(self) -> float:
        return sum(b for _, b in self.engine)

    @property
    def peak_bytes(self) -> float:
        """Everything resident, and the larger of what the update and the push add."""
        adds = (sum(b for _, b in self.update), sum(b for _, b in self.push))
        return self.learner_bytes + self.engine_bytes + max(adds)

    def lines(self, remat: bool) -> list[str]:
        m = self.mesh
        n = m.data * m.fsdp * m.tensor
        gib = 2**30
        lines = [
            f"memory per device, mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} ({n}):"
        ]
        for part, items in (("learner", self.learner), ("engine", self.engine)):
            lines += [f"  {part:<8} {name:<34} {b / gib:8.2f} GiB" for name, b in items]
        resident = self.learner_bytes + self.engine_bytes
        lines.append(f"  total per device: {resident / gib:.2f} GiB, between programs")
        for part, items in (("update", self.update), ("push", self.push)):
            lines += [f"  {part:<8} {name:<34} {b / gib:8.2f} GiB" for name, b in items]
        lines.append(
            f"  peak per device: {self.peak_bytes / gib:.2f} GiB (the update's activations: "
            f"{self.tokens} tokens per device, {self.what}; with remat={str(not remat).lower()}: "
            f"{self.other_activations / gib:.2f} GiB); XLA's workspace comes on top"
        )
        if self.lora_saved:
            lines.append(
                f"  LoRA saves {self.lora_saved / gib:.2f} GiB per device against training "
                "every weight: the frozen base has no gradient, no AdamW moments and no KL "
                "reference copy"
            )
        return lines


def _device_memory(devices: Sequence[jax.Device]) -> tuple[float, str] | None:
    """The bytes one of ``devices`` (this process's) can hold, and what they are, or None where
    the platform does not say: CPU devices share the host's memory (each its share); an
    accelerator's allocator states its limit."""
    gib = 2**30
    if devices[0].platform == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        said = f"this host's {host / gib:.1f} GiB over {len(devices)} CPU devices"
        return host / len(devices), said
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        return None
    return float(limit), f"{devices[0].device_kind}'s {limit / gib:.1f} GiB"


def fits_here(plan: MemoryPlan, devices: Sequence[jax.Device]) -> str | None:
    """Why ``plan`` cannot run on ``devices`` (its peak, a lower bound: XLA's workspace comes
    on top, is more than each can hold), or None."""
    have = _device_memory(devices)
    if have is None or plan.peak_bytes <= have[0]:
        return None
    return (
        f"does not fit here: a peak of {plan.peak_bytes / 2**30:.4g} GiB per device, and "
        f"{have[1]} leave each {have[0] / 2**30:.4g} GiB (`jarl plan` compiles a run for a TPU "
        "slice)"
    )


def plan_memory(cfg: JarlConfig, model: ModelConfig | Policy, processes: int = 1) -> MemoryPlan:
    """What the run keeps on each device of its mesh between programs: the learner's state
    (fp32 master weights, AdamW's two fp32 moments, the KL reference, the critic), sharded by
    the parameters' logical axes; the embedded engine's weights (in the serving layout: a tied
    embedding's head is a copy of its own) and KV cache on the same devices, laid out on the
    inference mesh (``fsdp`` folded into ``data``: weights split over ``tensor`` only, KV
    pages over ``data x fsdp`` and kv heads over ``tensor``). Then what each of the two
    largest programs adds while it runs: the RL update (the gradient accumulator, in bf16 a
    copy of the weights and the micro-batch's gradient, one micro-batch's activations:
    `activation_bytes`, with and without ``learner.remat``) and the weight push (the weights
    gathered for serving; the new serving weights beside the old ones when staged, else in
    their place: ``engine.push.staged``). These are the parts
    XLA's memory analysis of the compiled programs shows on TPU (`jax_agent_rl.plan`). Over
    several ``processes``, each serves its own ``engine.max_concurrent`` slots on its share
    of the devices. ``model``: a checkpoint's (``model.lora``'s adapters added here), or a
    custom policy."""
    m = cfg.mesh
    policy = policy_of(run_model(cfg, model)) if isinstance(model, ModelConfig) else model
    model, specs = policy.cfg, policy.specs()
    base = _per_device_bytes(policy.base(specs), m, 4)
    fp32 = _per_device_bytes(specs, m, 4)
    trained = fp32 - base if model.lora is not None else fp32  # what gets gradients
    width = 2 if cfg.model.dtype == "bfloat16" else 4
    if model.lora is None:
        learner = [("policy weights (fp32 master)", fp32)]
    else:  # the KL reference is the base itself (`rl.update.reference_of`); computing in
        # bf16, the base is held so (`rl.learner.master_weights`)
        held = f"base weights ({'bf16' if width == 2 else 'fp32'}, frozen)"
        learner = [(held, base * width / 4), ("LoRA adapters (fp32)", trained)]
    learner.append(("AdamW moments (2 x fp32)", 2 * trained))
    if cfg.algorithm.kl_coef and model.lora is None:
        learner.append(("KL reference (fp32)", fp32))
    if cfg.algorithm.adv_estimator == "gae":
        learner.append(("critic weights + AdamW moments", 3 * fp32))
    L = cfg.learner
    if L.packing:
        tokens, what = L.row_tokens, f"learner.row_tokens={L.row_tokens}"
    else:
        rows = max(L.micro_batch_size // (m.data * m.fsdp), 1)
        tokens = rows * cfg.engine.max_model_len
        what = f"{rows} row(s) of engine.max_model_len={cfg.engine.max_model_len}"
    # the update: the gradient summed over micro-batches and one micro-batch's activations;
    # computing in bf16, also the weights cast (a copy) and each micro-batch's fp32 gradient
    # through that cast, which XLA cannot add into the sum in place as it does in fp32 (TPU,
    # compiled: tests/plan)
    update = [("gradient accumulator (fp32)", trained)]
    if width == 2:
        update += [
            ("micro-batch gradient (fp32)", trained),
            ("weights in bfloat16 (a copy)", (fp32 if model.lora is None else trained) / 2),
        ]
    update.append(
        (
            f"activations ({'remat' if L.remat else 'no remat'})",
            activation_bytes(model, tokens, width, L.remat, m.tensor),
        )
    )
    engine: list[tuple[str, float]] = []
    push: list[tuple[str, float]] = []
    if cfg.engine.backend == "embedded":
        serving = MeshSection(data=m.data * m.fsdp // processes, fsdp=1, tensor=m.tensor)
        r = cfg.engine
        pages = pool_pages(
            model, r.page_size, width, r.kv_cache_gib, r.max_concurrent, r.max_model_len
        )
        kv = pages * page_bytes(model, r.page_size, width)
        gathered = _per_device_bytes(specs, serving, width)
        weights = gathered
        if model.tie_embeddings:  # the serving layout's head [D, V], vocab over tensor
            weights += model.hidden_size * model.vocab_size * width / m.tensor
        engine = [
            (f"weights ({cfg.model.dtype})", weights),
            (
                f"KV cache ({pages} pages x {r.page_size}"
                + (", per process)" if processes > 1 else ")"),
                kv / _parts(PAGE_AXES, serving),
            ),
        ]
        # the push: the learner's weights cast and gathered onto the inference mesh (a new
        # buffer unless they are laid out and typed so already), then laid out for serving:
        # staged, beside the old ones (`engine.push.staged`); else in their place, the old
        # dropped first
        if model.lora is not None:  # a LoRA push: the adapters alone, onto the base held
            base_served = _per_device_bytes(policy.base(specs), serving, width)
            push = [("adapters gathered for serving", gathered - base_served)]
        elif m.fsdp > 1 or width != 4:
            push = [("weights gathered for serving", gathered)]
        if model.lora is None and r.push.staged:
            push.append(("new weights staged beside the old (engine.push.staged)", weights))
    return MemoryPlan(
        m,
        learner,
        engine,
        update,
        push,
        activation_bytes(model, tokens, width, not L.remat, m.tensor),
        tokens,
        what,
        _lora_saved(model, base, trained, width == 2, bool(cfg.algorithm.kl_coef)),
    )


def _lora_saved(model: ModelConfig, base: float, adapters: float, bf16: bool, kl: bool) -> float:
    """Bytes per device that training every weight of the base (its fp32 weights, AdamW's two
    moments, the gradient accumulator; in bf16 a micro-batch's gradient and the weights cast;
    a KL reference copy) keeps beyond a LoRA run (the frozen base, in bf16 when computing so,
    then the same parts for the adapters)."""
    if model.lora is None:
        return 0.0
    per_trained = 4 + 1.5 * bf16  # weights, 2 moments, accumulator (+ gradient, bf16 copy)
    frozen = base / 2 if bf16 else base
    return base * (per_trained + kl) - (frozen + adapters * per_trained)


def activation_bytes(
    model: ModelConfig, tokens: int, width: int, remat: bool, tensor: int = 1
) -> float:
    """About what one micro-batch of ``tokens`` tokens keeps for its backward pass, per device.
    Per layer and token, the values a layer's backward reads again: the residual and the two
    norms (in and out), q / k / v before and after rotary embedding and in the attention's
    layout, the attention output both ways, the MLP's gate, up, activation and product:
    ``5 D + 5 H K + 5 G K + 4 F`` in the compute dtype, heads and F split over ``tensor``; with
    remat only each layer's input (D) plus one layer's set, recomputed in turn. On top: the
    head's fp32 logits of one vocabulary chunk at a time and their gradient, 8 C per token
    (C = min(V, `VOCAB_CHUNK`): `head_logprobs` keeps no logits for its backward, it
    computes each chunk's again). XLA:CPU's own plan for the small test model (with the
    gradient it returns) is within 2x of this (`tests/train/test_check.py`); a TPU's fuses
    more."""
    D, F, K = model.hidden_size, model.intermediate_size, model.head_dim
    H, G = model.num_heads / tensor, max(model.num_kv_heads / tensor, 1)
    per_layer = width * (5 * D + 5 * H * K + 5 * G * K + 4 * F / tensor)
    kept = model.num_layers * (width * D if remat else per_layer) + (per_layer if remat else 0)
    logits = 8 * min(model.vocab_size / tensor, VOCAB_CHUNK)
    return tokens * (kept + logits)
