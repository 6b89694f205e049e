"""The training attention (`decoder.attention`, blocked causal) against a dense reference.

Rows of 300 tokens (three blocks of `ATTN_BLOCK`, the last partial) packing several segments
of unequal lengths, one segment crossing block boundaries, and trailing padding (segment 0).

Tolerances. The values are compared with a float64 numpy softmax over the full T x T mask:
the blocked fp32 computation differs from it only by fp32 rounding of K = 16-term dot
products and of softmax sums over at most 300 weights (unit roundoff 6e-8, a few hundred
roundings deep: ~1e-5 relative at worst), so outputs of magnitude ~1 agree to 1e-5. The
gradients are compared with autodiff of the same dense softmax in fp32 (the previous
implementation), normwise: both sum the same terms in different orders, so each entry's error
scales with the terms (the tensor's norm), 1e-5 as in tests/rl/test_learner.py.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.models.decoder import (
    ATTN_BLOCK,
    KV_BLOCK,
    WHOLE_CACHE_MAX,
    attention,
    cached_attention,
)

B, T, H, G, K = 2, 300, 4, 2, 16


def _segments() -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    seg[0, :40], seg[0, 40:170], seg[0, 170:290] = 1, 2, 3  # 290..299 padding
    seg[1, :260] = 1  # one long segment over every block, then padding
    return seg


def _mask(seg: np.ndarray) -> np.ndarray:
    causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
    return causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """The dense T x T masked softmax, in the shapes of `attention`."""
    qg = q.reshape(B, T, G, H // G, K)
    s = jnp.einsum("btgrk,bsgk->bgrts", qg, k) * K**-0.5
    p = jax.nn.softmax(jnp.where(mask_bts[:, None, None], s, -1e30), axis=-1)
    return jnp.einsum("bgrts,bsgk->btgrk", p, v).reshape(B, T, H, K)


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kq, (B, T, H, K)),
        jax.random.normal(kk, (B, T, G, K)),
        jax.random.normal(kv, (B, T, G, K)),
    )


def test_blocked_attention_equals_dense_on_packed_segments() -> None:
    assert T > 2 * ATTN_BLOCK and T % ATTN_BLOCK  # several blocks, the last one partial
    seg = _segments()
    q, k, v = _inputs()
    got = np.asarray(jax.jit(attention)(q, k, v, jnp.asarray(seg)), np.float64)
    assert np.isfinite(got).all()  # padding queries (all masked) too

    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    qg = q64.reshape(B, T, G, H // G, K)
    s = np.einsum("btgrk,bsgk->bgrts", qg, k64) * K**-0.5
    s = np.where(_mask(seg)[:, None, None], s, -np.inf)
    real = seg != 0  # rows of real tokens; padding rows are read by nothing
    s = np.where(real[:, None, None, :, None], s, 0.0)  # keep padding rows finite here
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bgrts,bsgk->btgrk", p, v64).reshape(B, T, H, K)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)


def test_blocked_attention_gradients_equal_dense() -> None:
    seg = _segments()
    q, k, v = _inputs()
    real = jnp.asarray(seg != 0, jnp.float32)[:, :, None, None]
    weights = jax.random.normal(jax.random.key(1), (B, T, H, K)) * real  # padding rows unread

    def loss(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
        return jnp.sum(fn(*args) * weights)

    blocked = jax.jit(
        jax.grad(lambda q, k, v: loss(attention, q, k, v, jnp.asarray(seg)), (0, 1, 2))
    )
    dense = jax.jit(
        jax.grad(lambda q, k, v: loss(_dense, q, k, v, jnp.asarray(_mask(seg))), (0, 1, 2))
    )
    for got, want in zip(blocked(q, k, v), dense(q, k, v), strict=True):
        got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got64 - want64) / np.linalg.norm(want64) <= 1e-5


def test_cached_attention_read_whole_or_in_blocks_equals_the_softmax() -> None:
    """Decode attention over a cache (`cached_attention`): rows 0-1 of 3 cache rows, a chunk
    of 3 new tokens at different positions. A cache of `WHOLE_CACHE_MAX` positions is read
    whole, a longer one (the same contents, then garbage past every row's end) in blocks;
    both against a float64 softmax over each query's positions. Bound from the same counting
    as above: the scores are 16-term dot products and the sums run over at most S weights, so
    each output, a weighted mean of values, is off by at most (K + S) unit roundoffs of the
    largest value."""
    n_rows, rows, new, S = 3, 2, 3, WHOLE_CACHE_MAX
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (rows, new, H, K))
    k_long = jax.random.normal(kk, (n_rows, G, S + 2 * KV_BLOCK, K))
    v_long = jax.random.normal(kv, (n_rows, G, S + 2 * KV_BLOCK, K))
    pos = jnp.asarray([5, S - new])  # each row's first new token's position
    whole = cached_attention(q, k_long[:, :, :S], v_long[:, :, :S], pos, kv_len=S)
    blocks = cached_attention(q, k_long, v_long, pos, kv_len=S)

    k64, v64 = np.asarray(k_long, np.float64), np.asarray(v_long, np.float64)
    qg = np.asarray(q, np.float64).reshape(rows, new, G, H // G, K)
    s = np.einsum("btgrk,bgsk->bgrts", qg, k64[:rows]) * K**-0.5
    last = np.asarray(pos)[:, None] + np.arange(new)  # [rows, new]: each query's position
    seen = np.arange(k64.shape[2])[None, None, :] <= last[..., None]
    s = np.where(seen[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bgrts,bgsk->btgrk", p, v64[:rows]).reshape(rows, new, H, K)
    bound = (K + S) * 2.0**-24 * np.abs(v64).max()
    for got in (whole, blocks):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=bound, rtol=0)
