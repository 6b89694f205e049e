"""The sharded JAX learner: logprob recomputation, policy / critic / SFT updates.

Master weights and AdamW state are float32; the forward and backward run in the compute dtype
(``float32`` or ``bfloat16``: the parameters are cast inside the differentiated function, so
gradients arrive in float32). A batch of B rows is split on the host into M micro-batches of
``micro_batch_size`` rows, laid out ``[M, b, T]`` with ``b`` sharded over the mesh's
(data, fsdp) axes; one jitted step scans the micro-batches, sums their gradients and applies
one optimizer update. Every loss term is aggregated with *whole-batch* denominators (token
and sequence counts of all M micro-batches), so the accumulated gradient equals the gradient of
the whole batch at once.

An RL step is one program (`Learner.train_step`, `rl_update`): the batch is uploaded once
with the rows' rewards and GRPO groups; old-policy and reference logprobs, critic values and
advantages (`prepare`) and every PPO epoch's mini-batch updates (a scan) run on the devices;
only the metrics come back to the host.

Logprobs are recomputed with `sampling_logprobs`, the function the engine samples with, under
the rollout's temperature / top-k / top-p, so learner and sampler logprobs compare token for
token (`Learner.logprobs`); without top-k / top-p, by `head_logprobs`, the same numbers a chunk
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
from jax_agent_rl.rl.batch import TrainBatch

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

    def hidden(self, weights: Weights, mb: TrainBatch) -> tuple[jax.Array, Weights]:
        """Final hidden states [B, T, D] and the weights cast to the compute dtype."""
        w = cast_floats(weights, jnp.float32 if self.compute_dtype == "float32" else jnp.bfloat16)
        h = forward(
            w, self.model, mb.tokens, mb.positions, mb.segment_ids, self.sharder, self.remat
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
class Denominators:
    """Whole-batch counts every micro-batch aggregates with."""

    num_tokens: jax.Array
    num_seqs: jax.Array
    norm_const: float = dataclasses.field(metadata=dict(static=True))


def denominators(batch: TrainBatch) -> Denominators:
    """Counts over a [M, b, T] batch (mask-token count, sequences with any mask token)."""
    mask = batch.mask
    return Denominators(
        num_tokens=jnp.maximum(mask.sum(), 1.0),
        num_seqs=jnp.maximum(jnp.any(mask > 0, axis=-1).sum(), 1.0),
        norm_const=float(mask.shape[-1]),
    )


def policy_objective(
    spec: StepSpec, params: Weights, mb: TrainBatch, d: Denominators
) -> tuple[jax.Array, Metrics]:
    """PPO-clip policy loss (+ KL to the reference, - entropy bonus) of one micro-batch."""
    a = spec.algo
    counts: dict[str, Any] = dict(
        num_tokens=d.num_tokens,
        num_seqs=d.num_seqs,
        norm_const=d.norm_const,
    )
    logp, entropy = token_stats(spec, params, mb)
    is_fn = core.masked_is_weights if a.tis_mode == "mask" else core.truncated_is_weights
    is_weights = (
        None if a.tis_cap is None else is_fn(mb.old_logp, mb.rollout_logp, mb.mask, a.tis_cap)
    )
    pg_loss, m = core.policy_loss(
        logp,
        mb.old_logp,
        mb.advantages,
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
            core.kl_penalty(logp, mb.ref_logp, a.kl_kind), mb.mask, a.loss_agg_mode, **counts
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
    spec: StepSpec, critic: Critic, mb: TrainBatch, d: Denominators
) -> tuple[jax.Array, Metrics]:
    values = critic_values(spec, critic, mb)
    loss, m = core.value_loss(
        values,
        mb.old_values,
        mb.returns,
        mb.mask,
        clip_range=spec.algo.vf_clip,
        agg_mode=spec.algo.loss_agg_mode,
        num_tokens=d.num_tokens,
        num_seqs=d.num_seqs,
        norm_const=d.norm_const,
    )
    return loss, {"vf_loss": loss, **m}


def sft_objective(
    spec: StepSpec, params: Weights, mb: TrainBatch, d: Denominators
) -> tuple[jax.Array, Metrics]:
    """Masked cross-entropy of the sampled (model) tokens, token-mean over the whole batch."""
    logp, _ = token_stats(spec, params, mb)
    loss = -(logp * mb.mask).sum() / d.num_tokens
    return loss, {"sft_loss": loss}


Objective = Callable[[StepSpec, Any, TrainBatch, Denominators], tuple[jax.Array, Metrics]]


def accumulated_grads(
    objective: Objective, spec: StepSpec, params: Any, batch: TrainBatch
) -> tuple[jax.Array, Any, Metrics]:
    """Loss, gradient and metrics of a [M, b, T] batch, scanning its M micro-batches.

    Loss terms are sums with whole-batch denominators, so they add up over micro-batches;
    metrics (masked means within a micro-batch) are averaged weighted by mask tokens.
    """
    d = denominators(batch)
    grad_fn = jax.value_and_grad(lambda p, mb: objective(spec, p, mb, d), has_aux=True)

    def step(carry: tuple[jax.Array, Any, Metrics], mb: TrainBatch) -> tuple[Any, None]:
        loss, grads, metrics = carry
        (mb_loss, m), g = grad_fn(params, mb)
        w = mb.mask.sum() / d.num_tokens
        metrics = {k: metrics[k] + w * m[k] for k in metrics}
        return (loss + mb_loss, jax.tree.map(jnp.add, grads, g), metrics), None

    first = jax.tree.map(lambda x: x[0], batch)
    metric_shapes = jax.eval_shape(lambda: objective(spec, params, first, d)[1])
    zero_metrics = {k: jnp.zeros((), jnp.float32) for k in metric_shapes}
    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), zero_metrics)
    (loss, grads, metrics), _ = jax.lax.scan(step, init, batch)
    return loss, grads, metrics


def apply_update(
    objective: Objective,
    spec: StepSpec,
    tx: optax.GradientTransformation,
    state: TrainState,
    batch: TrainBatch,
) -> tuple[TrainState, Metrics]:
    loss, grads, metrics = accumulated_grads(objective, spec, state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outcomes:
    """Per-row outcomes of a [M, b] batch: the (shaped) reward, and the GRPO group of the row
    (an index; the rows of one prompt share it, padding rows form a group of their own)."""

    rewards: Any  # [M, b] float32 (numpy on the host, jax.Array on the devices)
    groups: Any  # [M, b] int32
    weights: Any  # [M, b] float32: the share of its episode a row is (`core.grpo_advantages`)


def prepare(
    spec: StepSpec,
    params: Weights,
    reference: Weights | None,
    critic: Critic | None,
    batch: TrainBatch,
    outcomes: Outcomes,
) -> TrainBatch:
    """The update's inputs, computed on the device from a [M, b, T] batch: old-policy and
    reference logprobs (0 off the sampled tokens), and advantages: GRPO's group-normalised
    outcome broadcast over the row's sampled tokens, or GAE over the critic's values with the
    outcome on each row's last sampled token (whitened; returns and old values kept)."""
    mask, a = batch.mask, spec.algo
    M, b, T = mask.shape
    sampled = mask > 0  # elsewhere a target may be outside top-k / top-p: -inf, stored as 0
    old = jnp.where(sampled, jax.lax.map(lambda mb: token_stats(spec, params, mb)[0], batch), 0.0)
    ref = (
        batch.ref_logp
        if reference is None
        else jnp.where(
            sampled, jax.lax.map(lambda mb: token_stats(spec, reference, mb)[0], batch), 0.0
        )
    )
    if a.adv_estimator == "grpo":
        adv_n = core.grpo_advantages(
            outcomes.rewards.reshape(M * b),
            outcomes.groups.reshape(M * b),
            M * b,
            a.norm_adv_by_std,
            weights_n=outcomes.weights.reshape(M * b),
        )
        return dataclasses.replace(
            batch, old_logp=old, ref_logp=ref, advantages=adv_n.reshape(M, b, 1) * mask
        )
    assert critic is not None, "GAE needs a critic"
    values = jax.lax.map(lambda mb: critic_values(spec, critic, mb), batch) * mask
    flat_mask = mask.reshape(M * b, T)
    token_rewards = core.last_token_rewards(outcomes.rewards.reshape(M * b), flat_mask)
    adv, returns = core.gae_advantages(
        token_rewards, values.reshape(M * b, T), flat_mask, a.gamma, a.lam
    )
    adv = core.masked_whiten(adv, flat_mask) * flat_mask
    return dataclasses.replace(
        batch,
        old_logp=old,
        ref_logp=ref,
        advantages=adv.reshape(M, b, T),
        returns=returns.reshape(M, b, T),
        old_values=values,
    )


