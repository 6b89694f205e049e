"""The RL update as one device program: ``state, metrics = rl_update(state, batch)``.

The state (`LearnerState`: policy, critic, reference) stays on the devices; the batch
(`RLBatch`: token rows and the sequences' rewards and GRPO groups) is uploaded once;
old-policy and reference logprobs, critic values and advantages (`prepare`) and every PPO
epoch's mini-batch updates run on the devices, over the real micro-batches only (a loop whose
trip count the batch carries: the shapes, and so the compiled program, change only when a
step needs more micro-batch slots than any before); only the metrics come back to the host.
One update loops over its micro-batches, sums their gradients (`accumulated_grads`) and
applies one optimizer step (`apply_update`), unless its loss or gradient norm is not finite:
then the weights and the optimizer's state stay as they were (``nonfinite_updates`` counts
such updates), decided on the device, so that a NaN never reaches the weights the engine gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_agent_rl.config import OptimSection
from jax_agent_rl.models import Policy, Weights
from jax_agent_rl.models.moe import NO_EXPERTS
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import TrainBatch
from jax_agent_rl.rl.objectives import (
    Critic,
    Denominators,
    Derived,
    Metrics,
    Objective,
    StepSpec,
    critic_values,
    own_routing_stats,
    policy_objective,
    token_stats,
    value_objective,
)

# the per-sequence metrics [S] `rl_update` returns besides the scalars
SEQ_GAP, SEQ_TOKENS = "sequences/logprob_gap_sum", "sequences/sampled_tokens"
# per token [M, b, T], the update's own values before it steps (what a trace shows)
TRACE_LOGP, TRACE_ADV, TRACE_ENT = "learner_logprobs", "advantages", "learner_entropy"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """A trained model: ``params`` (a policy's `Weights` or a `Critic`, float32), the
    optimizer's state of its `trainable` part, and the update count."""

    params: Any
    opt_state: Any
    step: jax.Array


def trainable(policy: Policy, params: Any) -> Any:
    """What the optimizer updates in ``params``: an adapted (LoRA) policy's adapters only
    (its base weights frozen: no gradient, no optimizer state), else every parameter; a
    `Critic` trains whole."""
    return params if isinstance(params, Critic) else policy.trained(params)


def with_trained(policy: Policy, params: Any, part: Any) -> Any:
    """``params`` with its `trainable` part replaced by ``part``."""
    return part if isinstance(params, Critic) else policy.with_trained(params, part)


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


def _micro_batch(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


# the named scopes of the loops over one update's real micro-batches and over every real
# micro-batch of the step (`prepare`): their trip counts are known on the device only, so a
# reader of the compiled program (`plan.hlo`) finds them by these names
MICRO_BATCHES, ALL_MICRO_BATCHES = "micro_batches", "all_micro_batches"

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
    m = spec.policy
    grad_fn = jax.value_and_grad(
        lambda t, mb, dv: objective(spec, with_trained(m, params, t), mb, dv, d), has_aux=True
    )

    def step(i: jax.Array, carry: tuple[jax.Array, Any, Metrics]) -> tuple[Any, Any, Metrics]:
        loss, grads, metrics = carry
        mb, dv = _micro_batch(rows, i), _micro_batch(derived, i)
        (mb_loss, mb_m), g = grad_fn(trainable(m, params), mb, dv)
        w = mb.mask.sum() / d.num_tokens
        metrics = {k: metrics[k] + (mb_m[k] if k in LOSS_TERMS else w * mb_m[k]) for k in metrics}
        return loss + mb_loss, jax.tree.map(jnp.add, grads, g), metrics

    zero = jnp.zeros((), jnp.int32)
    mb0, dv0 = _micro_batch(rows, zero), _micro_batch(derived, zero)
    metric_shapes = jax.eval_shape(lambda: objective(spec, params, mb0, dv0, d)[1])
    zero_metrics = {k: jnp.zeros((), jnp.float32) for k in metric_shapes}
    zero_grads = jax.tree.map(jnp.zeros_like, trainable(m, params))
    init = (jnp.zeros((), jnp.float32), zero_grads, zero_metrics)
    with jax.named_scope(MICRO_BATCHES):  # the loop's count is the device's: named for a plan
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
    """One optimizer step of ``objective``'s gradients over micro-batches [lo, hi), or none
    when the loss or the gradient norm is not finite (a NaN or inf from the batch: a huge
    reward scale, a logprob of a token the policy gives probability 0): Adam would write NaN
    into every weight and moment, for good, and push them to the engine. The choice is a
    `jnp.where` over the trees, on the device (no host sync); ``nonfinite_updates`` is 1 for
    a skipped one, and the update count does not advance."""
    loss, grads, metrics = accumulated_grads(
        objective, spec, state.params, rows, derived, d, lo, hi
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    trained = trainable(spec.policy, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, trained)

    def kept(new: Any, old: Any) -> Any:
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    stepped = kept(optax.apply_updates(trained, updates), trained)
    params = with_trained(spec.policy, state.params, stepped)
    opt_state = kept(opt_state, state.opt_state)
    metrics = {
        **metrics,
        "loss": loss,
        "grad_norm": grad_norm,
        "nonfinite_updates": (~finite).astype(jnp.float32),
    }
    return TrainState(params, opt_state, state.step + finite.astype(state.step.dtype)), metrics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnerState:
    """Every array the learner trains with: the policy's train state, the critic's (GAE) and
    the KL reference (frozen). One pytree: a step is ``state, metrics = step(state, batch)``."""

    policy: TrainState
    critic: TrainState | None = None
    reference: Any | None = None  # Weights; a LoRA policy's is its own base (`reference_of`)


def reference_of(spec: StepSpec, state: LearnerState) -> Weights | None:
    """The KL reference's weights: an adapted (LoRA) policy's base, its adapters left out (the same
    arrays, no copy), else the frozen copy ``state.reference`` (``None``: no KL term)."""
    policy = spec.policy
    if policy.adapted and spec.algo.kl_coef:
        return policy.base(state.policy.params)
    return state.reference


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
    # [S] float32, each sequence's step-level advantage (GiGPO, Tree-GRPO: rl/steps.py), or None
    step_advantages: Any = None


def _real_micro_batches(batch: RLBatch, K: int) -> tuple[jax.Array, Callable[..., jax.Array]]:
    """How many micro-batches are real in all, and the slot of the i-th of them."""
    cap = batch.rows.mask.shape[0] // K
    real = batch.micro_batches
    per = jnp.maximum(real, 1)
    return K * real, lambda i: (i // per) * cap + i % per


def _map_real(
    spec: StepSpec,
    f: Callable[[TrainBatch], tuple[jax.Array, ...]],
    batch: RLBatch,
    n: int = 1,
) -> tuple[jax.Array, ...]:
    """Each of ``f``'s ``n`` [b, T] outputs over the real micro-batches, [M, b, T] (0 in the
    padding slots, never computed)."""
    count, slot = _real_micro_batches(batch, spec.algo.mini_batches)
    zeros = jnp.zeros(batch.rows.mask.shape, jnp.float32)
    zeros = spec.sharder.constrain(zeros, (None, "batch", None))

    def one(i: jax.Array, out: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        j = slot(i)
        values = f(_micro_batch(batch.rows, j))
        return tuple(
            jax.lax.dynamic_update_index_in_dim(o, v, j, 0)
            for o, v in zip(out, values, strict=True)
        )

    with jax.named_scope(ALL_MICRO_BATCHES):
        return jax.lax.fori_loop(0, count, one, (zeros,) * n)


def _policy_stats(
    spec: StepSpec, policy: Any, batch: RLBatch, kept: int
) -> tuple[tuple[jax.Array, ...], Metrics]:
    """The policy's logprob (and with ``kept`` 2 its entropy) of each target, [M, b, T] each,
    routed as ``algorithm.routing_replay`` says; for a batch carrying sampled experts, also
    the routing metrics (`routing_metrics`), from a second forward under the other routing."""
    if batch.rows.expert_ids is None:
        return _map_real(spec, lambda mb: token_stats(spec, policy, mb)[:kept], batch, kept), {}

    def both(mb: TrainBatch) -> tuple[jax.Array, ...]:
        replayed = token_stats(spec, policy, mb, replay=True)
        *own, differs = own_routing_stats(spec, policy, mb)
        chosen = replayed if spec.algo.routing_replay else own
        return (*chosen[:kept], replayed[0], own[0], differs)

    *stats, replayed, own, differs = _map_real(spec, both, batch, kept + 3)
    return tuple(stats), routing_metrics(batch.rows, replayed, own, differs)


def routing_metrics(
    rows: TrainBatch, replayed: jax.Array, own: jax.Array, differs: jax.Array
) -> Metrics:
    """Over the sampled tokens whose experts the sampler kept: the share whose experts the
    policy's own routing changes in some sparse layer (``routing/differs``), and the mean
    |sampler - learner| logprob gap with the sampler's experts replayed and with the policy's
    own routing (``routing/logprob_gap_replayed``, ``routing/logprob_gap_own``)."""
    assert rows.expert_ids is not None
    tokens = rows.mask * (rows.expert_ids[..., 0, 0] != NO_EXPERTS)
    return {
        "routing/differs": core.masked_mean(differs, tokens),
        "routing/logprob_gap_replayed": core.masked_mean(
            jnp.abs(replayed - rows.rollout_logp), tokens
        ),
        "routing/logprob_gap_own": core.masked_mean(jnp.abs(own - rows.rollout_logp), tokens),
    }


def prepare(spec: StepSpec, state: LearnerState, batch: RLBatch) -> tuple[Derived, Metrics]:
    """The update's inputs, computed on the device: old-policy and reference logprobs (0 off
    the sampled tokens), and advantages: GRPO's group-normalised outcome of each sequence on
    its sampled tokens, or GAE over the critic's values with the outcome on each sequence's
    last sampled token (whitened over the batch; returns and old values kept). Also the
    routing metrics of a batch carrying sampled experts (`routing_metrics`)."""
    rows, a = batch.rows, spec.algo
    mask = rows.mask
    M, b, T = mask.shape
    S = batch.rewards.shape[0]
    sampled = mask > 0  # elsewhere a target may be outside top-k / top-p: -inf, stored as 0
    policy = state.policy.params
    stats, routing = _policy_stats(spec, policy, batch, 2)
    old, ent = (jnp.where(sampled, x, 0.0) for x in stats)
    reference = reference_of(spec, state)
    ref = (
        jnp.zeros_like(old)
        if reference is None
        else jnp.where(
            sampled,
            _map_real(spec, lambda mb: token_stats(spec, reference, mb)[:1], batch)[0],
            0.0,
        )
    )
    if a.adv_estimator != "gae":
        adv_n = core.grpo_advantages(
            batch.rewards, batch.groups, S, a.norm_adv_by_std, weights_n=batch.weights
        )
        if a.adv_estimator in ("gigpo", "tree_grpo"):  # + omega * the turn's step advantage
            assert batch.step_advantages is not None, f"{a.adv_estimator} without step advantages"
            adv_n = adv_n + a.step_adv_coef * batch.step_advantages
        zeros = jnp.zeros_like(old)
        return Derived(old, ref, adv_n[rows.sequence] * mask, zeros, zeros, ent), routing
    assert state.critic is not None, "GAE needs a critic"
    critic = state.critic.params
    values = _map_real(spec, lambda mb: (critic_values(spec, critic, mb),), batch)[0] * mask
    flat = lambda x: x.reshape(M * b, T)  # noqa: E731
    token_rewards = core.last_token_rewards(batch.rewards, flat(mask), flat(rows.sequence))
    adv, returns = core.gae_advantages(
        token_rewards, flat(values), flat(mask), a.gamma, a.lam, flat(rows.segment_ids)
    )
    adv = core.masked_whiten(adv, flat(mask)) * flat(mask)
    derived = Derived(old, ref, adv.reshape(M, b, T), values, returns.reshape(M, b, T), ent)
    return derived, routing


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
    dv, routing = prepare(spec, state, batch)
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
    # one scan over every update, epoch after epoch: the program holds the update once, so its
    # compile time does not grow with ppo_epochs
    updates = jnp.arange(a.ppo_epochs * K) % K
    carry, m = jax.lax.scan(one, carry, updates)
    # means over the updates; the skipped ones counted (`apply_update`)
    metrics = {
        k: (jnp.sum if k.endswith("nonfinite_updates") else jnp.mean)(v) for k, v in m.items()
    }
    gap = jnp.abs(dv.old_logp - rows.rollout_logp)
    metrics["logprob_gap/mean"] = core.masked_mean(gap, rows.mask)
    metrics["logprob_gap/max"] = jnp.max(jnp.where(rows.mask > 0, gap, 0.0))
    metrics["batch/sampled_tokens"] = jnp.sum(rows.mask)
    metrics.update(routing)
    # per sequence [S] (not scalars: `Learner.rl_update` groups them by staleness)
    metrics[SEQ_GAP] = jax.ops.segment_sum(
        (gap * rows.mask).reshape(-1), rows.sequence.reshape(-1), S
    )
    metrics[SEQ_TOKENS] = jax.ops.segment_sum(rows.mask.reshape(-1), rows.sequence.reshape(-1), S)
    # every token's (a trace hook picks its trajectories' out of them, on the host)
    metrics[TRACE_LOGP], metrics[TRACE_ADV] = dv.old_logp, dv.advantages
    metrics[TRACE_ENT] = dv.entropy
    new = LearnerState(carry[0], carry[1], state.reference)
    return new, metrics
