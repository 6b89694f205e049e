"""Sliding-window (local) attention, Gemma 3's ``sliding_attention`` layers: a query at
position p reads the keys at positions s with ``s <= p`` and ``p - s < W`` (transformers'
sliding-window causal mask), in every attention path: training (`decoder.attention`, packed
segments and tree rows, and its gradient; `decoder.exact_training_attention`), and serving
over pages (`paged_attention`, `ragged_attention`, `chunk_attention`, `token_attention`, and
through `PagedChunk` and a ragged step's `RaggedStep`). Windows of 3, 5, 8 and 13 positions
cut pages of 4 and 8 positions; ``sliding_window=None`` is the global layer, bit for bit the
call without the keyword.

References: a dense float64 softmax over each query's visible keys (none visible: zeros).
Tolerances, from fp32 rounding (u = 2^-24): each score is a K-term dot product and each
output a weighted mean of at most S values (S the keys a query reads, at most W), its
weights summed over at most S terms and rescaled once per step of an online softmax (fewer
steps than keys): an output is off by at most (K + 2 S + 2) u times the largest |value|.
Gradients are compared normwise with autodiff of the dense softmax in fp32, each within
(K + 2 S) u of the exact one: 2 (K + 2 S) u apart.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jax_agent_rl.models import Sharder, make_mesh
from jax_agent_rl.models.attention_kernels import forced_kernel
from jax_agent_rl.models.decoder import (
    ATTN_BLOCK,
    attention,
    exact_training_attention,
    key_blocks,
    segment_reach,
)
from jax_agent_rl.models.paged import (
    CHUNK_PAGES,
    PagedChunk,
    PagePairs,
    RaggedStep,
    StepChunks,
    StepRows,
    check_sliding_window,
    chunk_attention,
    decode_steps,
    exact_attention,
    page_pairs,
    paged_attention,
    pair_block,
    ragged_attention,
    segment_positions,
    token_attention,
)
from jax_agent_rl.models.sharding import one_device_sharder

H, G, K = 4, 2, 16
R = H // G
U = 2.0**-24
WINDOWS = (3, 5, 8, 13)


def _bound(window: int, v: Any) -> float:
    """The forward's bound (module docstring) for queries that read at most ``window`` keys."""
    return (K + 2 * window + 2) * U * float(np.abs(v).max())


def _softmax64(q_thk: Any, k_sgk: Any, v_sgk: Any, seen_ts: np.ndarray) -> np.ndarray:
    """float64 softmax attention [T, H, K] of queries [T, H, K] over keys and values [S, G,
    K] where ``seen_ts``; a query that sees nothing gives zeros."""
    T = q_thk.shape[0]
    q = np.asarray(q_thk, np.float64).reshape(T, G, R, K)
    k, v = np.asarray(k_sgk, np.float64), np.asarray(v_sgk, np.float64)
    s = np.einsum("tgrk,sgk->grts", q, k) * K**-0.5
    s = np.where(seen_ts, s, -np.inf)
    top = np.where(seen_ts.any(-1), s.max(-1), 0.0)[..., None]
    p = np.exp(s - top)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("grts,sgk->tgrk", p, v).reshape(T, H, K)


