"""A run's device programs, assembled abstractly: the trainer's own jitted functions (the RL
update, the SFT step, the engine's ragged step, the learner-to-engine weight push) with
their arguments as `jax.ShapeDtypeStruct`s laid out on a mesh of a TPU slice's abstract devices,
ready to lower and compile for it. Nothing is allocated and no weights are read. A LoRA run's
(``model.lora``) are its own: the learner trains the adapters alone (its optimizer state is
theirs, its frozen base in bfloat16 when computing so), the engine runs them unmerged, and the
push sends them alone.

Each program carries the FLOPs per device its configured workload runs (`Workload`), computed
analytically (the model's FLOPs, for MFU), and what a reader of its compiled text
(`plan.hlo.count`) cannot know: the trip counts of the loops only the device counts (the
learner's loops over the real micro-batches, by their named scopes) and the FLOPs and bytes of
its Pallas kernels (`kernel_costs`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_agent_rl.config import JarlConfig
from jax_agent_rl.engine.programs import abstract_programs
from jax_agent_rl.models import (
    ModelConfig,
    Sharder,
    abstract_policy,
    inference_mesh,
    make_mesh,
    policy_of,
)
from jax_agent_rl.models.adapters import adapters_of, serving_adapters
from jax_agent_rl.models.decoder import ATTN_BLOCK
from jax_agent_rl.plan.hlo import KernelCost, arrays, nbytes
from jax_agent_rl.plan.topology import Topology
from jax_agent_rl.rl.batch import TrainBatch, padded_length
from jax_agent_rl.rl.learner import StepPrograms, abstract_learner_state, jit_step
from jax_agent_rl.rl.objectives import cast_floats
from jax_agent_rl.rl.update import (
    ALL_MICRO_BATCHES,
    MICRO_BATCHES,
    RLBatch,
    TrainState,
    trainable,
)
from jax_agent_rl.rollout.registry import make_engine
from jax_agent_rl.train.learners import (
    learner_settings,
    micro_batch_rows,
    run_model,
    sft_micro_batch_rows,
)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: ``fn`` (jitted) of ``args`` with static ``static``; ``flops``
    per device of its configured workload (``model_flops``: without remat's recomputation),
    ``workload`` saying what that is. A training step's ``trained`` parameters (what its
    optimizer updates) and its ``optimizer`` state's bytes per device; ``replaces``: its
    outputs take the place of resident buffers dropped before it runs. ``trips``: the trip
    count of each loop the compiler cannot count, by named scope; ``kernels``: its Pallas
    kernels' FLOPs and bytes (`kernel_costs`)."""

    name: str
    fn: Any  # jitted: `.lower(*args, **static)`
    args: tuple[Any, ...]
    static: dict[str, Any]
    flops: float
    model_flops: float
    workload: str
    trained: int = 0
    optimizer: int = 0
    replaces: bool = False
    trips: dict[str, int] = dataclasses.field(default_factory=dict)
    kernels: KernelCost | None = None
    weights: WeightTraffic | None = None


