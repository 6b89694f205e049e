"""The training attention (`decoder.attention`, blocked causal) and the serving attentions over
KV pages (`paged_attention`, `ragged_attention`) against a dense reference.

Rows of 300 tokens (three blocks of `ATTN_BLOCK`, the last partial) packing several segments
of unequal lengths, one segment crossing block boundaries, and trailing padding (segment 0).

The TPU kernel (`pallas_paged_attention`) is checked in Pallas's TPU interpret mode on CPU, the GPU
(Triton) one (`triton_paged_attention`) in its generic interpret mode.

Tolerances. The values are compared with a float64 numpy softmax over the full T x T mask:
the blocked fp32 computation differs from it only by fp32 rounding of K = 16-term dot
products and of softmax sums over at most 300 weights (unit roundoff 6e-8, a few hundred
roundings deep: ~1e-5 relative at worst), so outputs of magnitude ~1 agree to 1e-5. The
gradients are compared with autodiff of the same dense softmax in fp32 (the previous
implementation), normwise: both sum the same terms in different orders, so each entry's error
scales with the terms (the tensor's norm), 1e-5 as in tests/rl/test_learner.py.
"""

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from jax_agent_rl.models import Sharder, make_mesh
from jax_agent_rl.models.decoder import ATTN_BLOCK, attention, key_blocks
from jax_agent_rl.models.paged import (
    CHUNK_PAGES,
    StepChunks,
    chunk_attention,
    decode_steps,
    page_pairs,
    paged_attention,
    pair_block,
    pallas_paged_attention,
    ragged_attention,
    triton_paged_attention,
)
from jax_agent_rl.models.sharding import one_device_sharder

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
    got = np.asarray(
        jax.jit(partial(attention, sharder=one_device_sharder()))(q, k, v, jnp.asarray(seg)),
        np.float64,
    )
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
        jax.grad(
            lambda q, k, v: loss(
                partial(attention, sharder=one_device_sharder()), q, k, v, jnp.asarray(seg)
            ),
            (0, 1, 2),
        )
    )
    dense = jax.jit(
        jax.grad(lambda q, k, v: loss(_dense, q, k, v, jnp.asarray(_mask(seg))), (0, 1, 2))
    )
    for got, want in zip(blocked(q, k, v), dense(q, k, v), strict=True):
        got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got64 - want64) / np.linalg.norm(want64) <= 1e-5