def _window_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """[..., T, S]: key position at or before the query's and, with a window, less than
    ``window`` behind it."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    return (diff >= 0) & (diff < (window if window is not None else np.iinfo(np.int64).max))


def test_a_window_that_is_not_a_positive_int_is_refused() -> None:
    for ok in (None, 1, 13, jnp.int32(4)):
        assert check_sliding_window(ok) is ok
    for bad in (0, -3, True, 2.5, "8", np.int64(8), jnp.float32(8), jnp.int32(0), (4,)):
        with pytest.raises(ValueError, match="sliding_window="):
            check_sliding_window(bad)
    q, kv = jnp.ones((1, 8, H, K)), jnp.ones((1, 8, G, K))
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="without positions_bt"):
        attention(q, kv, kv, seg, sharder=one_device_sharder(), sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window=0"):
        paged_attention(
            q, jnp.ones((G, 4, 4, K)), jnp.ones((G, 4, 4, K)), seg, seg[:, 0], 2, sliding_window=0
        )
    # a layer refused its window has not spent its one call of the forward
    pools = (jnp.zeros((G, 4, 4, K)),)
    table, zero, two = jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32), jnp.full(1, 2)
    chunk = PagedChunk(one_device_sharder(), pools, pools, table, zero, two, 1, "ragged", 1, 2)
    with pytest.raises(ValueError, match="sliding_window=-1"):
        chunk.attend(0, q[:, :2], kv[:, :2], kv[:, :2], sliding_window=-1)
    chunk.attend(0, q[:, :2], kv[:, :2], kv[:, :2], sliding_window=1)
    assert len(chunk.k) == 1


# ------------------------------------------------------------------- training attention

T = 300  # three query blocks of `ATTN_BLOCK`, the last partial


def _qkv(B: int, T: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q, k, v and an output cotangent."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(kq, (B, T, H, K)),
        jax.random.normal(kk, (B, T, G, K)),
        jax.random.normal(kv, (B, T, G, K)),
        jax.random.normal(kd, (B, T, H, K)),
    )


def _packed() -> np.ndarray:
    """Two rows of packed segments: several a row, one crossing every block, padding (0)
    between and after them."""
    seg = np.zeros((2, T), np.int32)
    seg[0, :40], seg[0, 40:170], seg[0, 172:290] = 1, 2, 3  # padding 170, 171 and 290..
    seg[1, :7], seg[1, 7:270] = 1, 2
    return seg


def _dense_fp32(q: jax.Array, k: jax.Array, v: jax.Array, mask_bts: np.ndarray) -> jax.Array:
    """The dense masked softmax in fp32, in `attention`'s shapes (a query that sees no key:
    uniform weights, not read here)."""
    B, T = mask_bts.shape[:2]
    s = jnp.einsum("btgrk,bsgk->bgrts", q.reshape(B, T, G, R, K), k) * K**-0.5
    p = jax.nn.softmax(jnp.where(mask_bts[:, None, None], s, -1e30), axis=-1)
    return jnp.einsum("bgrts,bsgk->btgrk", p, v).reshape(B, T, H, K)


def _check_training(
    run: Callable[..., jax.Array],
    mask_bts: np.ndarray,
    real_bt: np.ndarray,
    window: int,
    seed: int,
) -> None:
    """``run(q, k, v)``'s output against the float64 softmax under ``mask_bts`` and its
    gradients (of <output, cotangent>, the cotangent zero on padding) against autodiff of
    the fp32 dense softmax, at the module's bounds for ``window`` keys a query."""
    B, T = mask_bts.shape[:2]
    q, k, v, dout = _qkv(B, T, seed)
    dout = dout * jnp.asarray(real_bt)[:, :, None, None]
    got, pull = jax.vjp(jax.jit(run), q, k, v)
    grads = jax.jit(pull)(dout)
    for b in range(mask_bts.shape[0]):
        want = _softmax64(q[b], k[b], v[b], mask_bts[b])
        np.testing.assert_allclose(
            np.asarray(got[b])[real_bt[b]], want[real_bt[b]], atol=_bound(window, v), rtol=0
        )

    def dense(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(_dense_fp32(q, k, v, mask_bts) * dout)

    for got_g, want_g in zip(grads, jax.jit(jax.grad(dense, (0, 1, 2)))(q, k, v), strict=True):
        got64, want64 = np.asarray(got_g, np.float64), np.asarray(want_g, np.float64)
        rel = np.linalg.norm(got64 - want64) / np.linalg.norm(want64)
        assert rel <= 2 * (K + 2 * window) * U, rel


@pytest.mark.parametrize("window", [5, 13, 130])
def test_training_attention_over_packed_segments_reads_its_window(window: int) -> None:
    """Packed rows (positions restarting at 0 in each segment): outputs and gradients
    against the dense softmax under segment & causal & window masks. Windows under a block
    (key blocks wholly further back are skipped: fewer are read than without a window) and
    one over a block."""
    seg = _packed()
    positions = np.asarray(segment_positions(jnp.asarray(seg)))
    idx = np.arange(T)
    mask = (
        (seg[:, :, None] == seg[:, None, :])
        & (seg[:, None, :] != 0)
        & (idx[:, None] >= idx[None, :])
        & _window_mask(positions, positions, window)
    )
    one = one_device_sharder()
    run = partial(
        attention,
        segment_ids_bt=jnp.asarray(seg),
        sharder=one,
        positions_bt=jnp.asarray(positions),
        sliding_window=window,
    )
    _check_training(run, mask, seg != 0, window, seed=window)
    pad = ((0, 0), (0, 3 * ATTN_BLOCK - T))
    reach = jnp.pad(segment_reach(jnp.asarray(seg)), pad)
    sliding = (jnp.pad(jnp.asarray(positions), pad), jnp.int32(window))
    read, read_windowed = key_blocks(reach)[1].sum(), key_blocks(reach, sliding)[1].sum()
    assert read_windowed < read if window < ATTN_BLOCK else read_windowed == read


def test_training_attention_over_tree_rows_counts_positions_not_indices() -> None:
    """Tree rows (``reach_bt``): a prefix of 100 (positions 0..99) read by two branches laid
    after it, each at positions from 100 (the second's indices 180.., its positions 100..):
    a window reaches into the prefix by positions. The second branch does not move when
    the first's keys do."""
    reach = np.zeros((2, T), np.int32)
    positions = np.zeros((2, T), np.int32)
    reach[0, :100], reach[0, 100:180], reach[0, 180:290] = 290, 180, 290
    positions[0, :100], positions[0, 100:180] = np.arange(100), 100 + np.arange(80)
    positions[0, 180:290] = 100 + np.arange(110)
    seg = _packed()[1]
    reach[1] = np.asarray(segment_reach(jnp.asarray(seg[None])))[0]
    positions[1] = np.asarray(segment_positions(jnp.asarray(seg[None])))[0]
    idx = np.arange(T)
    visible = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, :, None] < reach[:, None, :])
    segments = jnp.asarray((reach > 0).astype(np.int32))
    one = one_device_sharder()
    for window in (13, 100):
        mask = visible & _window_mask(positions, positions, window)
        assert mask[0, 180, 99]  # 81 indices back, 1 position
        run = partial(
            attention,
            segment_ids_bt=segments,
            sharder=one,
            reach_bt=jnp.asarray(reach),
            positions_bt=jnp.asarray(positions),
            sliding_window=window,
        )
        _check_training(run, mask, reach > 0, window, seed=window)
        q, k, v, _ = _qkv(2, T, 0)
        moved = [x.at[0, 100:180].multiply(-3.0) for x in (k, v)]
        np.testing.assert_array_equal(
            np.asarray(jax.jit(run)(q, *moved))[0, 180:], np.asarray(jax.jit(run)(q, k, v))[0, 180:]
        )


