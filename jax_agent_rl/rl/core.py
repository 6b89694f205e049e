"""RL math as small pure functions: advantages, KL, policy / value losses, loss aggregation.

Every per-token array is ``[B, T]`` rows with a float ``mask_bt`` (1 on model-sampled tokens,
0 on prompt, tool output and padding). A row holds one sequence, or several packed one after
another: functions with a per-sequence term then take ``seq_bt`` (the index of each token's
sequence) or ``segment_ids_bt`` (where one sequence ends and the next begins). Masked
entries never reach a result: they are replaced by 0 before any product, so padding that
holds ``nan`` or ``-inf`` (e.g. a logprob) changes neither the value nor the gradient.
String and size arguments (``kind``, ``mode``, ``num_groups``, clip ranges) are Python
constants: pass them as static arguments under jit.

Conventions follow verl (``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``);
each docstring states its formula and, where this module chooses differently, says so.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
KLKind = Literal["k1", "abs", "k2", "k3"]

_LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios to +-20 before exp
_K3_CLAMP = 10.0  # verl clamps the k3 (low_var_kl) estimate to +-10


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, and 0 where ``den`` is 0 (there ``num`` is a sum over nothing)."""
    return num / jnp.where(den > 0, den, 1.0)


def _masked_sum(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=axis)


def masked_mean(x: ArrayLike, mask: ArrayLike, axis: int | None = None) -> jax.Array:
    """``sum(x * m) / sum(m)`` over ``axis`` (all axes when None); 0 where ``sum(m) == 0``.

    verl divides by ``sum(m) + 1e-8``; the exact guarded division here differs from it only on
    an empty mask (0 here, 0 there too) and below fp32 resolution otherwise.
    """
    x, mask = jnp.asarray(x), jnp.asarray(mask)
    return _safe_div(_masked_sum(x, mask, axis), jnp.sum(mask, axis=axis))


def masked_whiten(
    x: ArrayLike, mask: ArrayLike, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """``(x - mu) / sqrt(var + eps)`` with mu, var over the masked entries (``+ mu`` if not shift).

    ``var = sum(m * (x - mu)^2) / (n - 1)``, ``n = sum(m)``: unbiased, as verl's masked_var.
    Deviations: verl raises when ``n <= 1``; here the divisor is 1 then (so the output is 0
    where shifted), which keeps the function jittable. Entries where ``mask == 0`` are 0 here,
    verl leaves them whitened.
    """
    x, mask = jnp.asarray(x), jnp.asarray(mask)
    n = jnp.sum(mask)
    mean = masked_mean(x, mask)
    var = _masked_sum((x - mean) ** 2, mask) / jnp.where(n > 1, n - 1, 1.0)
    white = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return jnp.where(mask > 0, white, 0.0)


def grpo_advantages(
    rewards_n: ArrayLike,
    group_ids_n: ArrayLike,
    num_groups: int,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    weights_n: ArrayLike | None = None,
) -> jax.Array:
    """Group-relative advantage of each sequence: ``(r_i - mean_g) / (std_g + eps)``, [N].

    ``g`` is the group of ``i`` (ids in ``[0, num_groups)``), ``std_g`` is the unbiased
    (ddof=1) standard deviation. ``norm_by_std=False`` is Dr.GRPO: ``r_i - mean_g``. As in verl,
    a group of one has ``mean = 0, std = 1``, so its advantage is ``r_i / (1 + eps)`` (or
    ``r_i``). The caller broadcasts the result over the sequence's tokens.

    ``weights_n`` (default 1): how much of an episode row ``i`` is, when an episode spans
    several rows that carry its reward (one per model turn, ``algorithm.turn_mode=per_turn``:
    ``1 / turns`` each). The group's count, mean and variance are then weighted,
    ``n_g = sum_g w``, ``mean_g = sum_g w r / n_g``, ``var_g = sum_g w (r - mean_g)^2 /
    (n_g - 1)``: exactly the statistics of its episodes, each counted once.
    """
    r_n = jnp.asarray(rewards_n, jnp.float32)
    g_n = jnp.asarray(group_ids_n)
    w_n = jnp.ones_like(r_n) if weights_n is None else jnp.asarray(weights_n, jnp.float32)
    count_g = jax.ops.segment_sum(w_n, g_n, num_segments=num_groups)
    mean_g = _safe_div(jax.ops.segment_sum(w_n * r_n, g_n, num_segments=num_groups), count_g)
    sq_g = jax.ops.segment_sum(w_n * (r_n - mean_g[g_n]) ** 2, g_n, num_segments=num_groups)
    # counts of episodes are whole numbers; weights of 1/turns add up to them only roughly
    single_g = count_g < 1.5
    std_g = jnp.sqrt(sq_g / jnp.where(single_g, 1.0, count_g - 1))
    mean_g = jnp.where(single_g, 0.0, mean_g)
    std_g = jnp.where(single_g, 1.0, std_g)
    centred_n = r_n - mean_g[g_n]
    return centred_n / (std_g[g_n] + eps) if norm_by_std else centred_n


def last_token_rewards(
    rewards_n: ArrayLike, mask_bt: ArrayLike, seq_bt: ArrayLike | None = None
) -> jax.Array:
    """[B, T] token rewards: each sequence's outcome reward ``rewards_n[n]`` on its last
    sampled token (mask > 0), 0 elsewhere and for sequences with no sampled token (the input
    `gae_advantages` takes). ``seq_bt``: the sequence of each token (default: row ``b`` is
    sequence ``b``)."""
    m_bt = jnp.asarray(mask_bt) > 0
    B, T = m_bt.shape
    r_n = jnp.asarray(rewards_n, jnp.float32)
    seq = (
        jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)) if seq_bt is None else jnp.asarray(seq_bt)
    ).reshape(B * T)
    flat = jnp.arange(B * T)
    last_n = jax.ops.segment_max(
        jnp.where(m_bt.reshape(B * T), flat, -1), seq, num_segments=r_n.shape[0]
    )
    at_last = (flat == last_n[seq]) & m_bt.reshape(B * T)
    return jnp.where(at_last, r_n[seq], 0.0).reshape(B, T)


