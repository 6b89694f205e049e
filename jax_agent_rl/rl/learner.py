"""The sharded JAX learner: logprob recomputation, policy / critic / SFT updates.

Master weights and AdamW state are float32; the forward and backward run in the compute dtype
(``float32`` or ``bfloat16``: the parameters are cast inside the differentiated function, so
gradients arrive in float32). A batch is [M, b, T]: M micro-batches of ``micro_batch_size``
rows, ``b`` sharded over the mesh's (data, fsdp) axes; a row holds one sequence or several
packed (`rl.batch`). One jitted step loops over the micro-batches, sums their gradients and
applies one optimizer update. Every loss term is aggregated with *whole-batch* denominators
(token and sequence counts of all its micro-batches), so the accumulated gradient equals the
gradient of the whole batch at once.

An RL step is one program, ``state, metrics = step(state, batch)`` (`Learner.train_step`,
`rl_update`): the state (`LearnerState`: policy, critic, reference) stays on the devices;
the batch (`RLBatch`: token rows and the sequences' rewards and GRPO groups) is uploaded once;
old-policy and reference logprobs, critic values and advantages (`prepare`) and every PPO
epoch's mini-batch updates run on the devices, over the real micro-batches only (a loop whose
trip count the batch carries: the shapes, and so the compiled program, change only when a
step needs more micro-batch slots than any before); only the metrics come back to the host.

Logprobs are recomputed with `sampling_logprobs`, the function the engine samples with, under
the rollout's temperature / top-k / top-p, so learner and sampler logprobs compare token for
token (`token_stats`); without top-k / top-p, by `head_logprobs`, the same numbers a chunk
of the vocabulary at a time (the [B, T, V] logits are never made).
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

from jax_agent_rl import device_turns
from jax_agent_rl.config import AlgorithmSection, OptimSection
from jax_agent_rl.engine.sampling import head_logprobs, sampling_logprobs, token_logprobs
from jax_agent_rl.models import ModelConfig, Sharder, Weights, forward, lm_logits
from jax_agent_rl.models.decoder import param_shardings
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import Sequences, TrainBatch

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """The distribution rollouts sample from (the learner recomputes logprobs under it), and
    whether the sampler reports its logprobs: without them (JetStream), the learner's
    old-policy logprobs stand in for them, so TIS weights are 1 and no gap is reported."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    rollout_logprobs: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Critic:
    """A value model: a decoder body and a linear head on its final hidden state."""

    body: Weights
    head: jax.Array  # [D]
    bias: jax.Array  # []


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any  # Weights (policy) or Critic, float32
    opt_state: Any
    step: jax.Array