def test_splash_applies_a_static_window_as_its_local_mask() -> None:
    """Packed rows on the TPU kernel (splash, in Pallas's TPU interpret mode), whose local
    mask counts indices: within a packed segment those are the positions. Against the
    dense softmax at the module's bounds (fp32 inputs: the kernel's roundings are fp32's, its
    scaling of q by 1/4 exact). The Triton kernel takes no window: the XLA loop."""
    seg = _packed()
    positions = segment_positions(jnp.asarray(seg))
    idx = np.arange(T)
    window = 13
    mask = (
        (seg[:, :, None] == seg[:, None, :])
        & (seg[:, None, :] != 0)
        & (idx[:, None] >= idx[None, :])
        & _window_mask(np.asarray(positions), np.asarray(positions), window)
    )

    def run(q: jax.Array, k: jax.Array, v: jax.Array, kernel: str = "splash") -> jax.Array:
        with forced_kernel(kernel):
            return attention(
                q, k, v, jnp.asarray(seg), sharder=one_device_sharder(),
                positions_bt=positions, sliding_window=window,
            )  # fmt: skip

    with pltpu.force_tpu_interpret_mode():
        _check_training(run, mask, seg != 0, window, seed=4)
    q, k, v, _ = _qkv(2, T, 4)
    assert "pallas_call" in str(jax.make_jaxpr(run)(q, k, v))  # the kernel, not the loop
    assert "pallas_call" not in str(jax.make_jaxpr(partial(run, kernel="triton"))(q, k, v))


