"""One micro-batch's numbers: the logprobs and values a step computes from its rows, and the
loss each update kind (policy, critic, SFT) minimises, aggregated with whole-batch
denominators (`Denominators`) so that micro-batches add up to the whole batch.

Logprobs are recomputed with `sampling_logprobs`, the function the engine samples with, under
the rollout's temperature / top-k / top-p, so learner and sampler logprobs compare token for
token (`token_stats`); without top-k / top-p, by `head_logprobs`, the same numbers a chunk
of the vocabulary at a time (the [B, T, V] logits are never made).

A batch of tree rows (`TrainBatch.tree`, `rl.tree`) runs its forward on them and gathers
each per-token result into its loss rows (`on_loss_rows`): everything after is as without.

Routing replay (a MoE policy, ``algorithm.routing_replay``): the forward of a batch that
carries the sampler's experts (`TrainBatch.expert_ids`) uses them at every position the
sampler computed a sampled token from, with the router's fresh gates for those experts (the
R3 rule, `models.moe.route`); the other positions (prompt and tool tokens: no experts were
kept for them) route themselves. `own_routing_stats` is the forward without replay, for the
metrics that compare the two routings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jax_agent_rl.config import AlgorithmSection
from jax_agent_rl.engine.sampling import head_logprobs, sampling_logprobs, token_logprobs
from jax_agent_rl.models import ModelConfig, Packed, Policy, Routing, Sharder, Weights
from jax_agent_rl.models.moe import NO_EXPERTS, load_balancing_loss
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import TrainBatch
from jax_agent_rl.rl.tree import TreeRows

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


def cast_floats(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a step (hashable: it keys the jit cache); ``policy``: what
    computes (`models.Policy`), its ``cfg`` the step's ``model``."""

    policy: Policy
    compute_dtype: Literal["float32", "bfloat16"]
    sampling: SamplingSpec
    algo: AlgorithmSection
    remat: bool
    sharder: Sharder
    # Dr.GRPO's constant (seq-mean-token-sum-norm): the generation budget; None: the row length
    norm_const: float | None = None

    @property
    def model(self) -> ModelConfig:
        return self.policy.cfg

    def hidden(
        self,
        weights: Weights,
        mb: TrainBatch,
        replay: bool | None = None,
        router_aux: bool = False,
    ) -> tuple[jax.Array, Weights, jax.Array]:
        """Final hidden states [B, T, D], the weights cast to the compute dtype, and with
        ``router_aux`` the router's load-balancing loss over the rows' real tokens (every
        token of a segment, prompt and tool tokens too: HF's ``attention_mask``), else 0.
        ``replay`` (None: ``algorithm.routing_replay``): the batch's sampled experts, if it
        carries any, are replayed (see the module docstring)."""
        replay = self.algo.routing_replay if replay is None else replay
        given = sampled_experts(mb) if replay else None
        w = self.cast(weights)
        f = forward_rows(mb)
        out = self.policy.forward(
            w,
            f.packed,
            sharder=self.sharder,
            remat=self.remat,
            routing=Routing(replay=given, router_logits=router_aux),
        )
        if not router_aux:
            return out.hidden, w, jnp.zeros((), jnp.float32)
        assert out.router_logits is not None
        return out.hidden, w, load_balancing_loss(self.model, out.router_logits, f.real)

    def cast(self, weights: Weights) -> Weights:
        """``weights`` in the compute dtype; a decoder's embedding table gathered over fsdp,
        its vocabulary left split over tensor: the lookup reads its own rows (the table split
        by its hidden dimension made the lookup's result an all-to-all), and a tied head
        reads the same gathered table (`head_stats`)."""
        w = cast_floats(weights, jnp.float32 if self.compute_dtype == "float32" else jnp.bfloat16)
        if not isinstance(w, Weights):
            return w
        return dataclasses.replace(w, embed=self.sharder.constrain(w.embed, ("act_vocab", None)))


class ForwardRows(NamedTuple):
    """The rows `forward` runs on (the batch's, or its tree rows), and how many sequences
    hold each position [B, T] (the router loss's token weights: a shared position counts for
    each sequence holding it, as when each stood alone)."""

    packed: Packed
    real: jax.Array


def forward_rows(mb: TrainBatch) -> ForwardRows:
    t = mb.tree
    if t is None:
        rows = Packed(mb.tokens, mb.positions, mb.segment_ids, mb.window or None)
        return ForwardRows(rows, mb.segment_ids > 0)
    segments = (t.reach > 0).astype(jnp.int32)
    return ForwardRows(Packed(t.tokens, t.positions, segments, reach=t.reach), t.count)