def cast_floats(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def make_optimizer(
    lr: float, optim: OptimSection, decay_steps: int | None = None
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; linear warmup, then constant (RL) or, with
    ``decay_steps``, cosine decay to zero at that step (SFT).

    Update ``k`` (counting from 0) uses the schedules' value at ``k + 1``: both start at 0, so
    unshifted the first update of every run would not move the weights at all (with
    ``warmup_steps=0`` the first update is at the full rate, as that setting says)."""
    warmup = max(optim.warmup_steps, 1)
    if decay_steps is None:
        ramp = optax.linear_schedule(0.0, lr, warmup)
    else:
        ramp = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(decay_steps, warmup + 1))

    def schedule(count: jax.Array) -> jax.Array:
        return jnp.asarray(ramp(count + 1))

    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay),
    )


# ------------------------------------------------------------------------ pure functions


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a step (hashable: it keys the jit cache)."""

    model: ModelConfig
    compute_dtype: Literal["float32", "bfloat16"]
    sampling: SamplingSpec
    algo: AlgorithmSection
    remat: bool
    sharder: Sharder | None
    # Dr.GRPO's constant (seq-mean-token-sum-norm): the generation budget; None: the row length
    norm_const: float | None = None

    def hidden(self, weights: Weights, mb: TrainBatch) -> tuple[jax.Array, Weights]:
        """Final hidden states [B, T, D] and the weights cast to the compute dtype."""
        w = cast_floats(weights, jnp.float32 if self.compute_dtype == "float32" else jnp.bfloat16)
        h = forward(
            w,
            self.model,
            mb.tokens,
            mb.positions,
            mb.segment_ids,
            self.sharder,
            self.remat,
            window=mb.window or None,
        )
        return h, w


def token_stats(spec: StepSpec, params: Weights, mb: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under the rollout's sampling distribution, and its entropy.

    Without top-k / top-p (the usual case) `head_logprobs` computes both a chunk of the
    vocabulary at a time; with them the vocabulary is sorted, so all the logits are made.
    """
    h, w = spec.hidden(params, mb)
    s = spec.sampling
    B, T, D = h.shape
    if s.top_k <= 0 and s.top_p >= 1.0:
        head_vd = w.embed if w.lm_head is None else w.lm_head.T
        logp, entropy = head_logprobs(
            h.reshape(B * T, D), head_vd, mb.targets.reshape(B * T), s.temperature
        )
        return logp.reshape(B, T), entropy.reshape(B, T)
    logits_btv = lm_logits(w, h)
    V = logits_btv.shape[-1]
    full = lambda v: jnp.full((B * T,), v)  # noqa: E731
    logp_btv = sampling_logprobs(
        logits_btv.reshape(B * T, V), full(s.temperature), full(s.top_k), full(s.top_p)
    ).reshape(B, T, V)
    return token_logprobs(logp_btv, mb.targets), core.entropy_from_logprobs(logp_btv)


def critic_values(spec: StepSpec, critic: Critic, mb: TrainBatch) -> jax.Array:
    """V(prefix up to and including token t), aligned with targets: [B, T] float32."""
    h, _ = spec.hidden(critic.body, mb)
    return jnp.einsum("btd,d->bt", h.astype(jnp.float32), critic.head) + critic.bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Derived:
    """What a step computes from its `TrainBatch` before updating, per token [M, b, T]."""

    old_logp: jax.Array  # learner logprobs before this update (0 off the sampled tokens)
    ref_logp: jax.Array  # reference-model logprobs (the KL term; 0 without a reference)
    advantages: jax.Array
    old_values: jax.Array  # critic values before the update (GAE; 0 otherwise)
    returns: jax.Array  # value targets (GAE; 0 otherwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Denominators:
    """Whole-(mini-)batch counts every micro-batch aggregates with, and the static sizes the
    per-sequence terms need."""

    num_tokens: jax.Array
    num_seqs: jax.Array
    norm_const: float = dataclasses.field(metadata=dict(static=True))
    num_sequences: int = dataclasses.field(metadata=dict(static=True))


def policy_objective(
    spec: StepSpec, params: Weights, mb: TrainBatch, dv: Derived, d: Denominators
) -> tuple[jax.Array, Metrics]:
    """PPO-clip policy loss (+ KL to the reference, - entropy bonus) of one micro-batch."""
    a = spec.algo
    counts: dict[str, Any] = dict(
        num_tokens=d.num_tokens,
        num_seqs=d.num_seqs,
        norm_const=d.norm_const,
        seq_bt=mb.sequence,
        num_sequences=d.num_sequences,
    )
    logp, entropy = token_stats(spec, params, mb)
    is_fn = core.masked_is_weights if a.tis_mode == "mask" else core.truncated_is_weights
    is_weights = (
        None if a.tis_cap is None else is_fn(dv.old_logp, mb.rollout_logp, mb.mask, a.tis_cap)
    )
    pg_loss, m = core.policy_loss(
        logp,
        dv.old_logp,
        dv.advantages,
        mb.mask,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        clip_c=a.clip_c,
        is_weights_bt=is_weights,
        agg_mode=a.loss_agg_mode,
        **counts,
    )
    loss = pg_loss
    metrics = {"pg_loss": pg_loss, **m}
    if a.entropy_coef:
        loss = loss - a.entropy_coef * core.aggregate_loss(
            entropy, mb.mask, a.loss_agg_mode, **counts
        )
    if a.kl_coef:
        kl = core.aggregate_loss(
            core.kl_penalty(logp, dv.ref_logp, a.kl_kind), mb.mask, a.loss_agg_mode, **counts
        )
        loss = loss + a.kl_coef * kl
        metrics["kl_loss"] = kl
    metrics["entropy"] = core.masked_mean(entropy, mb.mask)
    if is_weights is not None and a.tis_mode == "mask":
        metrics["tis_masked_frac"] = core.masked_mean(
            (is_weights == 0).astype(jnp.float32), mb.mask
        )
    return loss, metrics


def value_objective(
    spec: StepSpec, critic: Critic, mb: TrainBatch, dv: Derived, d: Denominators
) -> tuple[jax.Array, Metrics]:
    values = critic_values(spec, critic, mb)
    loss, m = core.value_loss(
        values,
        dv.old_values,
        dv.returns,
        mb.mask,
        clip_range=spec.algo.vf_clip,
        agg_mode=spec.algo.loss_agg_mode,
        num_tokens=d.num_tokens,
        num_seqs=d.num_seqs,
        norm_const=d.norm_const,
        seq_bt=mb.sequence,
        num_sequences=d.num_sequences,
    )
    return loss, {"vf_loss": loss, **m}


def sft_objective(
    spec: StepSpec, params: Weights, mb: TrainBatch, dv: Derived | None, d: Denominators
) -> tuple[jax.Array, Metrics]:
    """Masked cross-entropy of the sampled (model) tokens, token-mean over the whole batch."""
    del dv
    logp, _ = token_stats(spec, params, mb)
    loss = -(logp * mb.mask).sum() / d.num_tokens
    return loss, {"sft_loss": loss}


Objective = Callable[[StepSpec, Any, TrainBatch, Any, Denominators], tuple[jax.Array, Metrics]]


def _micro_batch(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


# metrics that are a micro-batch's share of a whole-batch loss (whole-batch denominators)
LOSS_TERMS = frozenset({"pg_loss", "kl_loss", "vf_loss", "sft_loss"})


def accumulated_grads(
    objective: Objective,
    spec: StepSpec,
    params: Any,
    rows: TrainBatch,
    derived: Derived | None,
    d: Denominators,
    lo: jax.Array | int,
    hi: jax.Array | int,
) -> tuple[jax.Array, Any, Metrics]:
    """Loss, gradient and metrics of micro-batches ``lo .. hi - 1`` of [M, b, T] ``rows``
    (bounds known on the device only: the micro-batches after them, padding, are never
    computed).

    Loss terms are sums with whole-batch denominators, so they add up over micro-batches
    (the loss metrics, `LOSS_TERMS`, too); the other metrics (masked means within a
    micro-batch) are averaged weighted by mask tokens.
    """
    grad_fn = jax.value_and_grad(lambda p, mb, dv: objective(spec, p, mb, dv, d), has_aux=True)

    def step(i: jax.Array, carry: tuple[jax.Array, Any, Metrics]) -> tuple[Any, Any, Metrics]:
        loss, grads, metrics = carry
        mb, dv = _micro_batch(rows, i), _micro_batch(derived, i)
        (mb_loss, m), g = grad_fn(params, mb, dv)
        w = mb.mask.sum() / d.num_tokens
        metrics = {k: metrics[k] + (m[k] if k in LOSS_TERMS else w * m[k]) for k in metrics}
        return loss + mb_loss, jax.tree.map(jnp.add, grads, g), metrics

    zero = jnp.zeros((), jnp.int32)
    mb0, dv0 = _micro_batch(rows, zero), _micro_batch(derived, zero)
    metric_shapes = jax.eval_shape(lambda: objective(spec, params, mb0, dv0, d)[1])
    zero_metrics = {k: jnp.zeros((), jnp.float32) for k in metric_shapes}
    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), zero_metrics)
    return jax.lax.fori_loop(lo, hi, step, init)


def apply_update(
    objective: Objective,
    spec: StepSpec,
    tx: optax.GradientTransformation,
    state: TrainState,
    rows: TrainBatch,
    derived: Derived | None,
    d: Denominators,
    lo: jax.Array | int,
    hi: jax.Array | int,
) -> tuple[TrainState, Metrics]:
    loss, grads, metrics = accumulated_grads(
        objective, spec, state.params, rows, derived, d, lo, hi
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnerState:
    """Every array the learner trains with: the policy's train state, the critic's (GAE) and
    the KL reference (frozen). One pytree: a step is ``state, metrics = step(state, batch)``."""

    policy: TrainState
    critic: TrainState | None = None
    reference: Any | None = None  # Weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RLBatch:
    """One RL step's inputs. ``rows`` [M, b, T] are ``algorithm.mini_batches`` (K) mini-batches
    of M / K micro-batch slots each, of which the first ``micro_batches`` are real (the same
    count in every mini-batch); the per-sequence fields [S] are indexed by
    ``rows.sequence``."""

    rows: TrainBatch
    rewards: Any  # [S] float32, the (shaped) outcome reward
    groups: Any  # [S] int32, the GRPO group (padding sequences form groups of their own)
    weights: Any  # [S] float32, the share of its episode a sequence is (`core.grpo_advantages`)
    minis: Any  # [S] int32, the mini-batch of each sequence (K for padding)
    micro_batches: Any  # [] int32
    # [k, T] int32: flat [M * b * T] positions of the traced tokens (-1: none); None: no traces
    trace_index: Any = None


def _real_micro_batches(batch: RLBatch, K: int) -> tuple[jax.Array, Callable[..., jax.Array]]:
    """How many micro-batches are real in all, and the slot of the i-th of them."""
    cap = batch.rows.mask.shape[0] // K
    real = batch.micro_batches
    per = jnp.maximum(real, 1)
    return K * real, lambda i: (i // per) * cap + i % per


def _map_real(spec: StepSpec, f: Callable[[TrainBatch], jax.Array], batch: RLBatch) -> jax.Array:
    """``f`` of each real micro-batch, [M, b, T] (0 in the padding slots, never computed)."""
    count, slot = _real_micro_batches(batch, spec.algo.mini_batches)
    out = jnp.zeros(batch.rows.mask.shape, jnp.float32)
    if spec.sharder is not None:
        out = spec.sharder.constrain(out, (None, "batch", None))

    def one(i: jax.Array, out: jax.Array) -> jax.Array:
        j = slot(i)
        return jax.lax.dynamic_update_index_in_dim(out, f(_micro_batch(batch.rows, j)), j, 0)

    return jax.lax.fori_loop(0, count, one, out)


def prepare(spec: StepSpec, state: LearnerState, batch: RLBatch) -> Derived:
    """The update's inputs, computed on the device: old-policy and reference logprobs (0 off
    the sampled tokens), and advantages: GRPO's group-normalised outcome of each sequence on
    its sampled tokens, or GAE over the critic's values with the outcome on each sequence's
    last sampled token (whitened over the batch; returns and old values kept)."""
    rows, a = batch.rows, spec.algo
    mask = rows.mask
    M, b, T = mask.shape
    S = batch.rewards.shape[0]
    sampled = mask > 0  # elsewhere a target may be outside top-k / top-p: -inf, stored as 0
    policy = state.policy.params
    old = jnp.where(
        sampled, _map_real(spec, lambda mb: token_stats(spec, policy, mb)[0], batch), 0.0
    )
    reference = state.reference
    ref = (
        jnp.zeros_like(old)
        if reference is None
        else jnp.where(
            sampled,
            _map_real(spec, lambda mb: token_stats(spec, reference, mb)[0], batch),
            0.0,
        )
    )
    if a.adv_estimator == "grpo":
        adv_n = core.grpo_advantages(
            batch.rewards, batch.groups, S, a.norm_adv_by_std, weights_n=batch.weights
        )
        zeros = jnp.zeros_like(old)
        return Derived(old, ref, adv_n[rows.sequence] * mask, zeros, zeros)
    assert state.critic is not None, "GAE needs a critic"
    critic = state.critic.params
    values = _map_real(spec, lambda mb: critic_values(spec, critic, mb), batch) * mask
    flat = lambda x: x.reshape(M * b, T)  # noqa: E731
    token_rewards = core.last_token_rewards(batch.rewards, flat(mask), flat(rows.sequence))
    adv, returns = core.gae_advantages(
        token_rewards, flat(values), flat(mask), a.gamma, a.lam, flat(rows.segment_ids)
    )
    adv = core.masked_whiten(adv, flat(mask)) * flat(mask)
    return Derived(old, ref, adv.reshape(M, b, T), values, returns.reshape(M, b, T))


def mini_batch_denominators(
    spec: StepSpec, rows: TrainBatch, minis: jax.Array, k: jax.Array | int
) -> Denominators:
    """The counts of mini-batch ``k``: its sampled tokens and its sequences with any."""
    S = minis.shape[0]
    seq_tokens = jax.ops.segment_sum(rows.mask.reshape(-1), rows.sequence.reshape(-1), S)
    mine = minis == k
    return Denominators(
        num_tokens=jnp.maximum(jnp.sum(jnp.where(mine, seq_tokens, 0.0)), 1.0),
        num_seqs=jnp.maximum(jnp.sum(mine & (seq_tokens > 0)).astype(jnp.float32), 1.0),
        norm_const=spec.norm_const or float(rows.mask.shape[-1]),
        num_sequences=S,
    )


def rl_update(
    spec: StepSpec,
    tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    state: LearnerState,
    batch: RLBatch,
) -> tuple[LearnerState, Metrics]:
    """`prepare`, then ``ppo_epochs`` passes of ``mini_batches`` updates (policy, then critic,
    on each mini-batch: its real micro-batches), on the device. Metrics: the mean over the
    updates, and the sampler-vs-learner logprob gap before the first."""
    a = spec.algo
    dv = prepare(spec, state, batch)
    rows = batch.rows
    if not spec.sampling.rollout_logprobs:  # the sampler gave none: the learner's stand in
        rows = dataclasses.replace(rows, rollout_logp=dv.old_logp)
    K, S = a.mini_batches, batch.rewards.shape[0]
    cap = rows.mask.shape[0] // K

    def one(
        carry: tuple[TrainState, TrainState | None], k: jax.Array
    ) -> tuple[tuple[TrainState, TrainState | None], Metrics]:
        policy, value = carry
        d = mini_batch_denominators(spec, rows, batch.minis, k)
        lo = k * cap
        hi = lo + batch.micro_batches
        policy, m = apply_update(policy_objective, spec, tx, policy, rows, dv, d, lo, hi)
        if value is not None:
            value, vm = apply_update(value_objective, spec, critic_tx, value, rows, dv, d, lo, hi)
            m = {**m, **{f"critic/{k}": v for k, v in vm.items()}}
        return (policy, value), m

    carry: tuple[TrainState, TrainState | None] = (state.policy, state.critic)
    epochs = []
    for _ in range(a.ppo_epochs):
        carry, m = jax.lax.scan(one, carry, jnp.arange(K))
        epochs.append(m)
    metrics = {k: jnp.mean(jnp.concatenate([m[k] for m in epochs])) for k in epochs[0]}
    gap = jnp.abs(dv.old_logp - rows.rollout_logp)
    metrics["logprob_gap/mean"] = core.masked_mean(gap, rows.mask)
    metrics["logprob_gap/max"] = jnp.max(jnp.where(rows.mask > 0, gap, 0.0))
    metrics["batch/sampled_tokens"] = jnp.sum(rows.mask)
    # per sequence [S] (not scalars: `Learner.train_step` groups them by staleness)
    metrics[_SEQ_GAP] = jax.ops.segment_sum(
        (gap * rows.mask).reshape(-1), rows.sequence.reshape(-1), S
    )
    metrics[_SEQ_TOKENS] = jax.ops.segment_sum(rows.mask.reshape(-1), rows.sequence.reshape(-1), S)
    if batch.trace_index is not None:  # a few tokens' values, gathered from what is computed
        at = jnp.maximum(batch.trace_index, 0)
        metrics[_TRACE_LOGP] = dv.old_logp.reshape(-1)[at]
        metrics[_TRACE_ADV] = dv.advantages.reshape(-1)[at]
    new = LearnerState(carry[0], carry[1], state.reference)
    return new, metrics


_SEQ_GAP, _SEQ_TOKENS = "sequences/logprob_gap_sum", "sequences/sampled_tokens"
_TRACE_LOGP, _TRACE_ADV = "learner_logprobs", "advantages"  # per traced token


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


def _with_rollout_logprobs(spec: StepSpec, given: bool) -> StepSpec:
    return dataclasses.replace(
        spec, sampling=dataclasses.replace(spec.sampling, rollout_logprobs=given)
    )


def _jit_keeping_layout(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``state, metrics = fn(state, batch)`` jitted with the state donated and returned laid
    out exactly as it came in (else the second call, fed the first call's output, would
    compile the step again); the layout is read at the first call."""
    compiled: list[Callable[..., Any]] = []

    def call(state: Any, batch: Any) -> Any:
        if not compiled:
            layout = jax.tree.map(lambda x: x.sharding, state)
            compiled.append(jax.jit(fn, donate_argnums=0, out_shardings=(layout, None)))
        return compiled[0](state, batch)

    return call


# ------------------------------------------------------------------------------ the class


class Learner:
    """Owns the learner's state (`LearnerState`) on a mesh and the jitted steps over it."""

    def __init__(
        self,
        model: ModelConfig,
        params: Weights,
        *,
        algo: AlgorithmSection,
        optim: OptimSection,
        sampling: SamplingSpec,
        compute_dtype: Literal["float32", "bfloat16"] = "float32",
        micro_batch_size: int = 8,
        remat: bool = False,
        sharder: Sharder | None = None,
        critic: Critic | None = None,
        reference: Weights | None = None,
        norm_const: float | None = None,
        lr: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        self.model = dataclasses.replace(model, dtype="float32")
        self.sharder = sharder
        self.micro_batch_size = micro_batch_size
        self.spec = StepSpec(self.model, compute_dtype, sampling, algo, remat, sharder, norm_const)
        self.tx = make_optimizer(optim.lr if lr is None else lr, optim, decay_steps)
        self.critic_tx = make_optimizer(optim.critic_lr, optim)
        self._param_shardings = None if sharder is None else param_shardings(self.model, sharder)
        policy = self._init_state(self.tx, self._place(cast_floats(params, jnp.float32)))
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
            frozen = frozen if sharder else jax.device_put(frozen, jax.devices()[0])
        self.state = LearnerState(policy, value, frozen)
        # micro-batches [M, b, T], per-sequence outcomes [S]: rows and sequences over `batch`
        self._batch_sharding = None if sharder is None else sharder.sharding((None, "batch", None))
        self._seq_sharding = None if sharder is None else sharder.sharding(("batch",))
        spec, tx, critic_tx = self.spec, self.tx, self.critic_tx
        self._rl_steps = {
            given: _jit_keeping_layout(
                partial(rl_update, _with_rollout_logprobs(spec, given), tx, critic_tx)
            )
            for given in (True, False)
        }  # each compiles on first use

        def sft(state: LearnerState, rows: TrainBatch) -> tuple[LearnerState, Metrics]:
            d = Denominators(jnp.maximum(rows.mask.sum(), 1.0), jnp.ones(()), 1.0, 1)
            M = rows.mask.shape[0]
            policy, m = apply_update(sft_objective, spec, tx, state.policy, rows, None, d, 0, M)
            return dataclasses.replace(state, policy=policy), m

        self._sft_step = _jit_keeping_layout(sft)

    # --- placement

    def _place(self, weights: Weights) -> Weights:
        if self._param_shardings is None:
            return weights
        return jax.device_put(weights, self._param_shardings)

    def _place_critic(self, critic: Critic) -> Critic:
        return Critic(self._place(critic.body), critic.head, critic.bias)

    def _replicated(self, x: Any) -> jax.Array:
        """A host value every process gives alike, on every device (one device unsharded)."""
        if self.sharder is None:
            return jax.device_put(np.asarray(x))
        replicated = self.sharder.sharding(())
        # `device_put` builds a broken array when a process has one device
        return jax.make_array_from_process_local_data(replicated, np.asarray(x))

    def _init_state(self, tx: optax.GradientTransformation, params: Any) -> TrainState:
        # eager init: each Adam moment is a zeros_like of its parameter, laid out the same way
        state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
        if self.sharder is None:  # committed to the device, as the step's outputs are
            return jax.device_put(state, jax.devices()[0])
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
    def _upload(tree: Any, sharding: NamedSharding | None, axis: int) -> Any:
        """This process's share (along ``axis``) of every leaf onto the devices as global
        arrays."""
        if sharding is None:
            return jax.device_put(tree)
        processes = jax.process_count()

        def place(x: np.ndarray) -> jax.Array:
            shape = list(x.shape)
            shape[axis] *= processes
            return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

        return jax.tree.map(place, tree)

    # --- public steps

    @property
    def params(self) -> Weights:
        return self.state.policy.params

    def rollout_params(self, dtype: str) -> Weights:
        """The policy in the rollout backend's dtype (what `update_weights` receives): new
        buffers always, never the train state's own, which the next update donates (an
        engine still serving them, as rollouts do during an asynchronous update, would read
        freed memory)."""
        want = jnp.dtype(dtype)
        with device_turns.TURN:
            return jax.block_until_ready(
                jax.tree.map(
                    lambda x: jnp.copy(x) if x.dtype == want else cast_floats(x, want),
                    self.params,
                )
            )

    def train_step(
        self,
        batch: TrainBatch,
        sequences: Sequences,
        micro_batches: int,
        rollout_logprobs: bool = True,
        staleness: np.ndarray | None = None,
    ) -> dict[str, float]:
        """`traced_step` tracing no token: its metrics."""
        args = (batch, sequences, micro_batches, None, rollout_logprobs, staleness)
        return self.traced_step(*args)[0]

    def traced_step(
        self,
        batch: TrainBatch,
        sequences: Sequences,
        micro_batches: int,
        trace_index: np.ndarray | None,
        rollout_logprobs: bool = True,
        staleness: np.ndarray | None = None,
    ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """One RL update (`rl_update`) of this process's host rows ``batch``: K mini-batches
        (``algorithm.mini_batches``) of the same number of micro-batch slots, whose first
        ``micro_batches`` are real (see `RLBatch`; every process passes the same count and
        shapes), with its sequences' outcomes [S] (``batch.sequence`` indexes them from this
        process's first, ``process_index * S``). The batch crosses to the devices once, is
        prepared and trained on there, and only the metrics come back.
        ``rollout_logprobs=False``: the batch's rollout logprobs are not the sampler's (its
        backend reports none); the learner's old-policy logprobs take their place, and
        ``rollout/logprobs_recomputed`` is 1. ``staleness`` [S] (how many weight versions each
        sequence's oldest token is behind the policy) adds the gap per staleness
        (`gap_by_staleness`; one process only: the metrics' sequences are every process's).

        ``trace_index`` [k, T] (one process only): positions in ``batch``'s rows, flattened, of
        the tokens whose learner logprob and advantage come back (-1: none), [k, T] each under
        ``learner_logprobs`` and ``advantages``: the update's own values, gathered on the
        device, so that tracing a few trajectories adds two gathers and a small copy."""
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
            device = RLBatch(
                self.device_batch(batch, local=True),
                rewards,
                groups,
                weights,
                minis,
                self._replicated(np.int32(micro_batches)),
                None if trace_index is None else self._replicated(trace_index.astype(np.int32)),
            )
            self.state, metrics = self._rl_steps[rollout_logprobs](self.state, device)
            # the per-sequence arrays are spread over the processes' devices: one process reads
            seq = metrics.pop(_SEQ_GAP), metrics.pop(_SEQ_TOKENS)
            traced = {
                k: np.asarray(metrics.pop(k)) for k in (_TRACE_LOGP, _TRACE_ADV) if k in metrics
            }
            out = {k: float(v) for k, v in jax.device_get(metrics).items()}
            # the metrics come from one device; the update may still run on the others, and
            # the turn must not pass before it is done everywhere (`device_turns`)
            jax.block_until_ready(self.state)
        if not out["batch/sampled_tokens"] or not rollout_logprobs:  # no gap to report
            del out["logprob_gap/mean"], out["logprob_gap/max"]
        elif staleness is not None and jax.process_count() == 1:
            seq_gap, seq_tokens = (np.asarray(x) for x in seq)
            out.update(gap_by_staleness(seq_gap, seq_tokens, np.asarray(staleness)))
        out["rollout/logprobs_recomputed"] = float(not rollout_logprobs)
        return out, traced

    def update_sft(self, batch: TrainBatch) -> dict[str, float]:
        self.state, metrics = self._sft_step(self.state, self.device_batch(batch))
        return {k: float(v) for k, v in metrics.items()}


def critic_from_policy(params: Weights) -> Critic:
    """A critic initialised from the policy's body with a zero head (verl's default)."""
    D = params.final_norm.shape[0]
    return Critic(
        body=jax.tree.map(jnp.copy, params),
        head=jnp.zeros((D,), jnp.float32),
        bias=jnp.zeros((), jnp.float32),
    )