@dataclasses.dataclass(frozen=True)
class WeightTraffic:
    """What a training step's weights should cost its collectives (`report.mesh_findings`):
    ``gathered``, the bytes per device of every weight in the compute dtype gathered over
    fsdp (still split over tensor); ``passes``, the forward and backward passes over
    micro-batches, each of which gathers them once (a backward maybe twice: its remat
    forward's and its own); ``stacked``, the largest stacked weight's bytes per device as it
    is laid out (a copy that size is a copy of the weights); ``micro_batches``, how many the
    step runs (a copy made that often is made per micro-batch)."""

    gathered: float
    passes: float
    stacked: float
    micro_batches: int


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one RL step trains on and one decode call runs, from the config: ``prompts_per_step
    x group.n`` trajectories of ``tokens`` tokens each (default ``engine.max_model_len``,
    the longest a rollout can make)."""

    trajectories: int
    tokens: int
    micro_batches: int  # real micro-batches per mini-batch
    slots: int  # micro-batch slots per mini-batch (a power of two)
    row_tokens: int  # T of a row
    rows: int  # rows per micro-batch

    @classmethod
    def of(cls, cfg: JarlConfig, tokens: int | None) -> Workload:
        L, K = cfg.learner, cfg.algorithm.mini_batches
        n = cfg.data.prompts_per_step * cfg.group.n
        length = tokens or cfg.engine.max_model_len
        rows = micro_batch_rows(cfg)
        per_mini = -(-n // K)
        if L.packing:  # first-fit of equal lengths: whole trajectories per row
            T = padded_length(length, L.row_tokens)
            rows_needed = -(-per_mini // (T // length))
        else:
            T, rows_needed = padded_length(length, L.seq_bucket), per_mini
        real = max(1, -(-rows_needed // rows))
        return cls(n, length, real, 1 << (real - 1).bit_length(), T, rows)


def forward_flops(model: ModelConfig, tokens: float, context: float) -> float:
    """FLOPs of a forward over ``tokens`` tokens each attending to ``context`` keys on average:
    2 per multiply-add of every matmul (q, k, v, o, the MLP's three or a sparse layer's router
    and chosen experts, the head) and of the attention's scores and weighted values."""
    attention = model.num_layers * 2 * model.num_heads * model.head_dim * context
    return 2 * tokens * (model.matmul_params_per_token + attention)


# matmul FLOPs per (query, key) pair and head dimension of splash attention's kernels: the
# forward's q k and p v; dq's q k again, dO v and dS k; dkv's q k, dO v, p dO and dS q
_SPLASH_MATMULS = {"fwd": 4, "dq": 6, "dkv": 8}


def kernel_costs(window: int | None = None, context: float = 0.0) -> KernelCost:
    """The FLOPs and HBM bytes of the Pallas kernels the programs run, from their names and
    operand types (XLA's cost analysis counts a kernel as nothing):

    - splash attention (``splash_mha_fwd*``, ``_dq*``, ``_dkv*``: one row's heads, q [H, n,
      K]): 2 per multiply-add of each of its matmuls (`_SPLASH_MATMULS`) over the key blocks
      it visits, the causal blocks (those within ``window`` positions of the query block, if
      given) of its block grid (the grid's [1, n / block_q, n / block_kv] mask operand), whole
      blocks (their masked halves on the diagonal included); bytes: its operands and results;
    - the paged-attention decode kernel (``paged_attention``, q [B, H, K], pages [G, P, page,
      K]): each row reads ``context`` cached positions (the workload's mean): 4 H K FLOPs and
      2 G K elements of the pages per position, plus its queries and results.

    Any other kernel is left to `hlo.count` (its operands and results; no FLOPs)."""

    def cost(name: str, operands: list[str], result: str) -> tuple[float, float] | None:
        moved = float(sum(nbytes(s) for s in operands) + nbytes(result))
        parts = [a for s in operands for a in arrays(s)]
        floats = [a for a in parts if a[0] in ("bf16", "f16", "f32")]
        if name.startswith("splash_mha_"):
            kind = next((k for k in _SPLASH_MATMULS if f"_{k}" in name), None)
            q = next((d for _, d in floats if len(d) == 3), None)
            if kind is None or q is None:
                return None
            H, n, K = q
            grid = next((d for t, d in parts if t == "s8" and len(d) == 3), (1, 1, 1))
            bq, bk = n // grid[1], n // grid[2]
            reach = window or n
            visited = sum(
                1
                for i in range(grid[1])
                for j in range(grid[2])
                if j * bk <= (i + 1) * bq - 1 and i * bq - ((j + 1) * bk - 1) < reach
            )
            return _SPLASH_MATMULS[kind] * H * K * visited * bq * bk, moved
        if name.startswith("paged_attention"):
            q = next((d for _, d in floats if len(d) == 3), None)
            pages = next(((t, d) for t, d in floats if len(d) == 4), None)
            if q is None or pages is None:
                return None
            (B, H, K), (dtype, (G, _, _, _)) = q, pages
            read = 2 * B * G * K * context * (2 if dtype != "f32" else 4)
            return 4 * B * H * K * context, read + nbytes(result) + sum(
                nbytes(s) for s in operands if len(arrays(s)) == 1 and len(arrays(s)[0][1]) != 4
            )
        return None

    return cost