def test_a_window_scanned_with_the_layers_is_the_static_one() -> None:
    """A window given as an int32 scalar (traced: one program for layers of any window, as
    a layer scan passes it) computes what the static int does, bit for bit, forward and
    gradient."""
    seg = jnp.asarray(_packed())
    positions = segment_positions(seg)
    q, k, v, dout = _qkv(2, T, 1)
    one = one_device_sharder()

    def out_and_grads(window: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return attention(
                q, k, v, seg, sharder=one, positions_bt=positions, sliding_window=window
            )

        out, pull = jax.vjp(run, q, k, v)
        return out, *pull(dout)

    static = jax.jit(partial(out_and_grads, 13))(q, k, v)
    traced = jax.jit(out_and_grads)(jnp.int32(13), q, k, v)
    for a, b in zip(static, traced, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_window_is_the_call_without_the_keyword_bit_for_bit() -> None:
    """``sliding_window=None`` (and positions given or not) is today's training attention,
    forward and gradient, and today's exact attention."""
    seg = jnp.asarray(_packed())
    q, k, v, dout = _qkv(2, T, 2)
    one = one_device_sharder()

    def both(fn: Callable[..., jax.Array]) -> Any:
        out, pull = jax.vjp(fn, q, k, v)
        return out, *pull(dout)

    positions = segment_positions(seg)

    def none_given(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention(q, k, v, seg, sharder=one, positions_bt=positions, sliding_window=None)

    plain = jax.jit(lambda: both(lambda q, k, v: attention(q, k, v, seg, sharder=one)))()
    none = jax.jit(lambda: both(none_given))()
    for a, b in zip(plain, none, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    short = seg[:, :40]
    args = (q[:, :40], k[:, :40], v[:, :40], short, 8, None, one)
    plain_exact = jax.jit(lambda: exact_training_attention(*args))()
    none_exact = jax.jit(lambda: exact_training_attention(*args, None, None))()
    np.testing.assert_array_equal(np.asarray(plain_exact), np.asarray(none_exact))


@pytest.mark.parametrize("page_size", [4, 8])
def test_exact_training_attention_reads_its_window_with_attention_s_gradient(
    page_size: int,
) -> None:
    """The exact-logprob attention (decode's numbers for each packed token: `exact_attention`
    through `token_attention`) with each window, pages of 4 and 8: the float64 softmax of
    each token's segment window; its gradient is `attention`'s with the segments' positions,
    bit for bit (positions given or counted from the segments alike)."""
    seg = np.zeros((2, 40), np.int32)
    seg[0, :17], seg[0, 17:37] = 1, 2  # then padding
    seg[1, :3], seg[1, 3:40] = 1, 2
    positions = segment_positions(jnp.asarray(seg))
    q, k, v, dout = _qkv(2, 40, 3)
    dout = dout * jnp.asarray(seg != 0)[:, :, None, None]
    one = one_device_sharder()
    segments = jnp.asarray(seg)

    @jax.jit
    def exact(window: jax.Array, given: jax.Array | None) -> tuple[jax.Array, ...]:
        def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return exact_training_attention(q, k, v, segments, page_size, 37, one, given, window)

        out, pull = jax.vjp(run, q, k, v)
        return out, *pull(dout)

    @jax.jit
    def trained(window: jax.Array) -> tuple[jax.Array, ...]:
        def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return attention(
                q, k, v, segments, 37, sharder=one, positions_bt=positions, sliding_window=window
            )

        return jax.vjp(run, q, k, v)[1](dout)

    idx = np.arange(40)
    real = seg != 0
    for window in WINDOWS:  # as int32 scalars: one program for every window
        w = jnp.int32(window)
        out = exact(w, None)[0]
        for given in (None, positions):
            for a, b in zip(exact(w, given)[1:], trained(w), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        mask = (
            (seg[:, :, None] == seg[:, None, :])
            & (seg[:, None, :] != 0)
            & (idx[:, None] >= idx[None, :])
            & _window_mask(np.asarray(positions), np.asarray(positions), window)
        )
        for b in range(2):
            want = _softmax64(q[b], k[b], v[b], mask[b])
            np.testing.assert_allclose(
                np.asarray(out[b])[real[b]], want[real[b]], atol=_bound(window, v), rtol=0
            )
        direct = exact_attention(q, k, v, segments, page_size, 37, sliding_window=window)
        np.testing.assert_array_equal(np.asarray(direct), np.asarray(out))


# -------------------------------------------------------------------------- over pages


def _pool(num_pages: int, page_size: int, seed: int) -> tuple[jax.Array, jax.Array]:
    kk, kv = jax.random.split(jax.random.key(seed))
    return (
        jax.random.normal(kk, (G, num_pages, page_size, K)),
        jax.random.normal(kv, (G, num_pages, page_size, K)),
    )


def _sequence(pages: jax.Array, table: list[int], length: int) -> np.ndarray:
    """A sequence's keys or values [length, G, K] read from ``pages`` through its table."""
    x = np.asarray(pages, np.float64)
    return np.concatenate([x[:, p].transpose(1, 0, 2) for p in table])[:length]


def _table(tables: list[list[int]], width: int, fill: int = 0) -> jax.Array:
    out = np.full((len(tables), width), fill, np.int32)
    for b, t in enumerate(tables):
        out[b, : len(t)] = t
    return jnp.asarray(out)


@pytest.mark.parametrize("page_size", [4, 8])
def test_ragged_attention_reads_only_its_window_exactly(page_size: int) -> None:
    """Decode rows (`ragged_attention`) of 1 position, of 9 pages, of a page and one
    token, and an idle row, each window: the float64 softmax over the last W positions. A
    row's pages wholly before its window add exactly nothing: the row's result is bit for
    bit that of its window's pairs alone (pages outside it hold values 1e4 times larger:
    any weight on them would show)."""
    ps = page_size
    lengths = [1, 9 * ps - 2, ps + 1, 3]
    tables = [[20], list(range(2, 11)), [30, 12], [40]]
    active = jnp.asarray([True, True, True, False])
    k_pages, v_pages = _pool(48, ps, seed=ps)
    q = jax.random.normal(jax.random.key(11), (4, H, K))
    pos = jnp.asarray(lengths) - 1
    table = _table(tables, 12)
    C = pair_block(ps)
    pairs = page_pairs(table, pos, active, 2 * C, ps)
    run = jax.jit(ragged_attention)
    for window in WINDOWS:
        first = [max(0, n - window) // ps for n in lengths]  # each row's first page it reads
        loud = v_pages
        for t, f in zip(tables, first, strict=True):
            loud = loud.at[:, jnp.asarray(t[:f], jnp.int32)].multiply(1e4)
        got = np.asarray(run(q, k_pages, loud, pairs, pos, sliding_window=window))
        for b, (t, n) in enumerate(zip(tables, lengths, strict=True)):
            if not active[b]:
                assert not got[b].any()
                continue
            seen = _window_mask(np.asarray([n - 1]), np.arange(n), window)
            want = _softmax64(q[b : b + 1], _sequence(k_pages, t, n), _sequence(loud, t, n), seen)
            bound = _bound(window, _sequence(v_pages, t, n))
            np.testing.assert_allclose(got[b], want[0], atol=bound, rtol=0)
        # the window's own pairs only, hand-built: the same numbers
        own = [
            (b, t[i], i * ps)
            for b, (t, n) in enumerate(zip(tables, lengths, strict=True))
            if active[b]
            for i in range(first[b], (n - 1) // ps + 1)
        ]
        own += [(4, 0, 0)] * (2 * C - len(own))  # padding pairs: row B
        row, page, start = (jnp.asarray(x, jnp.int32) for x in zip(*own, strict=True))
        own_pairs = PagePairs(row=row, page=page, start=start)
        alone = np.asarray(run(q, k_pages, loud, own_pairs, pos, sliding_window=window))
        np.testing.assert_array_equal(alone, got)
    none = run(q, k_pages, v_pages, pairs, pos, sliding_window=None)
    np.testing.assert_array_equal(
        np.asarray(none), np.asarray(run(q, k_pages, v_pages, pairs, pos))
    )


@pytest.mark.parametrize("page_size", [4, 8])
def test_paged_and_token_attention_read_only_their_window(page_size: int) -> None:
    """A prefill chunk of 6 new tokens in two rows (from positions 3 and 3 pages + 5) over 6
    pages each (`paged_attention`), and the same queries one row each (`token_attention`,
    the exact path): the float64 softmax over each query's last W positions."""
    ps, new, pages_read = page_size, 6, 6
    tables = [[7, 2, 9, 0, 4, 11], [3, 10, 6, 8, 12, 13]]
    start = [3, 3 * ps + 5]
    k_pages, v_pages = _pool(16, ps, seed=20 + ps)
    q = jax.random.normal(jax.random.key(21), (2, new, H, K))
    table, pos = _table(tables, 6), jnp.asarray(start)
    positions = (pos[:, None] + jnp.arange(new)).reshape(-1)
    flat = jnp.repeat(table, new, axis=0)
    real = jnp.ones(2 * new, bool)
    for window in (*WINDOWS, None):
        chunk = jax.jit(paged_attention, static_argnums=5)(
            q, k_pages, v_pages, table, pos, pages_read, sliding_window=window
        )
        token = jax.jit(token_attention)(
            q, k_pages, v_pages, flat, positions, real, sliding_window=window
        )
        for b in range(2):
            n = start[b] + new
            keys, values = _sequence(k_pages, tables[b], n), _sequence(v_pages, tables[b], n)
            seen = _window_mask(start[b] + np.arange(new), np.arange(n), window)
            want = _softmax64(q[b], keys, values, seen)
            bound = _bound(window or n, values)
            np.testing.assert_allclose(np.asarray(chunk[b]), want, atol=bound, rtol=0)
            np.testing.assert_allclose(np.asarray(token[b]), want, atol=bound, rtol=0)
    plain = paged_attention(q, k_pages, v_pages, table, pos, pages_read)
    none = paged_attention(q, k_pages, v_pages, table, pos, pages_read, sliding_window=None)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(none))
    plain = token_attention(q, k_pages, v_pages, flat, positions, real)
    none = token_attention(q, k_pages, v_pages, flat, positions, real, sliding_window=None)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(none))


# prompt chunks of a ragged step (row, size, start, pages): one from position 0 over one query
# block; one over two query blocks whose windows start trips of `CHUNK_PAGES` pages in; a short
# one from mid-page
CHUNKS = ((3, 7, 0, 2), (10, 40, 37, 20), (50, 3, 9, 3))


def _chunks(M: int) -> tuple[StepChunks, list[list[int]]]:
    """`CHUNKS` with their page tables (disjoint, scattered), a fourth past the count."""
    tables, at = [], 1
    for _, _, _, n in CHUNKS:
        tables.append(list(range(at + n - 1, at - 1, -1)))  # pages in reverse order
        at += n
    row, size, start = (jnp.asarray([*(c[i] for c in CHUNKS), 60], jnp.int32) for i in range(3))
    return StepChunks(
        row=row,
        size=size,
        start=start,
        table=_table([*tables, tables[0]], M),
        count=jnp.asarray([3], jnp.int32),
    ), tables


def test_chunk_attention_reads_only_its_window() -> None:
    """The prompt chunks of a ragged step (`chunk_attention`), pages of 4, each window: the
    float64 softmax over each query's last W positions; the rows of no chunk are zeros. A
    window of 3 starts the second chunk's second query block 4 trips in."""
    ps, N, M = 4, 64, 20
    chunks, tables = _chunks(M)
    k_pages, v_pages = _pool(32, ps, seed=30)
    q = jax.random.normal(jax.random.key(31), (N, H, K))
    assert (37 + 32 - 3 + 1) // (CHUNK_PAGES * ps) == 4
    run = jax.jit(chunk_attention)
    for window in (*WINDOWS, None):
        got = np.asarray(run(q, k_pages, v_pages, chunks, sliding_window=window))
        inside = np.zeros(N, bool)
        for (row, size, start, _), table in zip(CHUNKS, tables, strict=True):
            n = start + size
            keys, values = _sequence(k_pages, table, n), _sequence(v_pages, table, n)
            seen = _window_mask(start + np.arange(size), np.arange(n), window)
            want = _softmax64(q[row : row + size], keys, values, seen)
            trips = -(-n // (CHUNK_PAGES * ps))
            bound = _bound((window or n) + trips, values)
            np.testing.assert_allclose(got[row : row + size], want, atol=bound, rtol=0)
            inside[row : row + size] = True
        assert not got[~inside].any()
    plain = chunk_attention(q, k_pages, v_pages, chunks)
    none = chunk_attention(q, k_pages, v_pages, chunks, sliding_window=None)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(none))


# ----------------------------------------------------------------- a forward's layers


def _step(ps: int) -> tuple[StepRows, list[tuple[int, int, list[int]]], int]:
    """A ragged step (`StepRows`, one shard) of 64 rows: 3 decode rows (position 45 over 12
    pages, most of them before a small window; position 2; an idle one), then `CHUNKS`'
    prompt chunks (moved past the decode rows), padding rows after. Returns the rows, each
    real row's (row, position, page table), and the pool's pages."""
    N, M = 64, 20
    chunks, tables = _chunks(M)
    at = 1 + sum(c[3] for c in CHUNKS)
    decode_tables = [list(range(at, at + 12)), [at + 12], [at + 13]]
    num_pages = at + 14
    pos_r = jnp.asarray([45, 2, 0], jnp.int32)
    real: list[tuple[int, int, list[int]]] = [(0, 45, decode_tables[0]), (1, 2, decode_tables[1])]
    pos = np.zeros(N, np.int32)
    page = np.full(N, num_pages, np.int32)
    for row, p, table in real:
        pos[row], page[row] = p, table[p // ps]
    for (row, size, start, _), table in zip(CHUNKS, tables, strict=True):
        for t in range(size):
            pos[row + t], page[row + t] = start + t, table[(start + t) // ps]
            real.append((row + t, start + t, table))
    rows = StepRows(
        pos=jnp.asarray(pos),
        page=jnp.asarray(page),
        table_r=_table(decode_tables, M, fill=decode_tables[0][0]),
        pos_r=pos_r,
        decode_r=jnp.asarray([True, True, False]),
        chunks=chunks,
    )
    return rows, real, num_pages


def test_a_ragged_step_s_layers_read_each_its_own_window() -> None:
    """`RaggedStep` over `StepRows` (pages of 4), four layers of windows 3, 8, none and 13:
    each row's key and value go into its page, then every real row (decode rows, one whose
    window leaves 10 of its 12 pages out; prompt chunks whose windows cut their pages)
    attends to its window: the float64 softmax of its sequence's keys as the step leaves
    them. The idle decode row and the padding rows give zeros. Under the TPU decode kernel
    ("pallas") the windowed layers decode by `ragged_attention` (the same numbers, bit for
    bit; the program holds one Pallas call: the global layer's)."""
    ps = 4
    rows, real, num_pages = _step(ps)
    windows = (3, 8, None, 13)
    pool = _pool(num_pages, ps, seed=40)
    keys = jax.random.split(jax.random.key(41), 3)
    q = jax.random.normal(keys[0], (64, 1, H, K))
    k_new, v_new = (jax.random.normal(x, (64, 1, G, K)) for x in keys[1:])

    def run(kernel: str, windows: tuple[int | None, ...]) -> tuple[Any, ...]:
        k_pools, v_pools = (tuple(pool[i] for _ in windows) for i in (0, 1))
        step = RaggedStep(one_device_sharder(), k_pools, v_pools, rows, kernel)
        outs = [step.attend(i, q, k_new, v_new, sliding_window=w) for i, w in enumerate(windows)]
        return outs, step.k, step.v

    outs, ck, cv = jax.jit(partial(run, "ragged", windows))()
    read = np.zeros(64, bool)
    for i, window in enumerate(windows):
        got = np.asarray(outs[i])[:, 0]
        for row, p, table in real:
            keys_, values = _sequence(ck[i], table, p + 1), _sequence(cv[i], table, p + 1)
            seen = _window_mask(np.asarray([p]), np.arange(p + 1), window)
            want = _softmax64(q[row], keys_, values, seen)[0]
            trips = -(-(p + 1) // (CHUNK_PAGES * ps))
            bound = _bound((window or p + 1) + trips, values)
            np.testing.assert_allclose(got[row], want, atol=bound, rtol=0)
            read[row] = True
        assert not got[~read].any()
    assert (ps * 10 <= 45 - 3) and (ps * 11 > 45 - 3)  # row 0, window 3: 10 pages wholly out
    pallas = jax.jit(partial(run, "pallas", (3, 13)))()
    for got, want in zip(pallas[0], (outs[0], outs[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    program = str(jax.make_jaxpr(partial(run, "pallas", (3, None, 13)))())
    assert program.count("pallas_call") == 1


def test_a_paged_chunk_s_layers_read_each_its_own_window() -> None:
    """`PagedChunk`, pages of 8, layers of windows 5 and none: a prefill chunk (6 tokens
    from position 9, `paged_attention`), the same chunk exact (`token_attention`), and a
    decode step (position 27; under the TPU decode kernel the windowed layer decodes by
    `ragged_attention`, bit for bit the "ragged" kernel's): the float64 softmax over each
    query's window of the row's keys as the chunk leaves them."""
    ps, windows = 8, (5, None)
    table = jnp.asarray([[3, 1, 4, 6]], jnp.int32)
    pool = _pool(8, ps, seed=50)
    keys = jax.random.split(jax.random.key(51), 3)

    def run(
        T: int, start: int, kernel: str, exact: bool, windows: tuple[int | None, ...] = windows
    ) -> tuple[Any, ...]:
        q = jax.random.normal(keys[0], (1, T, H, K))
        k, v = (jax.random.normal(x, (1, T, G, K)) for x in keys[1:])
        k_pools, v_pools = (tuple(p for _ in windows) for p in pool)
        pos, new = jnp.asarray([start], jnp.int32), jnp.asarray([T], jnp.int32)
        pages_read = 4 if T > 1 else None
        chunk = PagedChunk(
            one_device_sharder(), k_pools, v_pools, table, pos, new, pages_read, kernel, 1, T,
            exact=exact,
        )  # fmt: skip
        outs = [chunk.attend(i, q, k, v, sliding_window=w) for i, w in enumerate(windows)]
        return q, outs, chunk.k, chunk.v

    for T, start, exact in ((6, 9, False), (6, 9, True), (1, 27, False)):
        q, outs, ck, cv = jax.jit(partial(run, T, start, "ragged", exact))()
        for i, window in enumerate(windows):
            n = start + T
            keys_, values = _sequence(ck[i], [3, 1, 4, 6], n), _sequence(cv[i], [3, 1, 4, 6], n)
            seen = _window_mask(start + np.arange(T), np.arange(n), window)
            want = _softmax64(q[0], keys_, values, seen)
            bound = _bound(window or n, values)
            np.testing.assert_allclose(np.asarray(outs[i][0]), want, atol=bound, rtol=0)
    windowed = jax.jit(partial(run, 1, 27, "pallas", False, (5,)))()[1][0]
    np.testing.assert_array_equal(np.asarray(windowed), np.asarray(outs[0]))


def test_sharded_decode_layers_read_each_its_own_window() -> None:
    """`decode_steps`' layer under ``shard_map`` on a data=4 x tensor=2 mesh of fake CPU
    devices (the window goes in replicated), pages of 4, 8 rows, two a shard, each over its
    shard's pages (a long row, most of it before the window; an idle row): each window's
    result is the float64 softmax over the row's last W positions, and under the TPU decode
    kernel the windowed layer's is the "ragged" kernel's, bit for bit."""
    ps, local, shards = 4, 8, 4
    sharder = Sharder(make_mesh(data=shards, fsdp=1, tensor=2))
    lengths = [26, 3, 1, 9, 13, 5, 7, 2]
    # row b decodes on shard b // 2, over pages of its range (0..7 on shard 0, 8.. on 1, ...)
    tables = [
        [0, 1, 2, 3, 4, 5, 6], [7], [8], [9, 10, 11],
        [16, 17, 18, 19], [23, 22], [24, 25], [31],
    ]  # fmt: skip
    active = jnp.asarray([True, True, False, True, True, True, True, True])
    pos = jnp.asarray(lengths) - 1
    table = _table(tables, local)
    for b, t in enumerate(tables):  # entries past a row's pages: its shard's first page
        table = table.at[b, len(t) :].set((b // 2) * local)
    k_pages, v_pages = _pool(shards * local, ps, seed=60)
    keys = jax.random.split(jax.random.key(61), 3)
    q = jax.random.normal(keys[0], (8, H, K))
    k_new, v_new = (jax.random.normal(x, (8, G, K)) for x in keys[1:])

    def step(kernel: str, window: int | None) -> tuple[jax.Array, ...]:
        make_tables, layer = decode_steps(sharder, shards * local, ps, kernel)
        tables_ = make_tables(table, pos, active)
        args = (q, k_new, v_new, k_pages, v_pages, tables_, pos, active)
        return layer(*args, sliding_window=window)

    for window in (3, 8):
        out, ck, cv = jax.jit(partial(step, "ragged", window))()
        got = np.asarray(out)
        for b, (t, n) in enumerate(zip(tables, lengths, strict=True)):
            if not active[b]:
                assert not got[b].any()
                continue
            values = _sequence(cv, t, n)
            seen = _window_mask(np.asarray([n - 1]), np.arange(n), window)
            want = _softmax64(q[b : b + 1], _sequence(ck, t, n), values, seen)[0]
            np.testing.assert_allclose(got[b], want, atol=_bound(window, values), rtol=0)
        pallas = jax.jit(partial(step, "pallas", window))()[0]
        np.testing.assert_array_equal(np.asarray(pallas), got)
