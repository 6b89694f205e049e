"""Sampling math shared by the engine and the learner: one definition of the distribution.

`sampling_logprobs` turns raw logits into the log-probabilities of the distribution a token is
actually drawn from; the engine samples from it and reports the sampled token's entry, and the
learner calls the same function on its recomputed logits, so the two agree to rounding.

Order (as in vLLM and HF): logits / temperature, then top-k, then top-p over the top-k
renormalised distribution. A token whose logit ties the smallest kept one is kept too.
Temperature 0 means greedy; its logprobs are reported at temperature 1 (same filters).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _filter_top_k_top_p(scaled_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array) -> jax.Array:
    V = scaled_bv.shape[-1]
    sorted_bv = jnp.flip(jnp.sort(scaled_bv, axis=-1), axis=-1)  # descending
    rank_v = jnp.arange(V)
    k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, V), V)
    in_top_k = rank_v[None, :] < k_b[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_bv, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < top_p_b[:, None])  # the top token is always kept
    threshold_b = jnp.min(jnp.where(keep, sorted_bv, jnp.inf), axis=-1)
    return jnp.where(scaled_bv >= threshold_b[:, None], scaled_bv, -jnp.inf)


def sampling_logprobs(
    logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array
) -> jax.Array:
    """Log-probabilities [B, V] (fp32) of the distribution each row samples from.

    ``top_k <= 0`` and ``top_p >= 1`` switch the filters off; when every row has them off, the
    vocabulary sort is skipped entirely (a ``lax.cond``, so one program serves both cases).
    """
    t_b = jnp.where(temperature_b > 0, temperature_b, 1.0).astype(jnp.float32)
    scaled = logits_bv.astype(jnp.float32) / t_b[:, None]
    needs_filter = jnp.any((top_k_b > 0) | (top_p_b < 1.0))
    filtered = jax.lax.cond(
        needs_filter, _filter_top_k_top_p, lambda x, _k, _p: x, scaled, top_k_b, top_p_b
    )
    return jax.nn.log_softmax(filtered, axis=-1)


def _inverse_cdf(probs_bv: jax.Array, target_b: jax.Array, block: int = 256) -> jax.Array:
    """The first index whose cumulative probability reaches ``target``, in two levels.

    A flat cumsum over a 32k+ vocabulary is slow on CPU; summing blocks, scanning the block
    sums, then scanning inside the chosen block gives the same index. The result never lands
    on a zero-probability token (rounding can push ``target`` past the block's last mass).
    """
    B, V = probs_bv.shape
    n_blocks = -(-V // block)
    p = jnp.pad(probs_bv, ((0, 0), (0, n_blocks * block - V))).reshape(B, n_blocks, block)
    block_sum = p.sum(-1)
    block_cdf = jnp.cumsum(block_sum, axis=-1)
    b = jnp.minimum(jnp.sum(block_cdf < target_b[:, None], axis=-1), n_blocks - 1)
    # never a block without mass: fall back to the last block that has some
    last_nonzero_block = n_blocks - 1 - jnp.argmax(jnp.flip(block_sum > 0, -1), axis=-1)
    b = jnp.where(jnp.take_along_axis(block_sum, b[:, None], -1)[:, 0] > 0, b, last_nonzero_block)
    inner = jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(block_cdf - block_sum, b[:, None], -1)
    j = jnp.sum(jnp.cumsum(inner, axis=-1) + before < target_b[:, None], axis=-1)
    last_nonzero = block - 1 - jnp.argmax(jnp.flip(inner > 0, -1), axis=-1)
    return b * block + jnp.minimum(j, last_nonzero)


def sample(
    logprobs_bv: jax.Array, greedy_b: jax.Array, keys_b: jax.Array, step_b: jax.Array
) -> jax.Array:
    """One token per row: argmax where greedy, else an exact draw by inverse CDF.

    Each row's randomness is ``fold_in(key, step)``: it depends on the request's seed and on
    how many tokens it has generated, never on which other requests share the batch.
    """
    step_keys = jax.vmap(jax.random.fold_in)(keys_b, step_b)
    u_b = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(step_keys)  # (0, 1]
    probs_bv = jnp.exp(logprobs_bv)
    drawn_b = _inverse_cdf(probs_bv, u_b * jnp.sum(probs_bv, axis=-1))
    return jnp.where(greedy_b, first_max(logprobs_bv), drawn_b).astype(jnp.int32)


def first_max(x_bv: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (the first index of the maximum), as a max and a min of
    indices: two plain reductions, where XLA:CPU's argmax (a reduction of value-index pairs)
    took 1-2 ms per decode step over a 32k vocabulary. A NaN counts as the maximum, as there."""
    V = x_bv.shape[-1]
    top = x_bv.max(-1, keepdims=True)  # NaN if the row has one
    first = (x_bv == top) | jnp.isnan(x_bv)
    return jnp.min(jnp.where(first, jnp.arange(V), V), axis=-1)


def token_logprobs(logprobs_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """The entry of each token in its row's log-probabilities: [..., V] x [...] -> [...]."""
    return jnp.take_along_axis(logprobs_btv, tokens_bt[..., None], axis=-1)[..., 0]


VOCAB_CHUNK = 4096  # the most vocabulary entries `head_logprobs` computes logits for at once


def _head_chunks(head_vd: jax.Array, chunk: int, parts: int) -> tuple[jax.Array, jax.Array]:
    """``head_vd`` [V, D] as ``n`` steps [n, S, C, D] of ``S = parts`` chunks of C rows, chunk
    j of step i the i-th C rows of the vocabulary's j-th of S equal parts (zero rows padding
    each part's last), and the vocabulary index of each row [n, S, C] (V on the padding).
    With the vocabulary split in ``parts`` over devices, each step reads every device's own
    rows: a loop over the steps slices no split axis, so it gathers nothing."""
    V, D = head_vd.shape
    P = V // parts
    n = -(-P // max(chunk // parts, 1))
    C = -(-P // n)
    rows = jnp.pad(head_vd.reshape(parts, P, D), ((0, 0), (0, n * C - P), (0, 0)))
    index = jnp.arange(parts)[:, None] * P + jnp.arange(n * C)[None, :]
    index = jnp.where(jnp.arange(n * C)[None, :] < P, index, V)
    steps = rows.reshape(parts, n, C, D).transpose(1, 0, 2, 3)
    return steps, index.reshape(parts, n, C).transpose(1, 0, 2)


def _chunk_scores(
    h_nd: jax.Array, w_scd: jax.Array, col_sc: jax.Array, V: int, temperature: float
) -> jax.Array:
    """Scaled logits [N, S, C] (fp32) of one step's chunks of the vocabulary (columns
    ``col_sc``), -inf on the padding."""
    s = jnp.einsum("nd,scd->nsc", h_nd, w_scd, preferred_element_type=jnp.float32) / temperature
    return jnp.where(col_sc < V, s, -jnp.inf)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def head_logprobs(
    h_nd: jax.Array,
    head_vd: jax.Array,
    targets_n: jax.Array,
    temperature: float,
    chunk: int = VOCAB_CHUNK,
    parts: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """``sampling_logprobs`` of the logits ``h @ head.T`` without top-k / top-p, at each
    target and whole: the target's log-probability [N] and the entropy [N] (fp32), from
    hidden states [N, D] and a head [V, D], without ever holding all N x V logits.

    The vocabulary is read in steps of at most ``chunk`` entries, reduced online: a running
    maximum ``m`` and, relative to it, ``z = sum exp(s - m)`` and ``a = sum exp(s - m) s`` of
    the scaled logits ``s = logits / temperature`` (``temperature`` > 0; 0 means greedy, whose
    logprobs are those at 1, as in `sampling_logprobs`). Then ``log Z = m + log z``, the
    target's ``s_y - log Z``, and the entropy ``log Z - a / z`` (= ``-sum p log p``). The
    gradient (a custom VJP) computes each chunk's logits again: with ``p = exp(s - log Z)``,
    ``d logp_y / ds = onehot(y) - p`` and ``d H / ds = -p (s - a / z)``, over the temperature.

    ``parts`` (dividing V): a head whose vocabulary is split over that many devices (the
    learner's, over ``tensor``) is read a chunk of each part per step (`_head_chunks`), so each
    device computes the logits of its own part and no step gathers the head.
    """
    return _head_logprobs_fwd(h_nd, head_vd, targets_n, temperature, chunk, parts)[0]


def _head_logprobs_fwd(
    h_nd: jax.Array,
    head_vd: jax.Array,
    targets_n: jax.Array,
    temperature: float,
    chunk: int,
    parts: int,
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    N, V = h_nd.shape[0], head_vd.shape[0]
    t = temperature if temperature > 0 else 1.0
    steps, cols = _head_chunks(head_vd, chunk, parts)

    Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def step(carry: Carry, xs: tuple[jax.Array, jax.Array]) -> tuple[Carry, None]:
        m, z, a, s_y = carry
        w_scd, col_sc = xs
        s = _chunk_scores(h_nd, w_scd, col_sc, V, t)
        m_new = jnp.maximum(m, s.max((-2, -1)))
        e = jnp.exp(s - m_new[:, None, None])
        rescale = jnp.exp(m - m_new)
        z = z * rescale + e.sum((-2, -1))
        a = a * rescale + jnp.where(e > 0, e * s, 0.0).sum((-2, -1))
        s_y = s_y + jnp.where(col_sc == targets_n[:, None, None], s, 0.0).sum((-2, -1))
        return (m_new, z, a, s_y), None

    init: Carry = (jnp.full((N,), -jnp.inf), jnp.zeros((N,)), jnp.zeros((N,)), jnp.zeros((N,)))
    (m, z, a, s_y), _ = jax.lax.scan(step, init, (steps, cols))
    log_z = m + jnp.log(z)
    mean_s = a / z
    return (s_y - log_z, log_z - mean_s), (h_nd, head_vd, targets_n, log_z, mean_s)


def _head_logprobs_bwd(
    temperature: float,
    chunk: int,
    parts: int,
    res: tuple[jax.Array, ...],
    g: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, None]:
    h_nd, head_vd, targets_n, log_z, mean_s = res
    g_logp, g_entropy = g
    V, D = head_vd.shape
    t = temperature if temperature > 0 else 1.0
    steps, cols = _head_chunks(head_vd, chunk, parts)

    def step(dh: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        w_scd, col_sc = xs
        s = _chunk_scores(h_nd, w_scd, col_sc, V, t)
        p = jnp.exp(s - log_z[:, None, None])  # 0 on the padding
        onehot = (col_sc == targets_n[:, None, None]).astype(jnp.float32)
        centred = jnp.where(p > 0, s - mean_s[:, None, None], 0.0)
        ds = g_logp[:, None, None] * (onehot - p) - g_entropy[:, None, None] * p * centred
        dlogits = (ds / t).astype(h_nd.dtype)
        dh = dh + jnp.einsum("nsc,scd->nd", dlogits, w_scd, preferred_element_type=jnp.float32)
        dw = jnp.einsum("nsc,nd->scd", dlogits, h_nd, preferred_element_type=jnp.float32)
        return dh, dw.astype(head_vd.dtype)

    dh, dw = jax.lax.scan(step, jnp.zeros(h_nd.shape, jnp.float32), (steps, cols))
    P = V // parts
    dw = dw.transpose(1, 0, 2, 3).reshape(parts, -1, D)[:, :P]  # each part's padding dropped
    return dh.astype(h_nd.dtype), dw.reshape(V, D), None


head_logprobs.defvjp(_head_logprobs_fwd, _head_logprobs_bwd)