def gae_advantages(
    rewards_bt: ArrayLike,
    values_bt: ArrayLike,
    mask_bt: ArrayLike,
    gamma: float,
    lam: float,
    segment_ids_bt: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over model tokens only: (advantages_bt, returns_bt).

    For the model tokens ``t`` of a row (mask 1), with ``t'`` the next model token after ``t``
    (``V(t') = A(t') = 0`` when there is none)::

        delta_t = r_t + gamma * V(t') - V(t)
        A(t)    = delta_t + gamma * lam * A(t')
        R(t)    = A(t) + V(t)

    Tokens with mask 0 (tool output, padding) are skipped, as in verl's multi-turn GAE: a row
    with a tool span gives the same numbers as the row with that span cut out. Rewards must sit
    on model tokens (a reward on a masked token is ignored, as in verl). Outputs are 0 where
    the mask is 0 (verl carries the last advantage there). Advantages are not whitened (verl
    whitens inside; use `masked_whiten`). No gradient flows through the result.

    ``segment_ids_bt``: rows of packed sequences; nothing carries from one segment to the
    token before it (``t'`` is searched within ``t``'s sequence only), so each sequence gets
    the numbers it gets alone in a row.
    """
    r_tb = jnp.asarray(rewards_bt, jnp.float32).T
    v_tb = jax.lax.stop_gradient(jnp.asarray(values_bt, jnp.float32)).T
    m_tb = jnp.asarray(mask_bt).T

    if segment_ids_bt is None:
        ends_tb = jnp.zeros(m_tb.shape, bool)
    else:  # token t ends its segment when token t + 1 is another's (or padding)
        seg_tb = jnp.asarray(segment_ids_bt).T
        ends_tb = jnp.concatenate([seg_tb[1:] != seg_tb[:-1], jnp.ones_like(seg_tb[:1], bool)])

    def step(
        carry: tuple[jax.Array, jax.Array],
        xs: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        r_b, v_b, m_b, end_b = xs
        next_value_b, next_adv_b = (jnp.where(end_b, 0.0, c) for c in carry)
        adv_b = r_b + gamma * next_value_b - v_b + gamma * lam * next_adv_b
        keep_b = m_b > 0
        carry = (jnp.where(keep_b, v_b, next_value_b), jnp.where(keep_b, adv_b, next_adv_b))
        return carry, jnp.where(keep_b, adv_b, 0.0)

    zeros_b = jnp.zeros(r_tb.shape[1], jnp.float32)
    _, adv_tb = jax.lax.scan(step, (zeros_b, zeros_b), (r_tb, v_tb, m_tb, ends_tb), reverse=True)
    adv_bt = adv_tb.T
    returns_bt = jnp.where(m_tb.T > 0, adv_bt + v_tb.T, 0.0)
    return adv_bt, returns_bt


def kl_penalty(logp_bt: ArrayLike, ref_logp_bt: ArrayLike, kind: KLKind) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (Schulman 2020).

    With ``d = logp - ref_logp``: ``k1 = d``, ``abs = |d|``, ``k2 = d^2 / 2``, and
    ``k3 = exp(-d) + d - 1`` (verl's low_var_kl), computed with ``-d`` clamped to [-20, 20] and
    the result clamped to [-10, 10], as in verl.
    """
    d_bt = jnp.asarray(logp_bt) - jnp.asarray(ref_logp_bt)
    if kind == "k1":
        return d_bt
    if kind == "abs":
        return jnp.abs(d_bt)
    if kind == "k2":
        return 0.5 * d_bt**2
    if kind == "k3":
        neg_d_bt = jnp.clip(-d_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return jnp.clip(jnp.exp(neg_d_bt) - neg_d_bt - 1.0, -_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"unknown KL kind {kind!r}; allowed: k1, abs, k2, k3")


def aggregate_loss(
    loss_bt: ArrayLike,
    mask_bt: ArrayLike,
    mode: AggMode,
    *,
    num_tokens: ArrayLike | None = None,
    num_seqs: ArrayLike | None = None,
    norm_const: float | None = None,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> jax.Array:
    """A scalar from per-token losses ``l`` under mask ``m``; ``S_n = sum_t m l`` per sequence::

        token-mean:               sum_n S_n / num_tokens
        seq-mean-token-sum:       sum_n S_n / num_seqs
        seq-mean-token-mean:      sum_n (S_n / sum_{t in n} m_t) / num_seqs
        seq-mean-token-sum-norm:  sum_n S_n / (norm_const * num_seqs)     (Dr.GRPO)

    A sequence is a row, or with ``seq_bt`` (the sequence index of each token, in
    ``[0, num_sequences)``) the tokens of one index, wherever they sit (packed rows).
    ``num_tokens`` / ``num_seqs`` default to this batch's mask-token count and its number of
    sequences with at least one mask token (fully masked ones are not sequences, as in verl).
    Pass whole-batch counts when accumulating over micro-batches: the micro-batch results then
    sum to the whole-batch value. ``norm_const`` defaults to T (the generation budget when rows
    are padded to it, as verl's are).

    Deviation: verl's seq-mean-token-sum-norm is ``sum_n S_n / norm_const`` with no division
    by the number of sequences, so its scale grows with the batch; here it is Dr.GRPO's
    ``1/G sum_i 1/MAX_TOKENS sum_t`` exactly.
    """
    loss_bt, mask_bt = jnp.asarray(loss_bt), jnp.asarray(mask_bt)
    if seq_bt is None:
        seq_sum_n = _masked_sum(loss_bt, mask_bt, axis=-1)
        seq_count_n = jnp.sum(mask_bt, axis=-1)
    else:
        if num_sequences is None:
            raise ValueError("seq_bt needs num_sequences")
        seq_n = jnp.asarray(seq_bt).reshape(-1)
        masked = jnp.where(mask_bt > 0, loss_bt, 0.0) * mask_bt
        seq_sum_n = jax.ops.segment_sum(masked.reshape(-1), seq_n, num_sequences)
        seq_count_n = jax.ops.segment_sum(mask_bt.reshape(-1), seq_n, num_sequences)
    if mode == "token-mean":
        return _safe_div(jnp.sum(seq_sum_n), _count(num_tokens, jnp.sum(mask_bt)))
    seqs = _count(num_seqs, jnp.sum(seq_count_n > 0))
    if mode == "seq-mean-token-sum":
        return _safe_div(jnp.sum(seq_sum_n), seqs)
    if mode == "seq-mean-token-mean":
        return _safe_div(jnp.sum(_safe_div(seq_sum_n, seq_count_n)), seqs)
    if mode == "seq-mean-token-sum-norm":
        const = float(loss_bt.shape[-1]) if norm_const is None else norm_const
        return _safe_div(jnp.sum(seq_sum_n), const * seqs)
    raise ValueError(
        f"unknown aggregation mode {mode!r}; allowed: token-mean, seq-mean-token-sum, "
        "seq-mean-token-mean, seq-mean-token-sum-norm"
    )


def _count(given: ArrayLike | None, own: jax.Array) -> jax.Array:
    return own.astype(jnp.float32) if given is None else jnp.asarray(given, jnp.float32)


def policy_loss(
    logp_bt: ArrayLike,
    old_logp_bt: ArrayLike,
    advantages_bt: ArrayLike,
    mask_bt: ArrayLike,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg_mode: AggMode = "token-mean",
    num_tokens: ArrayLike | None = None,
    num_seqs: ArrayLike | None = None,
    norm_const: float | None = None,
    is_weights_bt: ArrayLike | None = None,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with asymmetric (DAPO clip-higher) and dual clip, aggregated.

    With ``rho = exp(clamp(logp - old_logp, -20, 20))`` and advantage ``A``::

        L1 = -A * rho,    L2 = -A * clip(rho, 1 - clip_low, 1 + clip_high)
        L  = max(L1, L2)                          (PPO)
        L  = min(L, -A * clip_c)    where A < 0   (dual clip, Ye et al. 2019; off if None)
        L  = L * w                                (w = is_weights_bt, constants; TIS)

    then `aggregate_loss` (``agg_mode``, the count and sequence arguments as there). Metrics, masked
    means over this batch as in verl: ``clipfrac`` = share of tokens with ``L2 > L1``,
    ``clipfrac_lower`` = share with ``A < 0`` and ``max(L1, L2) > -A * clip_c`` (the dual clip
    binds), ``approx_kl`` = mean of ``old_logp - logp`` (k1 of KL(old || new) on the clamped
    log-ratio; verl's ``ppo_kl``).
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (dual clip lower bound), got {clip_c}")
    mask_bt = jnp.asarray(mask_bt)
    adv_bt = jnp.asarray(advantages_bt)
    log_ratio_bt = jnp.where(mask_bt > 0, jnp.asarray(logp_bt) - jnp.asarray(old_logp_bt), 0.0)
    log_ratio_bt = jnp.clip(log_ratio_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_bt = jnp.exp(log_ratio_bt)
    l1_bt = -adv_bt * ratio_bt
    l2_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high)
    loss_bt = jnp.maximum(l1_bt, l2_bt)
    if clip_c is None:
        clipfrac_lower = jnp.zeros((), jnp.float32)
    else:
        l3_bt = -adv_bt * clip_c
        negative_bt = adv_bt < 0
        clipfrac_lower = masked_mean((negative_bt & (loss_bt > l3_bt)).astype(jnp.float32), mask_bt)
        loss_bt = jnp.where(negative_bt, jnp.minimum(loss_bt, l3_bt), loss_bt)
    if is_weights_bt is not None:
        loss_bt = loss_bt * jax.lax.stop_gradient(jnp.asarray(is_weights_bt))
    loss = aggregate_loss(
        loss_bt,
        mask_bt,
        agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_const=norm_const,
        seq_bt=seq_bt,
        num_sequences=num_sequences,
    )
    metrics = {
        "clipfrac": masked_mean((l2_bt > l1_bt).astype(jnp.float32), mask_bt),
        "clipfrac_lower": clipfrac_lower,
        "approx_kl": masked_mean(-log_ratio_bt, mask_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def _log_ratio(logp_bt: jax.Array, old_logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """``logp - old_logp`` on the mask (0 elsewhere), clamped to [-20, 20] as verl's."""
    log_ratio_bt = jnp.where(mask_bt > 0, logp_bt - old_logp_bt, 0.0)
    return jnp.clip(log_ratio_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def cispo_loss(
    logp_bt: ArrayLike,
    old_logp_bt: ArrayLike,
    advantages_bt: ArrayLike,
    mask_bt: ArrayLike,
    *,
    clip_low: float = 1.0,
    clip_high: float = 5.0,
    agg_mode: AggMode = "token-mean",
    num_tokens: ArrayLike | None = None,
    num_seqs: ArrayLike | None = None,
    norm_const: float | None = None,
    is_weights_bt: ArrayLike | None = None,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update::

        rho = exp(clamp(logp - old_logp, -20, 20))
        L   = -sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp * w

    (``sg``: stop-gradient; ``w = is_weights_bt``, constants), then `aggregate_loss`. Every
    token passes gradient ``-c A grad(logp)``, the clipped ones too (PPO's clipped tokens pass
    none). Defaults: no lower bound (``clip_low = 1``: MiniMax-M1 sets eps_low large) and
    ``clip_high = 5`` (SkyRL's ``cispo_eps_clip_high``). Metrics: ``clipfrac`` = share of
    tokens whose weight is clipped (``rho`` outside the bounds), ``clipfrac_lower`` = 0,
    ``approx_kl`` as in `policy_loss`.
    """
    mask_bt, adv_bt, logp_bt = (jnp.asarray(x) for x in (mask_bt, advantages_bt, logp_bt))
    log_ratio_bt = _log_ratio(logp_bt, jnp.asarray(old_logp_bt), mask_bt)
    ratio_bt = jnp.exp(log_ratio_bt)
    weight_bt = jax.lax.stop_gradient(jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high))
    loss_bt = -weight_bt * adv_bt * jnp.where(mask_bt > 0, logp_bt, 0.0)
    if is_weights_bt is not None:
        loss_bt = loss_bt * jax.lax.stop_gradient(jnp.asarray(is_weights_bt))
    loss = aggregate_loss(
        loss_bt,
        mask_bt,
        agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_const=norm_const,
        seq_bt=seq_bt,
        num_sequences=num_sequences,
    )
    clipped_bt = (ratio_bt < 1.0 - clip_low) | (ratio_bt > 1.0 + clip_high)
    metrics = {
        "clipfrac": masked_mean(clipped_bt.astype(jnp.float32), mask_bt),
        "clipfrac_lower": jnp.zeros((), jnp.float32),
        "approx_kl": masked_mean(-log_ratio_bt, mask_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def dppo_loss(
    logp_bt: ArrayLike,
    old_logp_bt: ArrayLike,
    advantages_bt: ArrayLike,
    mask_bt: ArrayLike,
    *,
    divergence: Literal["tv", "kl"] = "tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg_mode: AggMode = "token-mean",
    num_tokens: ArrayLike | None = None,
    num_seqs: ArrayLike | None = None,
    norm_const: float | None = None,
    is_weights_bt: ArrayLike | None = None,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPPO-Binary (Divergence PPO, "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv 2602.04879; verl ``dppo_tv`` / ``dppo_kl``, SkyRL ``dppo``): the trust
    region is a bound on the divergence of the sampled token's probability, not on the ratio.

    With ``p = exp(logp)``, ``p_old = exp(old_logp)``, ``rho = exp(clamp(logp - old_logp, -20,
    20))`` and ``D_B`` the binary KL (`binary_kl`, ``p_old`` first; verl adds 1e-8 inside the
    complement's log where `binary_kl` clamps: the two differ below 1e-6 of probability)::

        tv:  valid = p - p_old <= delta_high          where A > 0
             valid = p - p_old >= -delta_low          elsewhere
        kl:  valid = D_B(p_old || p) <= delta_high  or  p <= p_old    where A > 0
             valid = D_B(p_old || p) <= delta_low   or  p >= p_old    elsewhere
        L = -A * sg(min(rho, clip_c)) * logp * sg(valid) * w

    then `aggregate_loss`: a valid token's gradient is PPO's unclipped one (``-A grad rho``,
    the ratio truncated at ``clip_c``; None: not truncated), an invalid one's is 0 (the update
    has moved its probability too far in the advantage's direction). Defaults: delta 0.2 for
    TV (SkyRL's ``delta_low/high``; 0.05 is recommended there for KL), ``clip_c`` 3 (verl reads
    its ``clip_ratio_c``, 3 by default). Metrics: ``clipfrac`` = share of tokens not valid,
    ``clipfrac_lower`` = share valid with ``rho > clip_c`` (as verl), ``approx_kl`` as in
    `policy_loss`.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"unknown DPPO divergence {divergence!r}; allowed: tv, kl")
    mask_bt, adv_bt = jnp.asarray(mask_bt), jnp.asarray(advantages_bt)
    logp_bt, old_bt = (jnp.where(mask_bt > 0, jnp.asarray(x), 0.0) for x in (logp_bt, old_logp_bt))
    log_ratio_bt = _log_ratio(logp_bt, old_bt, mask_bt)
    ratio_bt = jnp.exp(log_ratio_bt)
    p_bt, p_old_bt = jax.lax.stop_gradient(jnp.exp(logp_bt)), jnp.exp(old_bt)
    if divergence == "tv":
        valid_pos_bt = p_bt - p_old_bt <= delta_high
        valid_neg_bt = p_bt - p_old_bt >= -delta_low
    else:
        d_bt = binary_kl(p_old_bt, p_bt)
        valid_pos_bt = (d_bt <= delta_high) | (p_bt <= p_old_bt)
        valid_neg_bt = (d_bt <= delta_low) | (p_bt >= p_old_bt)
    valid_bt = jnp.where(adv_bt > 0, valid_pos_bt, valid_neg_bt).astype(jnp.float32)
    weight_bt = ratio_bt if clip_c is None else jnp.minimum(ratio_bt, clip_c)
    weight_bt = jax.lax.stop_gradient(weight_bt * valid_bt)
    loss_bt = -adv_bt * weight_bt * logp_bt
    if is_weights_bt is not None:
        loss_bt = loss_bt * jax.lax.stop_gradient(jnp.asarray(is_weights_bt))
    loss = aggregate_loss(
        loss_bt,
        mask_bt,
        agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_const=norm_const,
        seq_bt=seq_bt,
        num_sequences=num_sequences,
    )
    truncated_bt = jnp.zeros_like(valid_bt) if clip_c is None else (ratio_bt > clip_c) * valid_bt
    metrics = {
        "clipfrac": masked_mean(1.0 - valid_bt, mask_bt),
        "clipfrac_lower": masked_mean(truncated_bt, mask_bt),
        "approx_kl": masked_mean(-log_ratio_bt, mask_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def value_loss(
    values_bt: ArrayLike,
    old_values_bt: ArrayLike,
    returns_bt: ArrayLike,
    mask_bt: ArrayLike,
    *,
    clip_range: float = 0.5,
    agg_mode: AggMode = "token-mean",
    num_tokens: ArrayLike | None = None,
    num_seqs: ArrayLike | None = None,
    norm_const: float | None = None,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss ``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``.

    As verl's compute_value_loss; ``vf_clipfrac`` is the masked share of tokens where the
    clipped term is strictly larger.
    """
    v_bt, old_bt = jnp.asarray(values_bt), jnp.asarray(old_values_bt)
    ret_bt, mask_bt = jnp.asarray(returns_bt), jnp.asarray(mask_bt)
    l1_bt = (v_bt - ret_bt) ** 2
    l2_bt = (jnp.clip(v_bt, old_bt - clip_range, old_bt + clip_range) - ret_bt) ** 2
    loss = 0.5 * aggregate_loss(
        jnp.maximum(l1_bt, l2_bt),
        mask_bt,
        agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_const=norm_const,
        seq_bt=seq_bt,
        num_sequences=num_sequences,
    )
    clipfrac = masked_mean((l2_bt > l1_bt).astype(jnp.float32), mask_bt)
    return loss, {"vf_clipfrac": jax.lax.stop_gradient(clipfrac)}


def truncated_is_weights(
    learner_logp_bt: ArrayLike, rollout_logp_bt: ArrayLike, mask_bt: ArrayLike, cap: float = 2.0
) -> jax.Array:
    """Truncated importance weights ``min(exp(learner_old_logp - rollout_logp), cap)``, [B, T].

    Corrects for the sampler's distribution differing from the learner's (TIS, Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"). 0 where the
    mask is 0; constants (stop_gradient).
    """
    mask_bt = jnp.asarray(mask_bt)
    diff_bt = jnp.asarray(learner_logp_bt) - jnp.asarray(rollout_logp_bt)
    log_w_bt = jnp.where(mask_bt > 0, diff_bt, 0.0)
    w_bt = jnp.minimum(jnp.exp(log_w_bt), cap)
    return jax.lax.stop_gradient(jnp.where(mask_bt > 0, w_bt, 0.0))


def _rollout_log_ratio(
    learner_logp_bt: ArrayLike, rollout_logp_bt: ArrayLike, mask_bt: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """``(log k, on)``: ``log k = learner_old_logp - rollout_logp`` on the mask (0 elsewhere,
    whatever the padding holds), ``on = mask > 0``."""
    on_bt = jnp.asarray(mask_bt) > 0
    diff_bt = jnp.asarray(learner_logp_bt) - jnp.asarray(rollout_logp_bt)
    return jnp.where(on_bt, diff_bt, 0.0), on_bt


def icepop_weights(
    learner_logp_bt: ArrayLike,
    rollout_logp_bt: ArrayLike,
    mask_bt: ArrayLike,
    low: float = 0.5,
    high: float = 5.0,
) -> jax.Array:
    """IcePop's double-sided masking ``M(k) = k if low <= k <= high else 0``, [B, T], with
    ``k = exp(learner_old_logp - rollout_logp)`` (Ring-1T, "Every Step Evolves", arXiv
    2510.18855; AReaL ``icepop_alpha/beta``, defaults 0.5 and 5.0 as there).

    Where `truncated_is_weights` keeps training on a token whose sampler and learner disagree
    (at weight ``cap``), this drops it: a token sampled by a policy far from the one being
    updated carries no gradient, on either side of the band. 0 where the mask is 0; constants.
    """
    log_k_bt, on_bt = _rollout_log_ratio(learner_logp_bt, rollout_logp_bt, mask_bt)
    k_bt = jnp.exp(log_k_bt)
    keep_bt = on_bt & (k_bt >= low) & (k_bt <= high)
    return jax.lax.stop_gradient(jnp.where(keep_bt, k_bt, 0.0))


def binary_kl(p: ArrayLike, q: ArrayLike) -> jax.Array:
    """KL of two two-event distributions (this token / every other token), elementwise:
    ``D_B(p || q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q))``, with ``p`` and ``q``
    clamped to ``[1e-6, 1 - 1e-6]`` so that neither log meets 0 (as prime-rl's KPop)."""
    p_, q_ = (jnp.clip(jnp.asarray(x), 1e-6, 1.0 - 1e-6) for x in (p, q))
    return p_ * (jnp.log(p_) - jnp.log(q_)) + (1.0 - p_) * (jnp.log1p(-p_) - jnp.log1p(-q_))


def kpop_weights(
    learner_logp_bt: ArrayLike,
    rollout_logp_bt: ArrayLike,
    mask_bt: ArrayLike,
    threshold: float = 0.1,
) -> jax.Array:
    """KPop's bidirectional binary-KL masking: ``k`` where ``D_B(p || q) <= phi`` and ``D_B(q ||
    p) <= phi``, else 0, [B, T]; ``p = exp(learner_old_logp)``, ``q = exp(rollout_logp)`` the
    sampled token's probabilities, ``k = p / q``, ``phi = threshold`` (KPop, Guo et al., Ant
    Group; AReaL ``enable_kpop``, prime-rl ``kpop_threshold``, default 0.1).

    Against IcePop's ratio band, the band adapts to the token's probability: wide in ratio for
    a rare token, tight for a confident one. 0 where the mask is 0; constants.
    """
    log_k_bt, on_bt = _rollout_log_ratio(learner_logp_bt, rollout_logp_bt, mask_bt)
    p_bt = jnp.exp(jnp.where(on_bt, jnp.asarray(learner_logp_bt), 0.0))
    q_bt = jnp.exp(jnp.where(on_bt, jnp.asarray(rollout_logp_bt), 0.0))
    keep_bt = on_bt & (binary_kl(p_bt, q_bt) <= threshold) & (binary_kl(q_bt, p_bt) <= threshold)
    return jax.lax.stop_gradient(jnp.where(keep_bt, jnp.exp(log_k_bt), 0.0))


def geometric_sequence_mask(
    learner_logp_bt: ArrayLike,
    rollout_logp_bt: ArrayLike,
    mask_bt: ArrayLike,
    low: float = 0.99,
    high: float = 1.01,
    seq_bt: ArrayLike | None = None,
    num_sequences: int | None = None,
) -> jax.Array:
    """Geometric sequence masking: 1.0 on the tokens of each sequence whose geometric-mean
    ratio ``g_n = exp(sum_{t in n} m log k_t / sum_{t in n} m)`` lies in ``[low, high]``, 0 on
    the whole of every other sequence and off the mask, [B, T]; ``log k = learner_old_logp -
    rollout_logp`` (SkyRL ``sequence_mask_metric=geometric``, ``geo_mask_low/high`` 0.99 /
    1.01 there).

    A sequence is a row, or with ``seq_bt`` (the sequence of each token, in ``[0,
    num_sequences)``) the tokens of one index wherever they sit (packed rows). A sequence
    with no mask token has ``g = 1``. Constants.
    """
    log_k_bt, on_bt = _rollout_log_ratio(learner_logp_bt, rollout_logp_bt, mask_bt)
    m_bt = jnp.asarray(mask_bt, jnp.float32)
    if seq_bt is None:
        mean_bt = _safe_div(jnp.sum(log_k_bt * m_bt, -1), jnp.sum(m_bt, -1))[:, None]
    else:
        if num_sequences is None:
            raise ValueError("seq_bt needs num_sequences")
        seq = jnp.asarray(seq_bt)
        total_n = jax.ops.segment_sum((log_k_bt * m_bt).reshape(-1), seq.reshape(-1), num_sequences)
        count_n = jax.ops.segment_sum(m_bt.reshape(-1), seq.reshape(-1), num_sequences)
        mean_bt = _safe_div(total_n, count_n)[seq]
    g_bt = jnp.exp(mean_bt)
    keep_bt = on_bt & (g_bt >= low) & (g_bt <= high)
    return jax.lax.stop_gradient(keep_bt.astype(jnp.float32))


def entropy_from_logprobs(logprobs_btv: ArrayLike) -> jax.Array:
    """Entropy ``-sum_v p_v log p_v`` of normalised log-probabilities [..., V] -> [...].

    Entries of ``-inf`` (filtered tokens, p = 0) contribute 0, to the value and the gradient.
    """
    logp_btv = jnp.asarray(logprobs_btv)
    finite_btv = jnp.where(jnp.isneginf(logp_btv), 0.0, logp_btv)
    return -jnp.sum(jnp.exp(logp_btv) * finite_btv, axis=-1)


def overlong_penalty(
    response_lengths_n: ArrayLike,
    max_response_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> jax.Array:
    """DAPO soft overlong punishment added to each response's reward, [N].

    With ``L = max_response_len`` and ``B = buffer_len``: ``0`` for ``len <= L - B``,
    ``-(len - (L - B)) / B * penalty_factor`` in the buffer zone, and ``-penalty_factor`` for
    ``len >= L``. verl's DAPO reward manager does not clip at ``-penalty_factor`` (a response
    there cannot be longer than L); here the clip makes the bound explicit.
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"need 0 < buffer_len <= max_response_len, got {buffer_len}")
    len_n = jnp.asarray(response_lengths_n, jnp.float32)
    exceed_n = len_n - (max_response_len - buffer_len)
    return jnp.clip(-exceed_n / buffer_len * penalty_factor, -penalty_factor, 0.0)


def groups_with_signal(rewards_n: np.ndarray, group_ids_n: np.ndarray) -> np.ndarray:
    """Host side: True for members of groups whose rewards are not all equal, bool [N].

    DAPO dynamic sampling trains only on these (a group with equal rewards has zero GRPO
    advantage). Deviation: verl's DAPO recipe also keeps groups of one; here a group of one
    has no spread, so it is dropped.
    """
    rewards_n = np.asarray(rewards_n)
    _, inverse_n = np.unique(np.asarray(group_ids_n), return_inverse=True)
    num_groups = int(inverse_n.max()) + 1 if inverse_n.size else 0
    hi_g = np.full(num_groups, -np.inf)
    lo_g = np.full(num_groups, np.inf)
    np.maximum.at(hi_g, inverse_n, rewards_n)
    np.minimum.at(lo_g, inverse_n, rewards_n)
    return (hi_g > lo_g)[inverse_n]