def on_loss_rows(mb: TrainBatch, x_bu: jax.Array) -> jax.Array:
    """A per-position result of the forward [B, U] as the loss rows' [B, T]: itself, or for
    tree rows gathered from the slot computing each position (`TreeRows.index`)."""
    t: TreeRows | None = mb.tree
    return x_bu if t is None else jnp.take_along_axis(x_bu, t.index, axis=1)


def sampled_experts(mb: TrainBatch) -> jax.Array | None:
    """The sampler's experts [sparse layers, B, T, k] of the rows the forward runs on, if the
    batch carries them, as `forward` takes them (-1 where none was sampled), else None."""
    ids = mb.expert_ids if mb.tree is None else mb.tree.expert_ids
    return None if ids is None else jnp.moveaxis(ids, 2, 0)


def token_stats(
    spec: StepSpec, params: Weights, mb: TrainBatch, replay: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """Logprob of each target under the rollout's sampling distribution, and its entropy
    (``replay``: `StepSpec.hidden`'s).

    Without top-k / top-p (the usual case) `head_logprobs` computes both a chunk of the
    vocabulary at a time; with them the vocabulary is sorted, so all the logits are made.
    """
    h, w, _ = spec.hidden(params, mb, replay)
    return head_stats(spec, h, w, mb)


def own_routing_stats(
    spec: StepSpec, params: Weights, mb: TrainBatch
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_stats` of a batch carrying sampled experts with the policy routing every token
    itself, and [B, T] 1.0 where its experts (as sets, in any sparse layer) differ from the
    sampler's (0 where the sampler kept none)."""
    given = sampled_experts(mb)
    assert given is not None, "own_routing_stats of a batch without sampled experts"
    w = spec.cast(params)
    f = forward_rows(mb)
    out = spec.policy.forward(
        w, f.packed, sharder=spec.sharder, remat=spec.remat, routing=Routing(record=True)
    )
    h, own = out.hidden, out.expert_ids
    assert own is not None
    sampled = given[0, ..., 0] != NO_EXPERTS
    differs = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(given, axis=-1), axis=(0, -1))
    return (*head_stats(spec, h, w, mb), on_loss_rows(mb, (differs & sampled).astype(jnp.float32)))


def head_stats(
    spec: StepSpec, h: jax.Array, w: Weights, mb: TrainBatch
) -> tuple[jax.Array, jax.Array]:
    """`token_stats` from the final hidden states ``h`` [B, T, D] and the cast weights ``w``
    (of the tree rows for a batch of them: then gathered into its loss rows)."""
    s = spec.sampling
    B, T, D = h.shape
    targets = mb.targets if mb.tree is None else mb.tree.targets
    # exact logprobs: the engine's log-softmax over the whole vocabulary, not chunks of it
    if s.top_k <= 0 and s.top_p >= 1.0 and not spec.model.exact_pages:
        # the head gathered over fsdp once, its vocabulary left split over tensor: each device
        # computes its part's logits, a chunk of it per step (`head_logprobs`'s ``parts``)
        head_vd = spec.policy.head_vd(w)
        parts = spec.sharder.shards("act_vocab")
        if head_vd.shape[0] % parts:
            parts = 1
        head_vd = spec.sharder.constrain(head_vd, ("act_vocab" if parts > 1 else None, None))
        logp, entropy = head_logprobs(
            h.reshape(B * T, D), head_vd, targets.reshape(B * T), s.temperature, parts=parts
        )
        return on_loss_rows(mb, logp.reshape(B, T)), on_loss_rows(mb, entropy.reshape(B, T))
    logits_btv = spec.policy.logits(w, h)
    V = logits_btv.shape[-1]
    full = lambda v: jnp.full((B * T,), v)  # noqa: E731
    logp_btv = sampling_logprobs(
        logits_btv.reshape(B * T, V), full(s.temperature), full(s.top_k), full(s.top_p)
    ).reshape(B, T, V)
    return (
        on_loss_rows(mb, token_logprobs(logp_btv, targets)),
        on_loss_rows(mb, core.entropy_from_logprobs(logp_btv)),
    )


def critic_values(spec: StepSpec, critic: Critic, mb: TrainBatch) -> jax.Array:
    """V(prefix up to and including token t), aligned with targets: [B, T] float32 (the
    critic routes every token itself: replay is the policy's)."""
    h, _, _ = spec.hidden(critic.body, mb, replay=False)
    return on_loss_rows(
        mb, jnp.einsum("btd,d->bt", h.astype(jnp.float32), critic.head) + critic.bias
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Derived:
    """What a step computes from its `TrainBatch` before updating, per token [M, b, T]."""

    old_logp: jax.Array  # learner logprobs before this update (0 off the sampled tokens)
    ref_logp: jax.Array  # reference-model logprobs (the KL term; 0 without a reference)
    advantages: jax.Array
    old_values: jax.Array  # critic values before the update (GAE; 0 otherwise)
    returns: jax.Array  # value targets (GAE; 0 otherwise)
    # the learner's entropy before this update (0 off the sampled tokens): what traces show
    entropy: jax.Array


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
    """PPO-clip policy loss (+ KL to the reference, - entropy bonus, + the router's
    load-balancing loss) of one micro-batch.

    The router loss (``algorithm.router_aux_loss_coef``, a mixture-of-experts policy) is HF's
    of this micro-batch's forward, as HF computes it per forward; weighted by the micro-batch's
    share of the batch's sampled tokens, so the micro-batches add up to their token-weighted
    mean (HF's value when the batch is one micro-batch)."""
    a = spec.algo
    counts: dict[str, Any] = dict(
        num_tokens=d.num_tokens,
        num_seqs=d.num_seqs,
        norm_const=d.norm_const,
        seq_bt=mb.sequence,
        num_sequences=d.num_sequences,
    )
    h, w, router_aux = spec.hidden(params, mb, router_aux=bool(a.router_aux_loss_coef))
    logp, entropy = head_stats(spec, h, w, mb)
    is_weights, mask_metrics = rollout_weights(a, dv.old_logp, mb, d.num_sequences)
    if a.policy_loss == "ppo":
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
    elif a.policy_loss == "cispo":
        pg_loss, m = core.cispo_loss(
            logp,
            dv.old_logp,
            dv.advantages,
            mb.mask,
            clip_low=a.cispo_clip_low,
            clip_high=a.cispo_clip_high,
            is_weights_bt=is_weights,
            agg_mode=a.loss_agg_mode,
            **counts,
        )
    else:
        pg_loss, m = core.dppo_loss(
            logp,
            dv.old_logp,
            dv.advantages,
            mb.mask,
            divergence="tv" if a.policy_loss == "dppo_tv" else "kl",
            delta_low=a.dppo_delta_low,
            delta_high=a.dppo_delta_high,
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
    if a.router_aux_loss_coef:
        loss = loss + a.router_aux_loss_coef * router_aux * mb.mask.sum() / d.num_tokens
        metrics["router_aux_loss"] = router_aux
    metrics["entropy"] = core.masked_mean(entropy, mb.mask)
    return loss, {**metrics, **mask_metrics}


def rollout_weights(
    a: AlgorithmSection, old_logp: jax.Array, mb: TrainBatch, num_sequences: int
) -> tuple[jax.Array | None, Metrics]:
    """The rollout-correction weight of each token [b, T] (None: none), from the ratio ``k`` of
    the learner's old-policy to the sampler's probability: TIS's ``min(k, tis_cap)``, then
    ``algorithm.rollout_mask``'s IcePop / KPop weight (``k`` kept or 0: `core.icepop_weights`,
    `core.kpop_weights`) or geometric sequence mask (`core.geometric_sequence_mask`, times
    TIS's weight if any). With a mask, ``rollout_mask/masked_frac``: the share of sampled
    tokens it zeroes."""
    mask, rollout = mb.mask, mb.rollout_logp
    weights = (
        None if a.tis_cap is None else core.truncated_is_weights(old_logp, rollout, mask, a.tis_cap)
    )
    if a.rollout_mask == "none":
        return weights, {}
    if a.rollout_mask == "icepop":
        weights = core.icepop_weights(old_logp, rollout, mask, a.icepop_low, a.icepop_high)
    elif a.rollout_mask == "kpop":
        weights = core.kpop_weights(old_logp, rollout, mask, a.kpop_threshold)
    else:
        keep = core.geometric_sequence_mask(
            old_logp, rollout, mask, a.geo_mask_low, a.geo_mask_high, mb.sequence, num_sequences
        )
        weights = keep if weights is None else weights * keep
    masked = core.masked_mean((weights == 0).astype(jnp.float32), mask)
    return weights, {"rollout_mask/masked_frac": masked}


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