def _reference(q_btgrk: np.ndarray, k_bsgk: np.ndarray, v_bsgk: np.ndarray, last_bt: np.ndarray):  # type: ignore[no-untyped-def]
    """float64 softmax attention of queries [B, T, G, R, K] over each row's keys [B, S, G, K]
    up to each query's position ``last_bt``: out [B, T, H, K]."""
    b, t, g, r, k = q_btgrk.shape
    s = np.einsum("btgrk,bsgk->bgrts", q_btgrk, k_bsgk) * k**-0.5
    seen = np.arange(k_bsgk.shape[1])[None, None, :] <= last_bt[..., None]
    s = np.where(seen[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bgrts,bsgk->btgrk", p, v_bsgk).reshape(b, t, g * r, k)


def _pool(page_size: int, tables: list[list[int]], lengths: list[int], seed: int):  # type: ignore[no-untyped-def]
    """A random pool of pages, and each row's keys and values [S, G, K] read through its
    page table (float64), up to the longest row."""
    num_pages = max(max(t) for t in tables) + 3
    kk, kv = jax.random.split(jax.random.key(seed))
    k_pages = jax.random.normal(kk, (G, num_pages, page_size, K))
    v_pages = jax.random.normal(kv, (G, num_pages, page_size, K))
    return k_pages, v_pages, _rows(k_pages, tables, lengths), _rows(v_pages, tables, lengths)


def _table(tables: list[list[int]], width: int) -> np.ndarray:
    """Page tables [rows, width]; entries past a row's pages point at page 0."""
    table = np.zeros((len(tables), width), np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    return table


def _rows(pages: jax.Array, tables: list[list[int]], lengths: list[int]) -> np.ndarray:
    """Each row's keys or values [S, G, K] (float64) read from ``pages`` through its page
    table, up to the longest row."""
    x = np.asarray(pages.astype(jnp.float32), np.float64)
    out = np.zeros((len(tables), max(lengths), G, K))
    for b, table in enumerate(tables):
        seq = np.concatenate([x[:, p].transpose(1, 0, 2) for p in table])
        out[b, : lengths[b]] = seq[: lengths[b]]
    return out


def test_paged_attention_equals_the_softmax() -> None:
    """Prefill chunks over pages (`paged_attention`): two rows with scattered, unordered page
    tables, chunks of 3 new tokens at different positions, each row reading 8 pages of 16
    (past its end: garbage that must stay unseen). Against a float64 softmax over each
    query's positions. Bound: the scores are K-term dot products and the sums run over at
    most S weights, so each output, a weighted mean of values, is off by at most (K + S)
    unit roundoffs of the largest value."""
    ps, new = 16, 3
    tables = [[7, 2, 9, 0, 4, 11, 5, 1], [3, 10, 6, 8, 12, 13, 14, 15]]
    pos = [5, 8 * ps - new]  # each row's first new token's position
    k_pages, v_pages, k64, v64 = _pool(ps, tables, [p + new for p in pos], seed=2)
    q = jax.random.normal(jax.random.key(3), (2, new, H, K))
    got = paged_attention(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(pos), 8)
    last = np.asarray(pos)[:, None] + np.arange(new)
    want = _reference(np.asarray(q, np.float64).reshape(2, new, G, H // G, K), k64, v64, last)
    bound = (K + 8 * ps) * 2.0**-24 * np.abs(v64).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=bound, rtol=0)


def test_ragged_attention_equals_the_softmax_and_ignores_batch_mates() -> None:
    """Decode attention over each row's own pages (`ragged_attention`): 4 rows of very
    different lengths (one page; 40 pages; idle; a page and one token), pages shared and
    scattered, against a float64 softmax; the bound as above (each row's partial sums are
    rescaled once more: one more rounding). A row's result is bitwise the same alone and
    beside the others, at any padding of the pairs."""
    ps = 8
    lengths = [5, 40 * ps, 1, ps + 1]  # positions each row attends to (its query's + 1)
    tables = [[3], list(range(10, 50)), [0], [3, 60]]
    active = jnp.asarray([True, True, False, True])
    k_pages, v_pages, k64, v64 = _pool(ps, tables, lengths, seed=4)
    q = jax.random.normal(jax.random.key(5), (4, H, K))
    table = _table(tables, 48)
    pos = jnp.asarray(lengths) - 1

    def run(table: np.ndarray, pos: jax.Array, active: jax.Array, num_pairs: int) -> jax.Array:
        pairs = page_pairs(jnp.asarray(table), pos, active, num_pairs, ps)
        return ragged_attention(q[: table.shape[0]], k_pages, v_pages, pairs, pos)

    block = pair_block(ps)
    got = run(table, pos, active, 2 * block)
    last = np.asarray(pos)[:, None]
    want = _reference(np.asarray(q, np.float64).reshape(4, 1, G, H // G, K), k64, v64, last)
    bound = (K + max(lengths) + 1) * 2.0**-24 * np.abs(v64).max()
    live = np.asarray(active)
    np.testing.assert_allclose(np.asarray(got, np.float64)[live], want[live, 0], atol=bound, rtol=0)
    assert not np.asarray(got[~live]).any()  # an idle row reads nothing
    for num_pairs in (2 * block, 8 * block):
        alone = run(table, pos, jnp.asarray([True, False, False, False]), num_pairs)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(got[0]))
    last_alone = run(table, pos, jnp.asarray([False, False, False, True]), 4 * block)
    np.testing.assert_array_equal(np.asarray(last_alone[3]), np.asarray(got[3]))


def test_chunk_attention_equals_the_softmax_over_each_chunks_own_pages() -> None:
    """The prompt chunks of a ragged step (`chunk_attention`): three chunks of a 100-row
    batch (rows 3.., 45.., 55..; 37 tokens from position 0, over two query blocks; 5 from
    position 20; 40 from position 50, over three blocks and trips of `CHUNK_PAGES` pages),
    each over its own scattered pages, against a float64 softmax over each query's
    positions; the rows of no chunk are zeros, and so is everything a fourth chunk past the
    count would have written. Bound: as `paged_attention`'s, (K + S) unit roundoffs of the
    largest value, plus one rounding of the running sums per trip over the pages."""
    ps, n_rows = 8, 100
    starts, sizes, rows = [0, 20, 50], [37, 5, 40], [3, 45, 55]
    tables = [[9, 4, 30, 2, 17], [1, 5, 6, 7], [40, 12, 33, 21, 8, 26, 27, 39, 11, 3, 14, 0]]
    lengths = [a + n for a, n in zip(starts, sizes, strict=True)]
    k_pages, v_pages, k64, v64 = _pool(ps, tables, lengths, seed=6)
    q = jax.random.normal(jax.random.key(7), (n_rows, H, K))
    M = 12
    chunks = StepChunks(
        row=jnp.asarray([*rows, 90], jnp.int32),
        size=jnp.asarray([*sizes, 10], jnp.int32),
        start=jnp.asarray([*starts, 0], jnp.int32),
        table=jnp.asarray(_table([*tables, tables[0]], M)),
        count=jnp.asarray([3], jnp.int32),
    )
    got = np.asarray(jax.jit(chunk_attention)(q, k_pages, v_pages, chunks), np.float64)
    trips = -(-max(lengths) // (CHUNK_PAGES * ps))
    bound = (K + max(lengths) + trips + 1) * 2.0**-24 * np.abs(v64).max()
    inside = np.zeros(n_rows, bool)
    for c, (row, size, start) in enumerate(zip(rows, sizes, starts, strict=True)):
        qc = np.asarray(q[row : row + size], np.float64).reshape(1, size, G, H // G, K)
        last = (start + np.arange(size))[None]
        want = _reference(qc, k64[c : c + 1], v64[c : c + 1], last)[0]
        np.testing.assert_allclose(got[row : row + size], want, atol=bound, rtol=0)
        inside[row : row + size] = True
    assert not got[~inside].any()


KernelCase = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _bf16_rows() -> tuple[KernelCase, np.ndarray, int, float]:
    """The ragged test's rows (one page; 40 pages, more than one compute block; idle; a page
    and one token), pages shared and scattered, in a bfloat16 pool as an accelerator's engine
    holds it, with bfloat16 queries: the kernel's arguments (q, k pages, v pages, tables,
    positions, active rows), the float64 softmax of those inputs, the longest row, and the
    largest |v|."""
    ps = 8
    lengths = [5, 40 * ps, 1, ps + 1]
    tables = [[3], list(range(10, 50)), [0], [3, 60]]
    active = jnp.asarray([True, True, False, True])
    k_pages, v_pages, _, _ = _pool(ps, tables, lengths, seed=4)
    k16, v16 = k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16)
    k64, v64 = _rows(k16, tables, lengths), _rows(v16, tables, lengths)
    q = jax.random.normal(jax.random.key(5), (4, H, K)).astype(jnp.bfloat16)
    pos = jnp.asarray(lengths) - 1
    last = np.asarray(pos)[:, None]
    want = _reference(np.asarray(q, np.float64).reshape(4, 1, G, H // G, K), k64, v64, last)
    case = (q, k16, v16, jnp.asarray(_table(tables, 48)), pos, active)
    return case, want, max(lengths), float(np.abs(v64).max())


def _assert_live_rows_within(got: jax.Array, want: np.ndarray, active: jax.Array, bound: float):
    assert got.dtype == jnp.bfloat16
    live = np.asarray(active)
    np.testing.assert_allclose(np.asarray(got, np.float64)[live], want[live, 0], atol=bound, rtol=0)
    assert not np.asarray(got[~live], np.float64).any()  # an idle row reads nothing


def test_the_pallas_tpu_kernel_equals_the_softmax_in_interpret_mode() -> None:
    """Decode attention by JAX's TPU paged-attention kernel (`pallas_paged_attention`, in
    Pallas's TPU interpret mode), for a 16-bit cache as a TPU engine holds it (`_bf16_rows`).
    Against a float64 softmax of the same bfloat16 keys, values and queries. Bound: the kernel
    computes in fp32 from bfloat16 inputs it reads exactly, so as above (K + S + 1 unit
    roundoffs of the largest value), plus the output's rounding to bfloat16 (half an ulp: 2^-9
    relative). An idle row gives zeros."""
    case, want, longest, vmax = _bf16_rows()
    with pltpu.force_tpu_interpret_mode():
        got = pallas_paged_attention(*case)
    bound = 2.0**-9 * np.abs(want).max() + (K + longest + 1) * 2.0**-24 * vmax
    _assert_live_rows_within(got, want, case[5], bound)


def test_the_pallas_gpu_kernel_equals_the_softmax_in_interpret_mode() -> None:
    """Decode attention by JAX's GPU (Triton) paged-attention kernel (`triton_paged_attention`,
    in Pallas's interpret mode) over the TPU test's rows and bfloat16 pool, its 40-page row
    split into partitions of several compute blocks. Bound: as the TPU kernel's (fp32 scores
    of bfloat16 inputs read exactly, the output rounded to bfloat16), plus the kernel's
    rounding of each unnormalised weight (at most 1) to bfloat16 before the values' matmul:
    2^-8 of the weighted sum of |v| a row reads, at most 2^-8 of the largest |v|; and the
    normaliser's epsilon (2^-23 relative, the normaliser being at least 1). Idle rows: zeros."""
    case, want, longest, vmax = _bf16_rows()
    got = triton_paged_attention(*case, interpret=True)
    bound = 2.0**-9 * np.abs(want).max() + (2.0**-8 + 2.0**-23) * vmax
    bound += (K + longest + 1) * 2.0**-24 * vmax
    _assert_live_rows_within(got, want, case[5], bound)


def test_ragged_attention_rows_are_bitwise_the_same_wherever_their_pairs_fall() -> None:
    """With pages of 64 positions a block holds 16 (row, page) pairs: a row of 20 pages
    spans two blocks, and the pairs of the rows after it move to other blocks (and other
    offsets in them) when it is there or not. Each row's result is bitwise the same alone
    and beside the others, and within the bound of a float64 softmax."""
    ps = 64
    assert pair_block(ps) == 16
    lengths = [20 * ps - 3, 3 * ps, 40, 5 * ps + 1]
    tables = [list(range(1, 21)), [30, 31, 32], [40], [50, 51, 52, 53, 54, 55]]
    k_pages, v_pages, k64, v64 = _pool(ps, tables, lengths, seed=6)
    q = jax.random.normal(jax.random.key(7), (4, H, K))
    table = _table(tables, 24)
    pos = jnp.asarray(lengths) - 1

    def run(active: list[bool], num_pairs: int) -> np.ndarray:
        pairs = page_pairs(jnp.asarray(table), pos, jnp.asarray(active), num_pairs, ps)
        return np.asarray(ragged_attention(q, k_pages, v_pages, pairs, pos))

    every = run([True] * 4, 64)
    want = _reference(np.asarray(q, np.float64).reshape(4, 1, G, H // G, K), k64, v64, pos[:, None])
    bound = (K + max(lengths) + 1) * 2.0**-24 * np.abs(v64).max()
    np.testing.assert_allclose(every.astype(np.float64), want[:, 0], atol=bound, rtol=0)
    for b in range(4):
        alone = run([i == b for i in range(4)], 96)
        np.testing.assert_array_equal(alone[b], every[b])
    np.testing.assert_array_equal(run([False, True, False, True], 32)[[1, 3]], every[[1, 3]])


def test_sharded_decode_attention_equals_ragged_attention_on_one_device() -> None:
    """Decode attention under ``shard_map`` (`decode_steps`) on a data=4 x tensor=2 mesh of
    fake CPU devices: 8 rows, 2 per shard, each row's pages in its shard's range of a pool
    of 4 x 16 pages (shared within a shard, scattered; one row idle, one of 12 pages). Each
    shard writes its rows' new keys and values into its own pages and attends over them in
    its own page ids. Against the same step on one device (`ragged_attention` over global
    page ids): the pool bit for bit; the sharded ragged kernel and JAX's TPU kernel (Pallas
    TPU interpret mode) each within the bound of the float64 softmax held above, so within
    twice that of the one-device result: all read the same bfloat16 pool exactly and
    compute in fp32 (fp32 queries: none rounds its weights or its output; a kv head's
    einsums on a device of one kv head round in another order than on a device of two)."""
    ps, local, shards = 8, 16, 4
    mesh = make_mesh(data=shards, fsdp=1, tensor=2)
    sharder = Sharder(mesh)
    lengths = [5, 12 * ps, 1, ps + 1, 3 * ps, 7, 10 * ps + 3, 2]
    first = [(b // 2) * local for b in range(8)]  # row b decodes on shard b // 2
    tables = [
        [first[0] + 3],
        [first[1] + p for p in range(3, 15)],
        [first[2]],
        [first[3] + 5, first[3] + 9],
        [first[4] + p for p in (15, 2, 7)],
        [first[5] + 15],  # shares row 4's first page's shard, its own page
        [first[6] + p for p in range(11)],
        [first[7] + 12],
    ]
    active = jnp.asarray([True, True, False, True, True, True, True, True])
    pos = jnp.asarray(lengths) - 1
    keys = jax.random.split(jax.random.key(8), 5)
    k16 = jax.random.normal(keys[0], (G, shards * local, ps, K)).astype(jnp.bfloat16)
    v16 = jax.random.normal(keys[1], (G, shards * local, ps, K)).astype(jnp.bfloat16)
    q = jax.random.normal(keys[2], (8, H, K))
    k_new, v_new = (jax.random.normal(k, (8, G, K)) for k in keys[3:])
    table = jnp.asarray(_table(tables, local))
    for b, t in enumerate(tables):  # entries past a row's pages: its shard's first page
        table = table.at[b, len(t) :].set(first[b])

    def step(
        sharder: Sharder, kernel: str, q: jax.Array = q
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        make_tables, layer = decode_steps(sharder, shards * local, ps, kernel)
        tables_ = make_tables(table, pos, active)
        return layer(q, k_new, v_new, k16, v16, tables_, pos, active)

    one, ck, cv = jax.jit(lambda: step(one_device_sharder(), "ragged"))()
    ragged, ck_r, cv_r = jax.jit(lambda: step(sharder, "ragged"))()
    with pltpu.force_tpu_interpret_mode():
        pallas, ck_p, cv_p = jax.jit(lambda: step(sharder, "pallas"))()
    # the Triton kernel takes the queries in the pool's dtype: bfloat16 queries (K = 16: the
    # scale rounds nothing), its output bfloat16
    q16 = q.astype(jnp.bfloat16)
    triton, ck_t, cv_t = jax.jit(lambda: step(sharder, "triton", q16))()  # interpret: CPU
    assert ragged.sharding.shard_shape(ragged.shape) == (2, H // 2, K)  # rows, heads split
    for got in (ck_r, ck_p, ck_t):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ck, np.float32))
    for got in (cv_r, cv_p, cv_t):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(cv, np.float32))
    live = np.asarray(active)
    k64, v64 = _rows(ck, tables, lengths), _rows(cv, tables, lengths)
    last = np.asarray(pos)[:, None]
    want = _reference(np.asarray(q, np.float64).reshape(8, 1, G, H // G, K), k64, v64, last)
    bound = (K + max(lengths) + 1) * 2.0**-24 * np.abs(v64).max()
    for got in (one, pallas):
        np.testing.assert_allclose(
            np.asarray(got, np.float64)[live], want[live, 0], atol=bound, rtol=0
        )
    np.testing.assert_allclose(
        np.asarray(pallas)[live], np.asarray(one)[live], atol=2 * bound, rtol=0
    )
    # the Triton kernel: its own test's bound against the softmax of the bfloat16 queries
    want16 = _reference(np.asarray(q16, np.float64).reshape(8, 1, G, H // G, K), k64, v64, last)
    vmax = np.abs(v64).max()
    bound16 = bound + 2.0**-9 * np.abs(want16).max() + (2.0**-8 + 2.0**-23) * vmax
    assert triton.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(triton, np.float64)[live], want16[live, 0], atol=bound16, rtol=0
    )
    for got in (pallas, one, triton):
        assert not np.asarray(got[~live]).any()


# A longer row for the looped attention: T not a multiple of `ATTN_BLOCK`, query blocks that
# read several key blocks, and skip those of the sequences before theirs; GQA with 3 query
# heads per kv head.
LT, LH, LG = 1100, 6, 2


# runs of tokens per row: a segment's length, or padding's as a negative number
LAYOUTS = {
    1000: ([40, 600, -5, 400], [1000, -5, 3, 80]),  # longest 1000: no window
    450: ([40, 450, -5, 200, 390], [449, 3, -5, 450, 180]),  # window 450
}


def _long_segments(longest: int) -> np.ndarray:
    """Two rows of segments of at most ``longest`` tokens (`LAYOUTS`), padding (segment 0)
    between segments and at the end; segments cross query and key blocks."""
    seg = np.zeros((2, LT), np.int32)
    for row, runs in enumerate(LAYOUTS[longest]):
        at = 0
        for i, n in enumerate(runs, 1):
            seg[row, at : at + abs(n)] = i if n > 0 else 0
            at += abs(n)
        assert at < LT and max(runs) <= longest  # padding at the end
    return seg


def _segment_mask(seg: np.ndarray) -> np.ndarray:
    """[B, T, S]: causal within each segment, padding (segment 0) read by none."""
    T = seg.shape[1]
    causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
    return causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)


def _dense64(q, k, v, mask, dout):  # type: ignore[no-untyped-def]
    """The softmax under ``mask`` [B, T, S] in float64 (queries that see no key: zeros), and its
    gradients by the closed form: with s the scaled scores, p = softmax(s) over the visible
    keys, out = p v: dv = p^T dout, dp = dout v^T, ds = p (dp - sum(p dp)), dq = ds k / sqrt(K),
    dk = ds^T q / sqrt(K)."""
    B, T, H, K = q.shape
    G = k.shape[2]
    qg = q.reshape(B, T, G, H // G, K)
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    s = np.where(mask, np.einsum("btgrk,bsgk->bgrts", qg, k) * K**-0.5, -np.inf)
    top = np.where(mask.any(-1, keepdims=True), s.max(-1, keepdims=True), 0.0)
    e = np.exp(s - top)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bgrts,bsgk->btgrk", p, v).reshape(B, T, H, K)
    do = dout.reshape(B, T, G, H // G, K)
    dv = np.einsum("bgrts,btgrk->bsgk", p, do)
    dp = np.einsum("btgrk,bsgk->bgrts", do, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * K**-0.5
    dq = np.einsum("bgrts,bsgk->btgrk", ds, k).reshape(B, T, H, K)
    dk = np.einsum("bgrts,btgrk->bsgk", ds, qg)
    return out, (dq, dk, dv)


def test_looped_attention_equals_the_dense_softmax_with_gradients() -> None:
    """`attention` (loops over query and key blocks, online softmax, custom VJP) against the
    float64 dense masked softmax and its closed-form gradients, on two packed rows of
    several segments with padding between and after them, GQA, T = 1100 (not a multiple of
    the query block; a query block reads up to eight key blocks), with and without a
    ``window`` (the TPU kernel's bound: changes nothing here).

    Tolerances, from fp32 rounding (unit roundoff u = 2^-24): each score is a K-term dot
    product, each output a weighted mean over at most S keys accumulated over fewer than S
    steps, rescaled once per step: an output is off by at most (K + 2 S) u times the largest
    value, S <= 1000 the longest sequence (the worst case; rounding errors of random signs
    grow like sqrt(S) instead). The gradients are sums of the same S products in a
    different order, each entry off by (K + 2 S) u times its terms' magnitudes: normwise,
    (K + 2 S) u relative. Queries that see no key (padding) give exact zeros, as do their
    gradients."""
    K = 16
    kq, kk, kv, kd = jax.random.split(jax.random.key(8), 4)
    q = jax.random.normal(kq, (2, LT, LH, K))
    k = jax.random.normal(kk, (2, LT, LG, K))
    v = jax.random.normal(kv, (2, LT, LG, K))
    dout = jax.random.normal(kd, (2, LT, LH, K))
    u = 2.0**-24
    one = one_device_sharder()
    for longest, window in ((1000, None), (450, 450)):
        seg = _long_segments(longest)

        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return jnp.sum(attention(q, k, v, jnp.asarray(seg), window, sharder=one) * dout)  # noqa: B023

        run = jax.jit(lambda q, k, v: attention(q, k, v, jnp.asarray(seg), window, sharder=one))  # noqa: B023
        out = run(q, k, v)
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
        q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
        want, want_grads = _dense64(q64, k64, v64, _segment_mask(seg), d64)
        bound = (K + 2 * longest) * u * np.abs(v64).max()
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=bound, rtol=0)
        assert not np.asarray(out)[seg == 0].any()
        for got, ref in zip(grads, want_grads, strict=True):
            got64 = np.asarray(got, np.float64)
            assert np.isfinite(got64).all()
            rel = np.linalg.norm(got64 - ref) / np.linalg.norm(ref)
            assert rel <= (K + 2 * longest) * u, rel
        assert not np.asarray(grads[0])[seg == 0].any()  # padding queries: no gradient


def _tree_reach() -> np.ndarray:
    """Two rows of `LT` slots: row 0 a tree laid out depth first (a prefix of 300 read by
    its two branches; the second branch a prefix of 200 with two branches of its own),
    then padding; row 1 packed segments (`segment_reach` of `_long_segments`)."""
    reach = np.zeros((2, LT), np.int32)
    for lo, hi, end in ((0, 300, 1000), (300, 500, 500), (500, 700, 1000), (700, 850, 850)):
        reach[0, lo:hi] = end
    reach[0, 850:1000] = 1000
    seg = _long_segments(1000)[1]
    for i in np.unique(seg[seg > 0]):
        at = np.flatnonzero(seg == i)
        reach[1, at] = at[-1] + 1
    return reach


def test_attention_over_tree_rows_reads_each_branch_s_prefixes_and_itself() -> None:
    """``reach_bt``: query q reads key k iff k <= q < reach[k]. Against the float64 softmax
    under that mask and its closed-form gradients, at the bounds of the test above (S <=
    1000 keys a query). A branch's queries read no key of a sibling branch: its outputs
    and gradients do not move when the sibling's keys and values do."""
    K, u = 16, 2.0**-24
    kq, kk, kv, kd = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(kq, (2, LT, LH, K))
    k = jax.random.normal(kk, (2, LT, LG, K))
    v = jax.random.normal(kv, (2, LT, LG, K))
    dout = jax.random.normal(kd, (2, LT, LH, K))
    reach = _tree_reach()
    seg = (reach > 0).astype(np.int32)

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            out = attention(
                q, k, v, jnp.asarray(seg), reach_bt=jnp.asarray(reach), sharder=one_device_sharder()
            )
            return jnp.sum(out * dout)

        out = attention(
            q, k, v, jnp.asarray(seg), reach_bt=jnp.asarray(reach), sharder=one_device_sharder()
        )
        return out, *jax.grad(loss, (0, 1, 2))(q, k, v)

    out, *grads = run(q, k, v)
    pos = np.arange(LT)
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, :, None] < reach[:, None, :])
    q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    want, want_grads = _dense64(q64, k64, v64, mask, d64)
    bound = (K + 2 * 1000) * u
    np.testing.assert_allclose(
        np.asarray(out, np.float64), want, atol=bound * np.abs(v64).max(), rtol=0
    )
    for got, ref in zip(grads, want_grads, strict=True):
        rel = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
        assert rel <= bound, rel
    # the first branch (300..499) moved: the second's queries (500..999) see none of it
    moved = [x.at[0, 300:500].multiply(-3.0) for x in (k, v)]
    out2, dq2, _, _ = run(q, *moved)
    np.testing.assert_array_equal(np.asarray(out2)[0, 500:], np.asarray(out)[0, 500:])
    np.testing.assert_array_equal(np.asarray(dq2)[0, 500:], np.asarray(grads[0])[0, 500:])


def test_a_query_block_reads_only_the_key_blocks_its_mask_reaches() -> None:
    """`key_blocks`, in blocks of 128: packed sequences [0, 256), [256, 768), [768, 1024)
    and a tree (prefix [0, 256) read by branches [256, 512) and [512, 1024)). A query block
    reads its own sequence's blocks and its prefix's, not a neighbour's or a sibling's."""
    n = ATTN_BLOCK
    reach = np.zeros((2, 8 * n), np.int32)
    for lo, hi in ((0, 256), (256, 768), (768, 1024)):
        reach[0, lo:hi] = hi
    reach[1, :256], reach[1, 256:512], reach[1, 512:] = 1024, 512, 1024
    order, count = (np.asarray(x) for x in jax.jit(key_blocks)(jnp.asarray(reach)))

    def read(b: int, i: int) -> list[int]:
        return sorted(order[b, i, : count[b, i]].tolist())

    assert [read(0, i) for i in range(8)] == [
        [0],
        [0, 1],
        [2],
        [2, 3],
        [2, 3, 4],
        [2, 3, 4, 5],
        [6],
        [6, 7],
    ]
    assert read(1, 3) == [0, 1, 2, 3] and read(1, 4) == [0, 1, 4]
    assert read(1, 7) == [0, 1, 4, 5, 6, 7]


def test_the_attention_program_does_not_grow_with_the_row() -> None:
    """Loops over query and key blocks, not blocks unrolled in Python: the program of
    `attention`'s gradient holds as many matmuls for rows of 256 tokens (one key block) as
    of 2048 (16 query blocks of up to 16 key blocks)."""

    def dots(T: int) -> int:
        x = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
        seg = jax.ShapeDtypeStruct((1, T), jnp.int32)

        def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
            return jnp.sum(attention(q, k, v, seg, sharder=one_device_sharder()))

        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, kv, kv, seg)
        return lowered.as_text().count("dot_general")

    assert dots(256) == dots(2048) > 0