def rl_update(
    spec: StepSpec,
    tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    state: TrainState,
    critic_state: TrainState | None,
    reference: Weights | None,
    batch: TrainBatch,
    outcomes: Outcomes,
) -> tuple[TrainState, TrainState | None, Metrics]:
    """`prepare`, then ``ppo_epochs`` passes of ``mini_batches`` updates (policy, then critic,
    on each mini-batch: consecutive micro-batches), scanned on the device. Metrics: the mean
    over the updates, and the sampler-vs-learner logprob gap before the first."""
    a = spec.algo
    critic = None if critic_state is None else critic_state.params
    batch = prepare(spec, state.params, reference, critic, batch, outcomes)
    if not spec.sampling.rollout_logprobs:  # the sampler gave none: the learner's stand in
        batch = dataclasses.replace(batch, rollout_logp=batch.old_logp)
    K = a.mini_batches
    minis = jax.tree.map(lambda x: x.reshape(K, x.shape[0] // K, *x.shape[1:]), batch)

    def one(
        carry: tuple[TrainState, TrainState | None], mini: TrainBatch
    ) -> tuple[tuple[TrainState, TrainState | None], Metrics]:
        policy, value = carry
        policy, m = apply_update(policy_objective, spec, tx, policy, mini)
        if value is not None:
            value, vm = apply_update(value_objective, spec, critic_tx, value, mini)
            m = {**m, **{f"critic/{k}": v for k, v in vm.items()}}
        return (policy, value), m

    carry: tuple[TrainState, TrainState | None] = (state, critic_state)
    epochs = []
    for _ in range(a.ppo_epochs):
        carry, m = jax.lax.scan(one, carry, minis)
        epochs.append(m)
    metrics = {k: jnp.mean(jnp.concatenate([m[k] for m in epochs])) for k in epochs[0]}
    gap = jnp.abs(batch.old_logp - batch.rollout_logp)
    metrics["logprob_gap/mean"] = core.masked_mean(gap, batch.mask)
    metrics["logprob_gap/max"] = jnp.max(jnp.where(batch.mask > 0, gap, 0.0))
    metrics["batch/sampled_tokens"] = jnp.sum(batch.mask)
    # per row [M, b] (not scalars: `Learner.train_step` groups them by the rows' staleness)
    metrics[_ROW_GAP] = jnp.sum(gap * batch.mask, axis=-1)
    metrics[_ROW_TOKENS] = jnp.sum(batch.mask, axis=-1)
    return carry[0], carry[1], metrics


_ROW_GAP, _ROW_TOKENS = "rows/logprob_gap_sum", "rows/sampled_tokens"


def gap_by_staleness(
    row_gap: np.ndarray, row_tokens: np.ndarray, row_staleness: np.ndarray
) -> dict[str, float]:
    """``logprob_gap/staleness_<k>``: the mean sampler-vs-learner logprob gap over the sampled
    tokens of the rows ``k`` weight versions behind the policy (rows without tokens skipped)."""
    out = {}
    for k in np.unique(row_staleness):
        rows = (row_staleness == k) & (row_tokens > 0)
        if rows.any():
            out[f"logprob_gap/staleness_{int(k)}"] = float(
                row_gap[rows].sum() / row_tokens[rows].sum()
            )
    return out


def _with_rollout_logprobs(spec: StepSpec, given: bool) -> StepSpec:
    return dataclasses.replace(
        spec, sampling=dataclasses.replace(spec.sampling, rollout_logprobs=given)
    )


def _jit_keeping_layout(fn: Callable[..., Any], states: int) -> Callable[..., Any]:
    """``fn`` jitted with its first ``states`` arguments (train states) donated and returned
    first, laid out exactly as they came in (else the second call, fed the first call's
    output, would compile the step again); the layout is read at the first call."""
    compiled: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not compiled:
            layout = jax.tree.map(lambda x: x.sharding, args[:states])
            donate = tuple(range(states))
            compiled.append(jax.jit(fn, donate_argnums=donate, out_shardings=(*layout, None)))
        return compiled[0](*args)

    return call


# ------------------------------------------------------------------------------ the class


class Learner:
    """Owns the policy (and critic) train states on a mesh and the jitted steps over them."""

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
        lr: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        self.model = dataclasses.replace(model, dtype="float32")
        self.sharder = sharder
        self.micro_batch_size = micro_batch_size
        self.spec = StepSpec(self.model, compute_dtype, sampling, algo, remat, sharder)
        self.tx = make_optimizer(optim.lr if lr is None else lr, optim, decay_steps)
        self.critic_tx = make_optimizer(optim.critic_lr, optim)
        self._param_shardings = None if sharder is None else param_shardings(self.model, sharder)
        self.state = self._init_state(self.tx, self._place(cast_floats(params, jnp.float32)))
        self.critic_state = (
            None
            if critic is None
            else self._init_state(
                self.critic_tx, self._place_critic(cast_floats(critic, jnp.float32))
            )
        )
        # micro-batches [M, b, T] and per-row outcomes [M, b]: the rows split over `batch`
        self._batch_sharding = None if sharder is None else sharder.sharding((None, "batch", None))
        self._row_sharding = None if sharder is None else sharder.sharding((None, "batch"))
        # lax.map: one micro-batch's logits live at a time
        self._logprobs = jax.jit(
            lambda p, batch: jax.lax.map(lambda mb: token_stats(self.spec, p, mb)[0], batch)
        )
        self._values = jax.jit(
            lambda c, batch: jax.lax.map(lambda mb: critic_values(self.spec, c, mb), batch)
        )
        spec, tx, critic_tx = self.spec, self.tx, self.critic_tx
        self._rl_steps = {
            given: _jit_keeping_layout(
                partial(rl_update, _with_rollout_logprobs(spec, given), tx, critic_tx), states=2
            )
            for given in (True, False)
        }  # each compiles on first use
        self._policy_step = _jit_keeping_layout(
            lambda s, b: apply_update(policy_objective, spec, tx, s, b), states=1
        )
        self._critic_step = _jit_keeping_layout(
            lambda s, b: apply_update(value_objective, spec, critic_tx, s, b), states=1
        )
        self._sft_step = _jit_keeping_layout(
            lambda s, b: apply_update(sft_objective, spec, tx, s, b), states=1
        )

    # --- placement

    def _place(self, weights: Weights) -> Weights:
        if self._param_shardings is None:
            return weights
        return jax.device_put(weights, self._param_shardings)

    def _place_critic(self, critic: Critic) -> Critic:
        return Critic(self._place(critic.body), critic.head, critic.bias)

    def _init_state(self, tx: optax.GradientTransformation, params: Any) -> TrainState:
        # eager init: each Adam moment is a zeros_like of its parameter, laid out the same way
        state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
        if self.sharder is None:
            return state
        # the counters (scalars on one device) replicated over the mesh, the same value given
        # by every process (`device_put` builds a broken array when a process has one device)
        replicated = self.sharder.sharding(())

        def place(x: jax.Array) -> jax.Array:
            if isinstance(x.sharding, NamedSharding):
                return x
            return jax.make_array_from_process_local_data(replicated, np.asarray(x))

        return jax.tree.map(place, state)

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
        return self._upload(split, self._batch_sharding)

    @staticmethod
    def _upload(tree: Any, sharding: NamedSharding | None) -> Any:
        """This process's rows (axis 1) of every leaf onto the devices as global arrays."""
        if sharding is None:
            return jax.device_put(tree)
        processes = jax.process_count()

        def place(x: np.ndarray) -> jax.Array:
            shape = (x.shape[0], x.shape[1] * processes, *x.shape[2:])
            return jax.make_array_from_process_local_data(sharding, x, shape)

        return jax.tree.map(place, tree)

    # --- public steps

    @property
    def params(self) -> Weights:
        return self.state.params

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
                    self.state.params,
                )
            )

    def logprobs(self, batch: TrainBatch, params: Weights | None = None) -> np.ndarray:
        """[B, T] logprobs of every target under ``params`` (default: the current policy)."""
        out = self._logprobs(
            self.state.params if params is None else params, self.device_batch(batch)
        )
        return np.asarray(out).reshape(batch.shape)

    def values(self, batch: TrainBatch) -> np.ndarray:
        assert self.critic_state is not None, "this learner has no critic"
        out = self._values(self.critic_state.params, self.device_batch(batch))
        return np.asarray(out).reshape(batch.shape)

    def train_step(
        self,
        batch: TrainBatch,
        rewards: np.ndarray,
        groups: np.ndarray,
        reference: Weights | None = None,
        rollout_logprobs: bool = True,
        row_staleness: np.ndarray | None = None,
        weights: np.ndarray | None = None,
    ) -> dict[str, float]:
        """One RL update (`rl_update`) of this process's host rows ``batch`` [B, T] (see
        `device_batch`) with the rows' rewards and group indices [B] (groups numbered across
        processes): the batch crosses to the devices once, is prepared and trained on there,
        and only the metrics come back. ``rollout_logprobs=False``: the batch's rollout
        logprobs are not the sampler's (its backend reports none); the learner's old-policy
        logprobs take their place, and ``rollout/logprobs_recomputed`` is 1. ``row_staleness``
        (how many weight versions each row's oldest token is behind the policy, padding rows
        included) adds the gap per staleness (`gap_by_staleness`; one process only: the
        metrics' rows are every process's). ``weights`` [B] (default 1): the share of its
        episode each row is, for GRPO's group statistics (`core.grpo_advantages`)."""
        if row_staleness is not None and len(row_staleness) != len(rewards):
            raise ValueError(f"{len(row_staleness)} staleness values for {len(rewards)} rows")
        with device_turns.TURN:  # an engine's thread may share the devices (async training)
            metrics = self._train_step(
                batch, rewards, groups, reference, rollout_logprobs, row_staleness, weights
            )
            # the metrics come from one device; the update may still run on the others, and
            # the turn must not pass before it is done everywhere (`device_turns`)
            jax.block_until_ready((self.state, self.critic_state))
            return metrics

    def _train_step(
        self,
        batch: TrainBatch,
        rewards: np.ndarray,
        groups: np.ndarray,
        reference: Weights | None,
        rollout_logprobs: bool,
        row_staleness: np.ndarray | None,
        weights: np.ndarray | None,
    ) -> dict[str, float]:
        device = self.device_batch(batch, local=True)
        M = device.tokens.shape[0]
        weights = np.ones(len(rewards)) if weights is None else weights
        outcomes = Outcomes(
            np.asarray(rewards, np.float32).reshape(M, -1),
            np.asarray(groups, np.int32).reshape(M, -1),
            np.asarray(weights, np.float32).reshape(M, -1),
        )
        outcomes = self._upload(outcomes, self._row_sharding)
        self.state, self.critic_state, metrics = self._rl_steps[rollout_logprobs](
            self.state, self.critic_state, reference, device, outcomes
        )
        # the per-row arrays are spread over the processes' devices: read in one process only
        rows = metrics.pop(_ROW_GAP), metrics.pop(_ROW_TOKENS)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not out["batch/sampled_tokens"] or not rollout_logprobs:  # no gap to report
            del out["logprob_gap/mean"], out["logprob_gap/max"]
        elif row_staleness is not None and jax.process_count() == 1:
            row_gap, row_tokens = (np.asarray(x).reshape(-1) for x in rows)
            out.update(gap_by_staleness(row_gap, row_tokens, np.asarray(row_staleness)))
        out["rollout/logprobs_recomputed"] = float(not rollout_logprobs)
        return out

    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        self.state, metrics = self._policy_step(self.state, self.device_batch(batch))
        return {k: float(v) for k, v in metrics.items()}

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        assert self.critic_state is not None, "this learner has no critic"
        self.critic_state, metrics = self._critic_step(self.critic_state, self.device_batch(batch))
        return {f"critic/{k}": float(v) for k, v in metrics.items()}

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
