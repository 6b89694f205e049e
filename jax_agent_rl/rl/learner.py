"""The sharded JAX learner: lays the learner's state out on a mesh, puts host batches on the
devices and runs the jitted steps (the RL update of `rl.update`, an SFT update) over them.

Master weights and AdamW state are float32; the forward and backward run in the compute dtype
(``float32`` or ``bfloat16``: the parameters are cast inside the differentiated function, so
gradients arrive in float32). A batch is [M, b, T]: M micro-batches of ``micro_batch_size``
rows, ``b`` sharded over the mesh's (data, fsdp) axes; a row holds one sequence or several
packed (`rl.batch`). One jitted step loops over the micro-batches, sums their gradients and
applies one optimizer update. Every loss term is aggregated with *whole-batch* denominators
(token and sequence counts of all its micro-batches), so the accumulated gradient equals the
gradient of the whole batch at once.

An RL step is one program, ``state, metrics = step(state, batch)`` (`Learner.rl_update`,
`rl.update.rl_update`): the batch crosses to the devices once and only the metrics come back.
The state is the caller's: `Learner.init_state` makes it, each update takes it (donating its
buffers) and gives back the next; the learner keeps only the programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jax_agent_rl.cluster import device_turns
from jax_agent_rl.config import AlgorithmSection, OptimSection
from jax_agent_rl.models import ModelConfig, Policy, Sharder, Weights
from jax_agent_rl.models.config import compiler_options
from jax_agent_rl.models.moe import NO_EXPERTS
from jax_agent_rl.models.policy import abstract_policy, policy_of, policy_shardings
from jax_agent_rl.rl.batch import Sequences, TrainBatch
from jax_agent_rl.rl.objectives import (
    Critic,
    Denominators,
    Metrics,
    SamplingSpec,
    StepSpec,
    cast_floats,
    sft_objective,
)
from jax_agent_rl.rl.update import (
    SEQ_GAP,
    SEQ_TOKENS,
    TRACE_ADV,
    TRACE_ENT,
    TRACE_LOGP,
    LearnerState,
    RLBatch,
    TrainState,
    apply_update,
    make_optimizer,
    rl_update,
    trainable,
)


def gap_by_staleness(
    seq_gap: np.ndarray, seq_tokens: np.ndarray, seq_staleness: np.ndarray
) -> dict[str, float]:
    """``logprob_gap/staleness_<k>``: the mean sampler-vs-learner logprob gap over the sampled
    tokens of the sequences ``k`` weight versions behind the policy (those without tokens
    skipped)."""
    out = {}
    for k in np.unique(seq_staleness):
        chosen = (seq_staleness == k) & (seq_tokens > 0)
        if chosen.any():
            out[f"logprob_gap/staleness_{int(k)}"] = float(
                seq_gap[chosen].sum() / seq_tokens[chosen].sum()
            )
    return out


def check_batch_experts(policy: Policy, batch: TrainBatch) -> None:
    """Raises ValueError unless the sampled experts a batch carries (`TrainBatch.expert_ids`)
    are ints of the model's sparse layers and experts per token, ids within its experts, each
    token's row of a layer given whole or not at all."""
    ids = batch.expert_ids
    if ids is None:
        return
    experts = policy.experts
    if experts is None:
        raise ValueError(
            f"the trajectories carry expert_ids (per token {tuple(ids.shape[2:])}), but the "
            "policy has no experts"
        )
    want = (experts.sparse_layers, experts.per_token)
    if ids.ndim != 4 or tuple(ids.shape[2:]) != want or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"the trajectories' expert_ids hold {tuple(ids.shape[2:])} ({ids.dtype}) per "
            f"token; the policy has (sparse layers, num_experts_per_tok) = {want}"
        )
    bad = ids[(ids != NO_EXPERTS) & ((ids < 0) | (ids >= experts.count))]
    if bad.size:
        raise ValueError(
            f"the trajectories' expert_ids hold expert {int(bad[0])}; the policy's experts "
            f"are 0 .. {experts.count - 1} (-1: none sampled)"
        )
    # a token's row in a layer is every expert it was routed to, or none: [5, -1] took expert
    # 5's gate and another expert's MLP
    none = ids == NO_EXPERTS
    half = np.argwhere(none.any(-1) & ~none.all(-1))
    if half.size:
        raise ValueError(
            f"the trajectories' expert_ids give {ids[tuple(half[0])].tolist()} for one token of "
            "a layer: all of its num_experts_per_tok experts, or -1 for each (none sampled)"
        )