def _sds(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _per_device(tree: Any) -> int:
    """Bytes of ``tree``'s abstract arrays on the busiest device of their layout."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def _traffic(
    model: ModelConfig, compute_dtype: str, params: Any, passes: float, micro_batches: int
) -> WeightTraffic:
    """`WeightTraffic` of a policy's ``params`` (abstract, laid out) over ``passes``."""
    size = 2 if compute_dtype == "bfloat16" else 4

    def split(x: Any) -> int:  # the devices a leaf stays split over once gathered over fsdp
        axes = [a for p in x.sharding.spec for a in ((p,) if isinstance(p, str) else p or ())]
        return math.prod(x.sharding.mesh.shape[a] for a in axes if a != "fsdp")

    leaves = jax.tree.leaves(params)
    stacked = [x for x in leaves if x.ndim >= 3 and x.shape[0] == model.num_layers]
    return WeightTraffic(
        sum(math.prod(x.shape) * size / split(x) for x in leaves),
        passes,
        max((math.prod(x.sharding.shard_shape(x.shape)) * size for x in stacked), default=0),
        micro_batches,
    )


def _trains(model: ModelConfig, compute_dtype: str, state: TrainState) -> dict[str, Any]:
    """`Program`'s ``trained`` and ``optimizer`` of a policy's train ``state``, and what the
    step trains in words."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(trainable(policy_of(model), state.params)))
    what = "every weight"
    if model.lora is not None:
        base = "bfloat16" if compute_dtype == "bfloat16" else "float32"
        what = f"the LoRA adapters (rank {model.lora.rank}), the base frozen in {base}"
    return {"trained": n, "optimizer": _per_device(state.opt_state), "what": what}


def _rows(shape: tuple[int, int, int], sharder: Sharder, window: int) -> TrainBatch:
    at = sharder.sharding((None, "batch", None), shape)
    ints = _sds(shape, jnp.int32, at)
    floats = _sds(shape, jnp.float32, at)
    return TrainBatch(ints, ints, ints, ints, ints, floats, floats, window)


def learner_programs(
    cfg: JarlConfig, model: ModelConfig, sharder: Sharder, work: Workload
) -> list[Program]:
    """The RL update (`StepPrograms.rl_step`, as the learner jits it) over a step of ``work``
    and, with ``sft`` configured, the SFT step over a batch of ``sft.batch_size`` rows of
    ``engine.max_model_len`` tokens. A trained pass's backward costs two forwards (the
    inputs' and the weights' gradients); a LoRA policy's one (its frozen base's weights get
    no gradient; the adapters' own FLOPs, about 2 rank / hidden of the projections', are not
    counted)."""
    a, tensor = cfg.algorithm, cfg.mesh.tensor
    dp = cfg.mesh.data * cfg.mesh.fsdp
    programs = StepPrograms.of(model, sharder=sharder, **learner_settings(cfg))
    state = abstract_learner_state(
        programs, sharder, critic=a.adv_estimator == "gae", reference=bool(a.kl_coef)
    )
    layout = jax.tree.map(lambda x: x.sharding, state)
    trains = _trains(programs.spec.model, cfg.model.dtype, state.policy)
    backward = 1 if model.lora is not None else 2  # forwards' worth
    K, T = a.mini_batches, work.row_tokens
    S = max(1 << (work.trajectories - 1).bit_length(), dp)
    seq = sharder.sharding(("batch",), (S,))
    window = padded_length(min(work.tokens, T), ATTN_BLOCK)
    batch = RLBatch(
        _rows((K * work.slots, work.rows, T), sharder, window),
        _sds((S,), jnp.float32, seq),
        _sds((S,), jnp.int32, seq),
        _sds((S,), jnp.float32, seq),
        _sds((S,), jnp.int32, seq),
        _sds((), jnp.int32, sharder.sharding(())),
    )
    # per device: a micro-batch's rows split over data x fsdp, its matmuls over tensor
    tokens = work.micro_batches * K * work.rows * T / dp / tensor
    forward = forward_flops(model, tokens, work.tokens / 2)  # causal: half the keys
    gae = a.adv_estimator == "gae"  # the critic trains every weight of its body
    prepared = (1 + bool(a.kl_coef) + gae) * forward
    trained = a.ppo_epochs * (1 + backward + gae * 3) * forward
    extra = a.ppo_epochs * (1 + gae) * forward if cfg.learner.remat else 0.0
    rl = Program(
        "rl_update",
        jit_step(programs.rl_step(True), layout, programs.spec.model),
        (state, batch),
        {},
        prepared + trained + extra,
        prepared + trained,
        f"{work.trajectories} trajectories of {work.tokens} tokens: {work.micro_batches} "
        f"micro-batch(es) of {work.rows} x {T} tokens per mini-batch, x {K} mini-batches x "
        f"{a.ppo_epochs} epoch(s); trains {trains['what']}",
        trains["trained"],
        trains["optimizer"],
        trips={MICRO_BATCHES: work.micro_batches, ALL_MICRO_BATCHES: K * work.micro_batches},
        kernels=kernel_costs(window),
        weights=_traffic(
            programs.spec.model,
            cfg.model.dtype,
            state.policy.params,
            # per micro-batch: prepare's forwards (the reference's, the critic's too), then
            # each epoch's forward and backward (a trained critic's alike)
            K * work.micro_batches * (1 + bool(a.kl_coef) + gae + a.ppo_epochs * 2 * (1 + gae)),
            K * work.micro_batches,
        ),
    )
    out = [rl]
    if cfg.sft.data and cfg.sft.steps:
        sft_programs = StepPrograms.of(
            model,
            sharder=sharder,
            **learner_settings(
                cfg, lr=cfg.sft.lr, warmup=cfg.sft.warmup_steps, decay_steps=cfg.sft.steps
            ),
        )
        sft_state = abstract_learner_state(sft_programs, sharder, critic=False, reference=False)
        sft_trains = _trains(sft_programs.spec.model, cfg.model.dtype, sft_state.policy)
        rows = sft_micro_batch_rows(cfg)
        T = padded_length(cfg.engine.max_model_len, cfg.learner.seq_bucket)
        rows_shape = (cfg.sft.batch_size // rows, rows, T)
        tokens = cfg.sft.batch_size * T / dp / tensor
        f = forward_flops(model, tokens, T / 2)
        out.append(
            Program(
                "sft_step",
                jit_step(
                    sft_programs.sft_step,
                    jax.tree.map(lambda x: x.sharding, sft_state),
                    sft_programs.spec.model,
                ),
                (sft_state, _rows(rows_shape, sharder, T)),
                {},
                (1 + backward + cfg.learner.remat) * f,
                (1 + backward) * f,
                f"{cfg.sft.batch_size} rows of {T} tokens in micro-batches of {rows}; trains "
                f"{sft_trains['what']}",
                sft_trains["trained"],
                sft_trains["optimizer"],
                kernels=kernel_costs(T),
            )
        )
    return out


def engine_programs(cfg: JarlConfig, model: ModelConfig, sharder: Sharder) -> list[Program]:
    """The embedded engine's weight push (the learner's fp32 params, laid out on the training
    mesh, cast to ``model.dtype`` and laid out for serving on the inference mesh: one program
    from the learner's buffers to the engine's; a LoRA policy's adapters alone, onto the base
    the engine keeps: `serving_adapters`), its ragged step at the largest row bucket (prompt
    chunks filling it) and a decode call of ``engine.steps_per_call`` steps at its largest
    batch bucket (a LoRA model's adapters unmerged), built as ``engine.backend=embedded``
    builds its engine, for TPU."""
    r, tensor = cfg.engine, cfg.mesh.tensor
    serving = Sharder(inference_mesh(sharder.mesh))
    engine = make_engine(r, policy_of(model), cfg.model.dtype, serving)
    served = dataclasses.replace(model, dtype=cfg.model.dtype)
    programs = abstract_programs(
        engine, abstract_policy(policy_of(served), serving), r.steps_per_call
    )
    load_fn, _, _ = programs["load_params"]
    learner_params = abstract_policy(policy_of(model).in_dtype("float32"), sharder)
    out_layout = jax.tree.map(lambda x: x.sharding, programs["step"][1][0])
    dtype = served.jnp_dtype
    pushed: Any  # the learner's weights, or a LoRA policy's adapters
    if model.lora is None:
        push = jax.jit(lambda p: load_fn(cast_floats(p, dtype)), out_shardings=out_layout)
        pushed, what = learner_params, "fp32 -> serving layout"
    else:  # the engine keeps its base; the new adapters live beside the old until placed
        layers = out_layout.layers
        push = jax.jit(
            lambda a: serving_adapters(served, a, serving),
            out_shardings=tuple(w.lora for w in layers),
        )
        pushed, what = adapters_of(learner_params), "the LoRA adapters, fp32 -> serving layout"
    dp = sharder.mesh.shape["data"] * sharder.mesh.shape["fsdp"]
    # a shard's rows: prompt tokens, each attending to half a prompt chunk on average
    rows = engine.step_buckets[-1]
    chunk = min(engine.prefill_chunk, r.max_model_len)
    step = forward_flops(model, rows / tensor, chunk / 2)
    # each of a call's decode steps after it: every slot, attending to half the longest
    slots = engine.batch_buckets[-1]
    decode = r.steps_per_call * forward_flops(model, slots / dp / tensor, r.max_model_len / 2)
    fn, args, static = programs["step"]
    gen_fn, gen_args, gen_static = programs["generate"]
    return [
        # unstaged, the old weights are dropped first (`engine.push.staged`)
        Program(
            "weight_push",
            push,
            (pushed,),
            {},
            0.0,
            0.0,
            what,
            replaces=model.lora is None and not r.push.staged,
        ),
        Program(
            "step",
            fn,
            args,
            static,
            step,
            step,
            f"a ragged step of {rows} rows a shard (prompt chunks, {engine.decode_kernel} "
            "attention for decode rows)",
            kernels=kernel_costs(),
        ),
        Program(
            "decode",
            gen_fn,
            gen_args,
            gen_static,
            decode,
            decode,
            f"{r.steps_per_call} steps x {slots} slots, each at {r.max_model_len // 2} cached "
            f"tokens on average, {engine.decode_kernel} attention",
            kernels=kernel_costs(context=r.max_model_len / 2),
        ),
    ]


def run_programs(
    cfg: JarlConfig, model: ModelConfig, topology: Topology, tokens: int | None
) -> tuple[Sharder, list[Program]]:
    """The run's mesh (``mesh.*`` over the slice's chips) and every program ``cfg``'s run
    compiles: the learner's, and the embedded engine's (``engine.backend=embedded``), of
    the checkpoint's ``model`` with ``model.lora``'s adapters if any (`run_model`)."""
    m = cfg.mesh
    if m.data * m.fsdp * m.tensor != topology.chips:
        raise ValueError(
            f"mesh.data x mesh.fsdp x mesh.tensor = {m.data * m.fsdp * m.tensor} but "
            f"{topology.name} has {topology.chips} chips: set mesh.* to multiply to "
            f"{topology.chips} (e.g. mesh.data=1 mesh.fsdp={topology.chips} mesh.tensor=1)"
        )
    sharder = Sharder(make_mesh(m.data, m.fsdp, m.tensor, devices=topology.devices))
    work = Workload.of(cfg, tokens)
    model = run_model(cfg, model)
    programs = learner_programs(cfg, model, sharder, work)
    if cfg.engine.backend == "embedded":
        programs += engine_programs(cfg, model, sharder)
    return sharder, programs