def master_weights(spec: StepSpec, params: Weights) -> Weights:
    """The policy as the learner holds it: float32; a LoRA policy computing in bfloat16 holds
    its frozen base in bfloat16 (the forward casts it so anyway: the same numbers, half the
    memory), its adapters in float32."""
    params = cast_floats(params, jnp.float32)
    policy = spec.policy
    if not policy.adapted or spec.compute_dtype != "bfloat16":
        return params
    base = cast_floats(policy.base(params), jnp.bfloat16)
    return policy.with_trained(base, policy.trained(params))


def _with_rollout_logprobs(spec: StepSpec, given: bool) -> StepSpec:
    return dataclasses.replace(
        spec, sampling=dataclasses.replace(spec.sampling, rollout_logprobs=given)
    )


def jit_step(fn: Callable[..., Any], layout: Any, model: ModelConfig) -> Any:
    """``state, metrics = fn(state, batch)`` jitted with the state donated and returned laid
    out as ``layout`` (a tree of the state's shardings), with the options of ``model``'s
    programs (`compiler_options`: the engine's, where logprobs are exact)."""
    return jax.jit(
        fn, donate_argnums=0, out_shardings=(layout, None), compiler_options=compiler_options(model)
    )


def _jit_keeping_layout(fn: Callable[..., Any], model: ModelConfig) -> Callable[..., Any]:
    """`jit_step` of ``fn`` keeping the state laid out exactly as it came in (else the second
    call, fed the first call's output, would compile the step again); the layout is read at
    the first call."""
    compiled: list[Callable[..., Any]] = []

    def call(state: Any, batch: Any) -> Any:
        if not compiled:
            compiled.append(jit_step(fn, jax.tree.map(lambda x: x.sharding, state), model))
        return compiled[0](state, batch)

    return call


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """What a learner's steps are functions of: the static step (`StepSpec`) and the
    optimizers. `rl_step` and `sft_step` are the functions `Learner` jits (``jarl plan``
    compiles them abstractly)."""

    spec: StepSpec
    tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation

    @classmethod
    def of(
        cls,
        model: ModelConfig | Policy,
        *,
        algo: AlgorithmSection,
        optim: OptimSection,
        sampling: SamplingSpec,
        compute_dtype: Literal["float32", "bfloat16"] = "float32",
        sharder: Sharder,
        remat: bool = False,
        norm_const: float | None = None,
        lr: float | None = None,
        decay_steps: int | None = None,
    ) -> StepPrograms:
        policy = policy_of(model).in_dtype("float32")
        spec = StepSpec(policy, compute_dtype, sampling, algo, remat, sharder, norm_const)
        tx = make_optimizer(optim.lr if lr is None else lr, optim, decay_steps)
        return cls(spec, tx, make_optimizer(optim.critic_lr, optim))

    def rl_step(self, rollout_logprobs: bool) -> Callable[..., Any]:
        """``state, metrics = step(state, batch)``: `rl_update` (``rollout_logprobs=False``:
        the learner's old-policy logprobs stand in for the sampler's)."""
        spec = _with_rollout_logprobs(self.spec, rollout_logprobs)
        return partial(rl_update, spec, self.tx, self.critic_tx)

    def sft_step(self, state: LearnerState, rows: TrainBatch) -> tuple[LearnerState, Metrics]:
        """One SFT update of the policy on [M, b, T] ``rows``."""
        d = Denominators(jnp.maximum(rows.mask.sum(), 1.0), jnp.ones(()), 1.0, 1)
        M = rows.mask.shape[0]
        policy, m = apply_update(
            sft_objective, self.spec, self.tx, state.policy, rows, None, d, 0, M
        )
        return dataclasses.replace(state, policy=policy), m


def abstract_learner_state(
    programs: StepPrograms, sharder: Sharder, *, critic: bool, reference: bool
) -> LearnerState:
    """The shapes, dtypes and layout of the state a `Learner` of ``programs`` makes on
    ``sharder``'s mesh (`Learner.init_state`), allocating nothing: fp32 weights
    (`master_weights`) laid out by their logical axes, the optimizers' moments like their
    parameters, counters (and a critic's head) replicated."""
    policy = programs.spec.policy
    replicated = sharder.sharding(())

    def at(x: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    full = abstract_policy(policy, sharder)  # float32
    held = jax.eval_shape(partial(master_weights, programs.spec), full)
    params = jax.tree.map(lambda x, f: at(x, f.sharding), held, full)  # `master_weights`

    def train_state(tx: optax.GradientTransformation, p: Any) -> TrainState:
        t = trainable(policy, p)
        opt = optax.tree_map_params(
            tx,
            lambda s, x: at(s, x.sharding),
            jax.eval_shape(tx.init, t),
            t,
            transform_non_params=lambda s: at(s, replicated),
        )
        return TrainState(p, opt, at(jax.ShapeDtypeStruct((), jnp.int32), replicated))

    value = None
    if critic:
        D = policy.cfg.hidden_size
        head = at(jax.ShapeDtypeStruct((D,), jnp.float32), replicated)
        bias = at(jax.ShapeDtypeStruct((), jnp.float32), replicated)
        value = train_state(programs.critic_tx, Critic(full, head, bias))
    frozen = params if reference and not policy.adapted else None  # `reference_of`
    return LearnerState(train_state(programs.tx, params), value, frozen)


# ------------------------------------------------------------------------------ the class


class Learner:
    """The jitted steps over a learner's state (`LearnerState`) on a mesh, and what they are
    made of: the state itself is the caller's, made by `init_state` and passed in and out of
    every update (``state, metrics, tokens = learner.rl_update(state, ...)``); an update
    donates the state it is given, which must not be used after it."""

    def __init__(
        self,
        model: ModelConfig | Policy,
        *,
        sharder: Sharder,
        algo: AlgorithmSection,
        optim: OptimSection,
        sampling: SamplingSpec,
        compute_dtype: Literal["float32", "bfloat16"] = "float32",
        micro_batch_size: int = 8,
        remat: bool = False,
        norm_const: float | None = None,
        lr: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        programs = StepPrograms.of(
            model,
            algo=algo,
            optim=optim,
            sampling=sampling,
            compute_dtype=compute_dtype,
            remat=remat,
            sharder=sharder,
            norm_const=norm_const,
            lr=lr,
            decay_steps=decay_steps,
        )
        self.policy = programs.spec.policy
        self.model = self.policy.cfg
        self.sharder = sharder
        self.micro_batch_size = micro_batch_size
        self.spec, self.tx, self.critic_tx = programs.spec, programs.tx, programs.critic_tx
        self._param_shardings = policy_shardings(self.policy, sharder)
        # micro-batches [M, b, T], per-sequence outcomes [S]: rows and sequences over `batch`
        self._batch_sharding = sharder.sharding((None, "batch", None))
        self._seq_sharding = sharder.sharding(("batch",))
        self._rl_steps = {
            given: _jit_keeping_layout(programs.rl_step(given), self.model)
            for given in (True, False)
        }  # each compiles on first use
        self._sft_step = _jit_keeping_layout(programs.sft_step, self.model)

    def init_state(
        self, params: Weights, *, critic: Critic | None = None, reference: Weights | None = None
    ) -> LearnerState:
        """The state an update starts from: the policy ``params`` (as `master_weights`), the
        ``critic`` (GAE) and the KL ``reference``, laid out on the mesh, with fresh optimizer
        states."""
        if reference is not None and self.policy.adapted:
            raise ValueError(
                "a LoRA policy's KL reference is its own base weights with the adapters left "
                "out (rl.update.reference_of): pass no reference"
            )
        policy = self._init_state(self.tx, self._place(master_weights(self.spec, params)))
        value = (
            None
            if critic is None
            else self._init_state(
                self.critic_tx, self._place_critic(cast_floats(critic, jnp.float32))
            )
        )
        # a copy: the update donates the policy's buffers, which a shared reference would lose
        frozen = None if reference is None else self._place(cast_floats(reference, jnp.float32))
        if frozen is not None:
            frozen = jax.tree.map(jnp.copy, frozen)
        return LearnerState(policy, value, frozen)

    # --- placement

    def _place(self, weights: Weights) -> Weights:
        return jax.device_put(weights, self._param_shardings)

    def _place_critic(self, critic: Critic) -> Critic:
        return Critic(self._place(critic.body), critic.head, critic.bias)

    def _replicated(self, x: Any) -> jax.Array:
        """A host value every process gives alike, on every device."""
        replicated = self.sharder.sharding(())
        # `device_put` builds a broken array when a process has one device
        return jax.make_array_from_process_local_data(replicated, np.asarray(x))

    def _init_state(self, tx: optax.GradientTransformation, params: Any) -> TrainState:
        # eager init: each Adam moment is a zeros_like of its parameter, laid out the same way
        state = TrainState(
            params, tx.init(trainable(self.policy, params)), jnp.zeros((), jnp.int32)
        )
        # the counters (scalars on one device) replicated over the mesh
        return jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) else self._replicated(x), state
        )

    def device_batch(self, batch: TrainBatch, local: bool = False) -> TrainBatch:
        """Host rows -> device [M, b, T] micro-batches, b split over data x fsdp (over the
        processes too: each holds ``b / processes`` rows of every micro-batch). ``batch`` is
        the whole batch, the same on every process (SFT), or with ``local`` this process's
        rows, micro-batch after micro-batch (the rollouts it ran). One process: the same."""
        processes = jax.process_count()
        b = self.micro_batch_size
        if b % processes:
            raise ValueError(f"micro_batch_size={b} does not split over {processes} processes")
        share = b // processes
        if not local and processes > 1:
            B = batch.shape[0]
            if B % b:
                raise ValueError(f"batch of {B} rows is not a multiple of micro_batch_size={b}")
            index = np.arange(B).reshape(B // b, processes, share)[:, jax.process_index()]
            batch = batch.rows(index.reshape(-1))
        B = batch.shape[0]
        if B % share:
            raise ValueError(f"{B} rows are not whole micro-batches of {share} rows per process")
        split = jax.tree.map(
            lambda x: np.asarray(x).reshape(B // share, share, *x.shape[1:]), batch
        )
        return self._upload(split, self._batch_sharding, axis=1)

    @staticmethod
    def _upload(tree: Any, sharding: NamedSharding, axis: int) -> Any:
        """This process's share (along ``axis``) of every leaf onto the devices as global
        arrays."""
        processes = jax.process_count()

        def place(x: np.ndarray) -> jax.Array:
            shape = list(x.shape)
            shape[axis] *= processes
            return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

        return jax.tree.map(place, tree)

    # --- public steps

    def rollout_params(self, state: LearnerState, dtype: str) -> Weights:
        """The policy of ``state`` in the rollout backend's dtype (what `update_weights`
        receives): new buffers always, never the state's own, which the next update donates
        (an engine still serving them, as rollouts do during an asynchronous update, would
        read freed memory)."""
        want = jnp.dtype(dtype)
        with device_turns.TURN:
            return jax.block_until_ready(
                jax.tree.map(
                    lambda x: jnp.copy(x) if x.dtype == want else cast_floats(x, want),
                    state.policy.params,
                )
            )

    def pushed_params(self, state: LearnerState, dtype: str) -> Any:
        """What a weight push sends (`rollout_params`' copy rules): the trained part only, a
        LoRA policy's adapters (the engine keeps the base it started with), else the policy."""
        want = jnp.dtype(dtype)
        with device_turns.TURN:
            return jax.block_until_ready(
                jax.tree.map(
                    lambda x: jnp.copy(x) if x.dtype == want else cast_floats(x, want),
                    trainable(self.policy, state.policy.params),
                )
            )

    def rl_update(
        self,
        state: LearnerState,
        batch: TrainBatch,
        sequences: Sequences,
        micro_batches: int,
        *,
        rollout_logprobs: bool = True,
        staleness: np.ndarray | None = None,
    ) -> tuple[LearnerState, dict[str, float], dict[str, jax.Array]]:
        """One RL update (`rl_update`) of ``state`` (donated) on this process's host rows
        ``batch``: K mini-batches (``algorithm.mini_batches``) of the same number of
        micro-batch slots, whose first ``micro_batches`` are real (see `RLBatch`; every process
        passes the same count and shapes), with its sequences' outcomes [S]
        (``batch.sequence`` indexes them from this process's first, ``process_index * S``).
        The batch crosses to the devices once, is prepared and trained on there, and only the
        metrics come back. Returns the new state, the metrics and the per-token values.
        ``rollout_logprobs=False``: the batch's rollout logprobs are not the sampler's (its
        backend reports none); the learner's old-policy logprobs take their place, and
        ``rollout/logprobs_recomputed`` is 1. ``staleness`` [S] (how many weight versions each
        sequence's oldest token is behind the policy) adds the gap per staleness
        (`gap_by_staleness`; one process only: the metrics' sequences are every process's).

        The per-token values come back as they are, [M, b, T] arrays left on the devices,
        under ``learner_logprobs``, ``learner_entropy`` and ``advantages``: the update's own
        values before it steps (the entropy of the distribution the logprob is taken under,
        computed with it); a trace reads its trajectories' tokens out of them
        (`jax_agent_rl.train.traces.UpdateTokens`), and an untraced step copies nothing, so
        that one program serves steps traced or not."""
        check_batch_experts(self.policy, batch)
        if staleness is not None and len(staleness) != len(sequences.rewards):
            raise ValueError(
                f"{len(staleness)} staleness values for {len(sequences.rewards)} sequences"
            )
        with device_turns.TURN:  # an engine's thread may share the devices (async training)
            rewards, groups, weights, minis = self._upload(
                (sequences.rewards, sequences.groups, sequences.weights, sequences.minis),
                self._seq_sharding,
                axis=0,
            )
            steps = sequences.step_advantages
            device = RLBatch(
                self.device_batch(batch, local=True),
                rewards,
                groups,
                weights,
                minis,
                self._replicated(np.int32(micro_batches)),
                None if steps is None else self._upload(steps, self._seq_sharding, axis=0),
            )
            state, metrics = self._rl_steps[rollout_logprobs](state, device)
            # the per-sequence arrays are spread over the processes' devices: one process reads
            seq = metrics.pop(SEQ_GAP), metrics.pop(SEQ_TOKENS)
            names = (TRACE_LOGP, TRACE_ADV, TRACE_ENT)
            tokens = {k: metrics.pop(k) for k in names}
            out = {k: float(v) for k, v in jax.device_get(metrics).items()}
            # the metrics come from one device; the update may still run on the others, and
            # the turn must not pass before it is done everywhere (`device_turns`)
            jax.block_until_ready(state)
        if not out["batch/sampled_tokens"] or not rollout_logprobs:  # no gap to report
            del out["logprob_gap/mean"], out["logprob_gap/max"]
            for key in ("routing/logprob_gap_replayed", "routing/logprob_gap_own"):
                out.pop(key, None)
        elif staleness is not None and jax.process_count() == 1:
            seq_gap, seq_tokens = (np.asarray(x) for x in seq)
            out.update(gap_by_staleness(seq_gap, seq_tokens, np.asarray(staleness)))
        out["rollout/logprobs_recomputed"] = float(not rollout_logprobs)
        return state, out, tokens

    def sft_update(
        self, state: LearnerState, batch: TrainBatch
    ) -> tuple[LearnerState, dict[str, float]]:
        """One SFT update of ``state`` (donated) on the whole host batch ``batch``
        (`device_batch`): the new state and the metrics."""
        state, metrics = self._sft_step(state, self.device_batch(batch))
        return state, {k: float(v) for k, v in metrics.items()}


def critic_from_policy(params: Weights) -> Critic:
    """A critic initialised from the policy's body with a zero head (verl's default)."""
    D = params.final_norm.shape[0]
    return Critic(
        body=jax.tree.map(jnp.copy, params),
        head=jnp.zeros((D,), jnp.float32),
        bias=jnp.zeros((), jnp.float32),
    )
