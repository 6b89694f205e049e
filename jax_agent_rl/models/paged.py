"""Attention over a paged KV pool (`KVPages`: per layer [G, P, page_size, K]), for
prefill chunks (`paged_attention`) and decode steps (`ragged_attention`, or JAX's Pallas
kernels: on TPU `pallas_paged_attention`, on GPU `triton_paged_attention`; `DECODE_KERNELS`),
and a decode step's layers sharded
(`decode_steps`): each shard of the rows reads and writes only its own pages.

Every path takes a layer's ``sliding_window`` (Gemma 3's local layers, HF's sliding-window
causal mask: a query at position p reads the keys at positions p - W + 1 .. p;
`check_sliding_window`); None, a global layer, reads every position up to its own. JAX's
Pallas decode kernels take no window: a windowed layer decodes by `ragged_attention`,
whatever the decode kernel.

Shapes use the letters of `decoder`: B rows, T query tokens, H query heads, G kv heads,
R = H // G, K head dim, P pages, M a page table's length, J (row, page) pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

from jax_agent_rl.models.attention_kernels import platform_of
from jax_agent_rl.models.sharding import Sharder

# the pool's pages split like the decode slots (over ``batch``'s mesh axes), kv heads over theirs
PAGE_AXES = ("kv_heads", "batch", "cache_seq", "head_dim")
PAIR_POSITIONS = 1024  # cache positions per block of `ragged_attention` (`pair_block`)
# a decode step's attention: the XLA loop over (row, page) pairs, JAX's TPU paged-attention
# kernel, JAX's GPU (Triton) one
DECODE_KERNELS = ("ragged", "pallas", "triton")
# a prompt chunk's attention in a ragged step (`chunk_attention`): queries per block, pages
# per trip of its inner loop
CHUNK_QUERIES, CHUNK_PAGES = 32, 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """Keys and values of every layer in one pool of fixed-size pages.

    Layout: ``k``, ``v`` are tuples of L arrays [G, P, page_size, K], one buffer per layer (a
    layer reads and writes its own in place; kv heads first, as TPU paged-attention kernels
    read them). A sequence owns a list of pages, its *page
    table*: position s of the sequence lives in page ``table[s // page_size]`` at offset
    ``s % page_size``. Memory follows real lengths: a sequence holds ``ceil(n / page_size)``
    pages, and sequences that share a prefix can share its pages (the engine counts
    references on the host). Which positions of a page are live is the sequences' business:
    attention masks every key past the query's own position.
    """

    k: Any  # tuples of arrays; or of their shardings (`page_shardings`)
    v: Any

    @property
    def page_size(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[1])


def check_sliding_window(sliding_window: object) -> Any:
    """``sliding_window`` itself if it is a layer's window: None (no window), a positive int
    W (a query at position p reads the keys at positions p - W + 1 .. p), or an int scalar
    array (a window scanned with the layers: the caller keeps it positive); else a
    `ValueError` naming it."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int) and not isinstance(sliding_window, bool):
        if sliding_window >= 1:
            return sliding_window
    elif (
        isinstance(sliding_window, jax.Array)
        and sliding_window.shape == ()
        and jnp.issubdtype(sliding_window.dtype, jnp.integer)
        and (isinstance(sliding_window, jax.core.Tracer) or int(sliding_window) >= 1)
    ):
        return sliding_window
    raise ValueError(
        f"sliding_window={sliding_window!r}: a positive int (a query at position p reads the "
        "keys at p - W + 1 .. p), an int scalar array, or None"
    )


def segment_positions(segment_ids_bt: jax.Array) -> jax.Array:
    """[B, T] int32: each token's index less its segment's first (segments are contiguous
    runs of one id; padding's runs count too), the positions packed rows restart at 0 in."""
    T = segment_ids_bt.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_bt[:, :1], bool),
            segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1],
        ],
        axis=1,
    )
    return t[None] - jax.lax.cummax(jnp.where(starts, t[None], 0), axis=1)


def pair_block(page_size: int) -> int:
    """(row, page) pairs per block of `ragged_attention`: blocks of `PAIR_POSITIONS`
    positions whatever the page size (a padding pair costs a page; pages of a whole
    sequence make blocks of one pair)."""
    return max(1, PAIR_POSITIONS // page_size)


def paged_attention(
    q_bthk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table_bm: jax.Array,
    pos_b: jax.Array,
    pages_read: int,
    *,
    sliding_window: Any = None,
) -> jax.Array:
    """`attention` of a chunk of ``T`` new tokens of rows ``0 .. B - 1`` whose keys and values
    are in their pages already (at positions ``pos_b + t``), over the row's positions up to
    their own (the last ``sliding_window`` of them, itself included, with a window): each
    row's first ``pages_read`` pages (static, a bucket that covers every row's positions)
    gathered from one layer's pool [G, P, page_size, K] by its page table [B, M]. For prefill
    chunks: T queries over a few pages each.

    Scores, softmax and sums in fp32; the weights rounded to the model's dtype for the values'
    matmul (as a matmul in that dtype takes them), the denominator summed unrounded.
    """
    B, T, H, K = q_bthk.shape
    G, _, ps, _ = k_pages.shape
    q = q_bthk.reshape(B, T, G, H // G, K).astype(jnp.float32)
    pages_bn = table_bm[:, :pages_read]
    key_s, query_bt = jnp.arange(pages_read * ps), pos_b[:, None] + jnp.arange(T)[None, :]
    seen_bts = key_s <= query_bt[..., None]
    if check_sliding_window(sliding_window) is not None:
        seen_bts &= query_bt[..., None] - key_s < sliding_window
    s = jnp.einsum("btgrk,gbnsk->bgrtns", q, k_pages[:, pages_bn].astype(jnp.float32))
    s = s.reshape(*s.shape[:4], pages_read * ps)
    s = jnp.where(seen_bts[:, None, None], s * K**-0.5, -1e30)
    p = jnp.exp(s - s.max(-1, keepdims=True))  # a query sees its own position
    p_rounded = p.astype(q_bthk.dtype).astype(jnp.float32)
    p_rounded = p_rounded.reshape(*s.shape[:4], pages_read, ps)
    out = jnp.einsum("bgrtns,gbnsk->bgrtk", p_rounded, v_pages[:, pages_bn].astype(jnp.float32))
    out = (out / p.sum(-1)[..., None]).astype(q_bthk.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, K)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepChunks:
    """The prompt chunks of a ragged step (`RaggedStep`), [S] each (a static capacity; the
    chunks past ``count`` are unused): chunk c's tokens are the step's rows ``row[c] ..
    row[c] + size[c] - 1``, at positions ``start[c] ..`` of the sequence whose page table is
    ``table[c]`` [S, M]."""

    # arrays, on the host as the engine lays them out or on the devices
    row: Any  # int32
    size: Any  # int32
    start: Any  # int32
    table: Any  # int32 [S, M]
    count: Any  # int32 [1]: the chunks in use


def chunk_attention(
    q_nhk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    chunks: StepChunks,
    block: int = CHUNK_QUERIES,
    *,
    sliding_window: Any = None,
) -> jax.Array:
    """Attention of prompt chunks whose tokens are rows of a ragged batch [N, H, K] and whose
    keys and values are in their pages already: each chunk's queries in blocks of ``block``
    consecutive rows, each block over the pages of its sequence up to its last position,
    `CHUNK_PAGES` pages at a time, with a running max (online softmax). The loops run over
    the real chunks, blocks and pages only (counts known on the device): the work is that of
    causal attention over each chunk's real length, whatever its neighbours; one program
    serves any mix. Rows of no chunk give zeros.

    With a ``sliding_window`` a query reads its last W positions only, and a block's trips
    start at the one that holds its first query's first key (the trips before hold none of
    the block's keys); a trip in which a query sees no key adds nothing to it.

    Scores, softmax and sums in fp32; the weights rounded to the model's dtype for the values'
    matmul (as `paged_attention`), the denominator summed unrounded.
    """
    N, H, K = q_nhk.shape
    G, _, ps, _ = k_pages.shape
    R, M = H // G, chunks.table.shape[1]
    windowed = check_sliding_window(sliding_window) is not None
    kb = max(1, min(CHUNK_PAGES, M))  # pages per inner trip
    span = kb * ps
    q = jnp.pad(q_nhk, ((0, block), (0, 0), (0, 0))).reshape(N + block, G, R, K)
    q = q.astype(jnp.float32)
    table = jnp.pad(chunks.table, ((0, 0), (0, -M % kb)))  # whole trips of kb pages

    def one_block(c: jax.Array, b: jax.Array, out: jax.Array) -> jax.Array:
        row0, size, start = chunks.row[c] + b * block, chunks.size[c], chunks.start[c]
        q_b = jax.lax.dynamic_slice_in_dim(q, row0, block)  # [block, G, R, K]
        qpos = start + b * block + jnp.arange(block)  # positions of the block's queries
        last = start + jnp.minimum(size, (b + 1) * block) - 1  # its last real query's

        def kv_trip(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            top, total, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(table[c], j * kb, kb)
            k = k_pages[:, pages].reshape(G, span, K).astype(jnp.float32)
            v = v_pages[:, pages].reshape(G, span, K).astype(jnp.float32)
            s = jnp.einsum("qgrk,gsk->grqs", q_b, k)
            key_s = j * span + jnp.arange(span)[None, :]
            seen = key_s <= qpos[:, None]  # [block, span]
            if windowed:
                seen &= qpos[:, None] - key_s < sliding_window
            s = jnp.where(seen, s * K**-0.5, -1e30)
            new_top = jnp.maximum(top, s.max(-1))
            p = jnp.exp(s - new_top[..., None])
            if windowed:  # a query that sees none of the trip's keys: exp(0) at top -1e30
                p = jnp.where(seen, p, 0.0)
            scale = jnp.exp(top - new_top)
            p_rounded = p.astype(q_nhk.dtype).astype(jnp.float32)
            acc = acc * scale[..., None] + jnp.einsum("grqs,gsk->grqk", p_rounded, v)
            return new_top, total * scale + p.sum(-1), acc

        start_carry = (
            jnp.full((G, R, block), -1e30),
            jnp.zeros((G, R, block)),
            jnp.zeros((G, R, block, K)),
        )
        trips = last // span + 1
        first = jnp.maximum(qpos[0] - sliding_window + 1, 0) // span if windowed else 0
        _, total, acc = jax.lax.fori_loop(first, trips, kv_trip, start_carry)
        res = (acc / total[..., None]).transpose(2, 0, 1, 3)  # [block, G, R, K]
        real = (b * block + jnp.arange(block) < size)[:, None, None, None]
        old = jax.lax.dynamic_slice_in_dim(out, row0, block)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(real, res, old), row0, 0)

    def one_chunk(c: jax.Array, out: jax.Array) -> jax.Array:
        blocks = (chunks.size[c] + block - 1) // block
        return jax.lax.fori_loop(0, blocks, partial(one_block, c), out)

    out = jnp.zeros((N + block, G, R, K))
    out = jax.lax.fori_loop(0, chunks.count[0], one_chunk, out)
    return out[:N].astype(q_nhk.dtype).reshape(N, H, K)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePairs:
    """The (row, page) pairs ragged decode attention reads, [J] each, rows in order: row b's
    pages 0 .. pos_b // page_size, those that hold its positions 0 .. pos_b. Padding pairs
    carry row B (read into no row)."""

    row: jax.Array  # int32
    page: jax.Array  # int32: a page of the pool
    start: jax.Array  # int32: the page's first position in its row


def page_pairs(
    table_bm: jax.Array, pos_b: jax.Array, active_b: jax.Array, num_pairs: int, page_size: int
) -> PagePairs:
    """`PagePairs` of the active rows for queries at positions ``pos_b``, padded to
    ``num_pairs`` (static; at least the pages the rows hold)."""
    B, M = table_bm.shape
    n_b = jnp.where(active_b, pos_b // page_size + 1, 0)
    ends_b = jnp.cumsum(n_b)
    j = jnp.arange(num_pairs)
    row_j = jnp.searchsorted(ends_b, j, side="right").astype(jnp.int32)  # B past the last pair
    row = jnp.minimum(row_j, B - 1)
    index_j = jnp.clip(j - (ends_b[row] - n_b[row]), 0, M - 1)
    return PagePairs(row=row_j, page=table_bm[row, index_j], start=index_j * page_size)


def ragged_attention(
    q_bhk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    pairs: PagePairs,
    pos_b: jax.Array,
    *,
    sliding_window: Any = None,
) -> jax.Array:
    """Decode attention, one new token per row [B, H, K] at position ``pos_b``, over the
    row's own pages only: the work is the real pairs', the sum of the rows' real lengths in
    pages, so a long row costs the short ones nothing, and padding pairs cost nothing. With
    a ``sliding_window`` the row reads its last W positions: the pairs are the same (a
    row's pages, shared by every layer), and a pair whose page lies wholly before the
    window adds exactly nothing (its weights are zeros at a maximum of -1e30).

    Each pair is a partial softmax over its page (its max, sum and weighted values, fp32);
    a row's pairs are combined at the row's max. A row's numbers depend only on its own
    pairs, bit for bit, not on which rows share the step or on the padding: XLA:CPU computes
    an elementwise op (exp) differently by array size, so the pairs go through one program
    in blocks of `pair_block`, and the blocks add into their rows one pair after another, in
    pair order. Both passes are loops over the blocks that hold real pairs (a trip count
    known only on the device): one program serves any mix of lengths.
    """
    B, H, K = q_bhk.shape
    J = pairs.row.shape[0]
    G, _, ps, _ = k_pages.shape
    R = H // G
    C = pair_block(ps)
    windowed = check_sliding_window(sliding_window) is not None
    if J % C:
        raise ValueError(f"{J} pairs: a multiple of {C}")
    q_bgrk = q_bhk.reshape(B, G, R, K).astype(jnp.float32)
    seen_bs = jnp.arange(ps)[None, :]
    blocks = jax.tree.map(lambda x: x.reshape(J // C, C), pairs)
    real_blocks = (jnp.sum(pairs.row < B) + C - 1) // C  # real pairs come first

    def block_at(i: jax.Array) -> PagePairs:
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), blocks)

    def partial_softmax(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        row_top, top_j, total_j, out_j = carry
        block = block_at(i)
        row = jnp.minimum(block.row, B - 1)
        s = jnp.einsum("jgrk,gjsk->jgrs", q_bgrk[row], k_pages[:, block.page].astype(jnp.float32))
        key_js, query_j = block.start[:, None] + seen_bs, pos_b[row][:, None]
        seen_js = key_js <= query_j
        if windowed:
            seen_js &= query_j - key_js < sliding_window
        s = jnp.where(seen_js[:, None, None], s * K**-0.5, -1e30)
        top = s.max(-1)  # [C, G, R]: without a window a page's first position is always seen
        p = jnp.exp(s - top[..., None])
        if windowed:  # a page before the window: top -1e30, and no weight (not exp(0))
            p = jnp.where(seen_js[:, None, None], p, 0.0)
        p_rounded = p.astype(q_bhk.dtype).astype(jnp.float32)
        out = jnp.einsum("jgrs,gjsk->jgrk", p_rounded, v_pages[:, block.page].astype(jnp.float32))
        return (
            row_top.at[block.row].max(top, mode="drop"),
            jax.lax.dynamic_update_index_in_dim(top_j, top, i, 0),
            jax.lax.dynamic_update_index_in_dim(total_j, p.sum(-1), i, 0),
            jax.lax.dynamic_update_index_in_dim(out_j, out, i, 0),
        )

    n = J // C
    row_top, top_j, total_j, out_j = jax.lax.fori_loop(
        0,
        real_blocks,
        partial_softmax,
        (
            jnp.full((B, G, R), -jnp.inf),
            jnp.zeros((n, C, G, R)),
            jnp.zeros((n, C, G, R)),
            jnp.zeros((n, C, G, R, K)),
        ),
    )

    def add_block(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        row_total, row_out = carry
        rows = block_at(i).row
        top, total, out = (
            jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in (top_j, total_j, out_j)
        )
        rescale = jnp.exp(top - row_top[jnp.minimum(rows, B - 1)])
        row_total = row_total.at[rows].add(total * rescale, mode="drop")
        row_out = row_out.at[rows].add(out * rescale[..., None], mode="drop")
        return row_total, row_out

    start = (jnp.zeros((B, G, R)), jnp.zeros((B, G, R, K)))
    total_b, out_b = jax.lax.fori_loop(0, real_blocks, add_block, start)
    out_b = out_b / jnp.where(total_b > 0, total_b, 1.0)[..., None]  # a row of no pairs: 0
    return out_b.astype(q_bhk.dtype).reshape(B, H, K)


def token_attention(
    q_bthk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table_nm: jax.Array,
    pos_n: jax.Array,
    active_n: jax.Array,
    *,
    sliding_window: Any = None,
) -> jax.Array:
    """`ragged_attention` of every query of a chunk [B, T, H, K] as a row of its own (N = B *
    T rows, each with its page table [N, M], position and whether it is real): each query's
    numbers are then those decode computes for a token at its position, bit for bit, since
    a row's numbers depend only on its own pairs. For prefill chunks and training sequences
    whose logprobs must equal the sampler's (`exact_attention`). ``sliding_window``: as
    `ragged_attention`'s."""
    B, T, H, K = q_bthk.shape
    N, M = table_nm.shape
    C = pair_block(k_pages.shape[2])
    pairs = page_pairs(table_nm, pos_n, active_n, -(-N * M // C) * C, k_pages.shape[2])
    out = ragged_attention(
        q_bthk.reshape(N, H, K), k_pages, v_pages, pairs, pos_n, sliding_window=sliding_window
    )
    return out.reshape(B, T, H, K)


def exact_attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    page_size: int,
    window: int | None = None,
    *,
    sliding_window: Any = None,
) -> jax.Array:
    """Training attention (packed segments, as `decoder.attention`) that computes what the
    engine's decode computes for each token: the row's keys are read in pages of
    ``page_size`` positions from its segment's start, by `token_attention`. Every position
    of a row starts a page of the pool it builds ([G, B * T, page_size, K]: ``page_size``
    times the row's keys), so a segment starting anywhere has its pages; a token's page
    table holds the pages of ``window`` positions (no segment is longer; default the row),
    which bounds the decode loop's buffers (pairs of every token and every page it may
    read). The work is about what causal attention costs, through the decode loop's blocks;
    no gradient of its own (`decoder.attention` gives it). With a ``sliding_window`` a token
    reads the last W positions of its segment (its position counted from the segment's
    start, `segment_positions`), as decode does: every page stays in its table, masked.
    """
    B, T, _, K = q_bthk.shape
    G = k_btgk.shape[2]
    t = jnp.arange(T)
    pos_bt = segment_positions(segment_ids_bt)
    start_bt = t[None] - pos_bt
    span = t[:, None] + jnp.arange(page_size)[None]  # [T, page_size]: a page at each position

    def pool(x_btgk: jax.Array) -> jax.Array:
        pages = jnp.pad(x_btgk, ((0, 0), (0, page_size), (0, 0), (0, 0)))[:, span]
        return pages.transpose(3, 0, 1, 2, 4).reshape(G, B * T, page_size, K)

    M = -(-min(window or T, T) // page_size)  # pages a token's table holds
    first_btm = start_bt[..., None] + jnp.arange(M) * page_size
    table = jnp.arange(B)[:, None, None] * T + jnp.minimum(first_btm, T - 1)
    return token_attention(
        q_bthk,
        pool(k_btgk),
        pool(v_btgk),
        table.reshape(B * T, M).astype(jnp.int32),
        pos_bt.reshape(B * T),
        (segment_ids_bt > 0).reshape(B * T),
        sliding_window=sliding_window,
    )


PALLAS_BLOCK_POSITIONS = 256  # cache positions per compute block of `pallas_paged_attention`


def pallas_paged_attention(
    q_bhk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table_bm: jax.Array,
    pos_b: jax.Array,
    active_b: jax.Array,
) -> jax.Array:
    """Decode attention as `ragged_attention` computes it, by the TPU paged-attention
    kernel JAX ships (`jax.experimental.pallas.ops.tpu.paged_attention`): row b attends to
    its positions ``0 .. pos_b`` through its page table, reading its pages in place (one
    kv head's pages per program, blocks of pages double-buffered into VMEM). Rows not active
    give zeros.

    The kernel reads keys and values as bfloat16 (it casts them), scores and weights in
    fp32 (the weights are not rounded before the values' matmul): for a 16-bit cache it is
    `ragged_attention` up to that rounding. Off TPU it runs only in Pallas's TPU interpret
    mode (``pltpu.force_tpu_interpret_mode()`` around the trace).
    """
    block = max(1, PALLAS_BLOCK_POSITIONS // k_pages.shape[2])
    q, table, lengths = _kernel_inputs(q_bhk, jnp.float32, table_bm, pos_b, active_b, block)
    out = tpu_paged_attention(q, k_pages, v_pages, lengths, table, pages_per_compute_block=block)
    return jnp.where(active_b[:, None, None], out, 0).astype(q_bhk.dtype)


def _kernel_inputs(
    q_bhk: jax.Array,
    q_dtype: Any,
    table_bm: jax.Array,
    pos_b: jax.Array,
    active_b: jax.Array,
    pages: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What JAX's paged-attention kernels take: the queries scaled by K**-0.5 (they do not
    scale) in ``q_dtype``; the page tables padded to a multiple of ``pages`` (the kernels step
    over a row's pages in blocks; page 0 there, past every row's length, never read); each
    row's length, 0 for a row not active."""
    M = table_bm.shape[1]
    table = jnp.pad(table_bm, ((0, 0), (0, -M % pages)))
    lengths = jnp.where(active_b, pos_b + 1, 0).astype(jnp.int32)
    q = (q_bhk.astype(jnp.float32) * q_bhk.shape[2] ** -0.5).astype(q_dtype)
    return q, table, lengths


TRITON_BLOCK_POSITIONS = 64  # cache positions per compute block of `triton_paged_attention`
TRITON_SPLITS = 8  # the most partitions of a row's pages `triton_paged_attention` runs apart


def triton_paged_attention(
    q_bhk: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table_bm: jax.Array,
    pos_b: jax.Array,
    active_b: jax.Array,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention as `ragged_attention` computes it, by the GPU (Triton) paged-attention
    kernel JAX ships (`jax.experimental.pallas.ops.gpu.paged_attention`): row b attends to
    its positions ``0 .. pos_b`` through its page table, reading its pages in place; a row's
    pages split into up to `TRITON_SPLITS` partitions that run apart (flash-decoding) and are
    combined by their softmax statistics. Rows not active give zeros. ``interpret``: Pallas's
    interpret mode (off a GPU).

    Numbers: the kernel's matmuls take operands of one dtype (Triton's), so the queries go in
    scaled by K**-0.5 and rounded to the cache's dtype (exact for 16-bit queries when K is a
    power of 4); the scores are fp32 sums of those products; the kernel rounds each block's
    unnormalised weights (at most 1) to the values' dtype before their matmul, so for a 16-bit
    cache the output is within one rounding of each weight (2^-8 relative) of
    `ragged_attention`'s on the same queries, then rounded to q's dtype.
    """
    P, ps = k_pages.shape[1], k_pages.shape[2]
    block = max(1, TRITON_BLOCK_POSITIONS // ps)
    splits = max(1, min(TRITON_SPLITS, -(-table_bm.shape[1] // block)))
    # the kernel's partitions are whole compute blocks; every page id kept in the pool
    q, table, lengths = _kernel_inputs(
        q_bhk, k_pages.dtype, table_bm, pos_b, active_b, splits * block
    )
    table = jnp.clip(table, 0, P - 1)
    out = gpu_paged_attention(
        q,
        k_pages,
        v_pages,
        table,
        lengths,
        k_splits=splits,
        pages_per_compute_block=block,
        interpret=interpret,
    )
    return jnp.where(active_b[:, None, None], out, 0).astype(q_bhk.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeTables:
    """What a decode step's layers share, in page ids of the pool they read (a shard's own,
    sharded): each row's page table [B, M], the page its new token goes into [B] (past the
    pool for an idle row: written nowhere), and the (row, page) pairs of `ragged_attention`."""

    table: jax.Array
    page: jax.Array
    pairs: PagePairs


def decode_tables(
    table_bm: jax.Array,
    pos_b: jax.Array,
    active_b: jax.Array,
    num_pages: int,
    page_size: int,
    first_page: jax.Array | int = 0,
) -> DecodeTables:
    """`DecodeTables` of rows whose pages are ``first_page .. first_page + num_pages - 1`` of
    the pool (a shard's range; the ids come out counted from its first page), for new tokens
    at positions ``pos_b``."""
    B, M = pos_b.shape[0], table_bm.shape[1]
    table = table_bm - first_page
    page_b = table[jnp.arange(B), jnp.minimum(pos_b // page_size, M - 1)]
    # every row's every page fits the pairs; the loops stop after the real ones
    capacity = -(-B * M // pair_block(page_size)) * pair_block(page_size)
    return DecodeTables(
        table=table,
        page=jnp.where(active_b, page_b, num_pages),
        pairs=page_pairs(table, pos_b, active_b, capacity, page_size),
    )


def _decode_layer(
    q_bhk: jax.Array,
    k_bgk: jax.Array,
    v_bgk: jax.Array,
    ck: jax.Array,
    cv: jax.Array,
    tables: DecodeTables,
    pos_b: jax.Array,
    active_b: jax.Array,
    sliding_window: Any,
    kernel: str,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's decode attention over a pool's pages [G, P, page_size, K]: the new
    token's key and value go into its page, then the row attends to its pages (by
    `ragged_attention` or, ``kernel`` "pallas", `pallas_paged_attention`, or "triton",
    `triton_paged_attention`, in interpret mode where ``interpret``). A layer with a
    ``sliding_window`` attends by `ragged_attention` whatever ``kernel`` (JAX's kernels take
    no window; `DecodeTables` hold the pairs for every kernel). Returns the attention
    [B, H, K] and the layer's pages."""
    offset_b = pos_b % ck.shape[2]
    ck = ck.at[:, tables.page, offset_b].set(k_bgk.transpose(1, 0, 2).astype(ck.dtype), mode="drop")
    cv = cv.at[:, tables.page, offset_b].set(v_bgk.transpose(1, 0, 2).astype(cv.dtype), mode="drop")
    if sliding_window is None and kernel == "pallas":
        return pallas_paged_attention(q_bhk, ck, cv, tables.table, pos_b, active_b), ck, cv
    if sliding_window is None and kernel == "triton":
        out = triton_paged_attention(q_bhk, ck, cv, tables.table, pos_b, active_b, interpret)
        return out, ck, cv
    out = ragged_attention(q_bhk, ck, cv, tables.pairs, pos_b, sliding_window=sliding_window)
    return out, ck, cv


def _layer_programs(
    layer: Callable[..., Any], mesh: Any, in_specs: tuple[Any, ...], out_specs: Any
) -> Callable[..., Any]:
    """``layer`` (its last positional argument its ``sliding_window``) under
    ``jax.shard_map``, called as ``(*args, sliding_window=None)``: one program for the
    global layers and one for the windowed ones whatever their windows (the window goes in
    as a replicated int32 scalar)."""
    plain = jax.shard_map(
        partial(layer, sliding_window=None),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )
    windowed = jax.shard_map(
        layer,
        mesh=mesh,
        in_specs=(*in_specs, jax.sharding.PartitionSpec()),
        out_specs=out_specs,
        check_vma=False,
    )

    def call(*args: Any, sliding_window: Any = None) -> Any:
        if check_sliding_window(sliding_window) is None:
            return plain(*args)
        return windowed(*args, jnp.asarray(sliding_window, jnp.int32))

    return call


def decode_steps(
    sharder: Sharder, num_pages: int, page_size: int, kernel: str
) -> tuple[Callable[..., DecodeTables], Callable[..., tuple[jax.Array, ...]]]:
    """`decode_tables` and `_decode_layer` for a pool of ``num_pages`` pages, each under
    ``jax.shard_map`` over ``sharder``'s mesh axes that split the rows (and
    the pool's pages: `PAGE_AXES`) and the kv heads: a shard computes its own rows' tables
    in its own page ids and their attention over its own pages, so nothing crosses devices
    (a row's pages are on its shard: the host's ledger, `engine.pages`, sees to it). A
    query's heads split as the kv heads they read. The layer takes each layer's
    ``sliding_window`` (keyword; a windowed layer decodes by `ragged_attention`)."""
    rules, mesh = sharder.rules, sharder.mesh
    local = num_pages // sharder.shards("batch")  # a shard's pages
    rows = rules.spec(("batch",))  # every per-row array and table: split on its first axis
    heads, pages = rules.spec(("batch", "kv_heads", "head_dim")), rules.spec(PAGE_AXES)

    def shard_tables(table_bm: jax.Array, pos_b: jax.Array, active_b: jax.Array) -> DecodeTables:
        first = sharder.shard_index("batch") * local
        return decode_tables(table_bm, pos_b, active_b, local, page_size, first)

    return (
        jax.shard_map(
            shard_tables,
            mesh=mesh,
            in_specs=(rows, rows, rows),
            out_specs=rows,
            check_vma=False,
        ),
        _layer_programs(
            partial(_decode_layer, kernel=kernel, interpret=platform_of(sharder) != "gpu"),
            mesh,
            (heads, heads, heads, pages, pages, rows, rows, rows),
            (heads, pages, pages),
        ),
    )


def copy_page(pages: Any, src_dst: jax.Array, sharder: Sharder) -> Any:
    """``pages`` (a tree of per-layer pools [G, P, page_size, K]) with page ``src_dst[1]``
    a copy of page ``src_dst[0]``. Both are pages of one shard's range: with a ``sharder``
    the copy runs on that shard, in its own page ids, and moves nothing between devices
    (elsewhere the destination is out of range and nothing is written)."""

    def copy(src_dst: jax.Array, pages: Any) -> Any:
        num_pages = jax.tree.leaves(pages)[0].shape[1]
        first = sharder.shard_index("batch") * num_pages
        src, dst = src_dst[0] - first, src_dst[1] - first
        src = jnp.clip(src, 0, num_pages - 1)
        dst = jnp.where((dst >= 0) & (dst < num_pages), dst, num_pages)
        return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src], mode="drop"), pages)

    spec = sharder.rules.spec(PAGE_AXES)
    replicated = jax.sharding.PartitionSpec()
    return jax.shard_map(copy, mesh=sharder.mesh, in_specs=(replicated, spec), out_specs=spec)(
        src_dst, pages
    )


class LayerPools:
    """Every layer's pool buffer through one forward whose layers attend one after another,
    each once with its own index (`claim`): a layer given another's index would overwrite
    that layer's keys and values and leave its own stale. ``k`` and ``v`` then hold every
    layer's updated buffer, in order."""

    def __init__(self, k_pools: tuple[jax.Array, ...], v_pools: tuple[jax.Array, ...]) -> None:
        self._pools = list(k_pools), list(v_pools)
        self._attended = [0] * len(k_pools)  # calls of `attend` per layer: once each

    def claim(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer ``i``'s buffers, which its attention then hands back (`put`)."""
        if not 0 <= i < len(self._attended) or self._attended[i]:
            raise ValueError(
                f"attend({i}, ...): each of the {len(self._attended)} layers attends once a "
                "forward, with its own index (a layer given another's index would overwrite "
                "that layer's keys and values and leave its own stale)"
            )
        self._attended[i] += 1
        return self._pools[0][i], self._pools[1][i]

    def put(self, i: int, ck: jax.Array, cv: jax.Array) -> None:
        self._pools[0][i], self._pools[1][i] = ck, cv

    @property
    def k(self) -> tuple[jax.Array, ...]:
        self._all_attended()
        return tuple(self._pools[0])

    @property
    def v(self) -> tuple[jax.Array, ...]:
        self._all_attended()
        return tuple(self._pools[1])

    def _all_attended(self) -> None:
        missing = [i for i, n in enumerate(self._attended) if not n]
        if missing:
            raise ValueError(
                f"layers {missing} never called attend in this forward: their keys and values "
                "would stay those of the last chunk"
            )


class PagedChunk(LayerPools):
    """One chunk's attention over every layer's pool buffer, for a forward that runs its
    layers one after another (the decoder's with a cache, a custom policy's: `policy`).

    Row b's pages are ``page_table[b]`` and it holds ``pos[b]`` tokens already; the chunk's
    tokens take ``positions`` ``pos[b] + t``. Only the row's first ``num_new[b]`` tokens are
    real (their keys and values are written into its pages); the rest are padding, written
    nowhere (a row of none is idle). ``attend(i, q, k, v)`` (queries [B, T, H, K], the chunk's
    keys and values [B, T, G, K]) writes layer i's chunk into its buffer and attends over the
    row's positions up to each query's: a chunk of T = 1 (decode) with `decode_steps`' layer
    (each shard its own pages), a longer one (prefill) with `paged_attention` over
    ``pages_read`` pages, or where ``exact``, each of its tokens as decode reads
    (`token_attention`: the numbers a decode step would compute for it). ``attend(i, q, k,
    v, sliding_window=W)``: a layer whose queries read only the last W positions, up to
    their own (a decode chunk's by `ragged_attention`, whatever ``decode_kernel``). ``k`` and
    ``v`` then hold every layer's updated buffer, in order.
    """

    def __init__(
        self,
        sharder: Sharder,
        k_pools: tuple[jax.Array, ...],
        v_pools: tuple[jax.Array, ...],
        page_table_bm: jax.Array,
        pos_b: jax.Array,
        num_new_b: jax.Array,
        pages_read: int | None,
        decode_kernel: str,
        B: int,
        T: int,
        exact: bool = False,
    ) -> None:
        if T > 1 and pages_read is None:
            raise ValueError("a prefill chunk (T > 1) needs pages_read")
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={decode_kernel!r}: of {', '.join(DECODE_KERNELS)}")
        _, P, ps, _ = k_pools[0].shape
        M = page_table_bm.shape[1]
        self.positions = pos_b[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        rows_bt = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        page_bt = page_table_bm[rows_bt, jnp.minimum(self.positions // ps, M - 1)]
        # a chunk's padding (and an inactive row's token) is written nowhere: page P is dropped
        self._real_bt = jnp.arange(T)[None, :] < num_new_b[:, None]
        self._page_bt = jnp.where(self._real_bt, page_bt, P)
        self._exact = exact
        self._offset_bt = self.positions % ps
        # decode (T = 1): each shard of the rows reads and writes its own pages only
        make_tables, self._decode_layer = decode_steps(sharder, P, ps, decode_kernel)
        self._active_b = num_new_b > 0
        self._tables = make_tables(page_table_bm, pos_b, self._active_b) if T == 1 else None
        super().__init__(k_pools, v_pools)
        self._table_bm, self._pos_b, self._pages_read = page_table_bm, pos_b, pages_read

    def attend(
        self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, sliding_window: Any = None
    ) -> jax.Array:
        window = check_sliding_window(sliding_window)  # before the layer's one call is taken
        ck, cv = self.claim(i)
        if self._tables is not None:
            out, ck, cv = self._decode_layer(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                ck,
                cv,
                self._tables,
                self._pos_b,
                self._active_b,
                sliding_window=window,
            )
            self.put(i, ck, cv)
            return out[:, None]
        # the chunk's keys and values go into their pages first, then attention reads them
        # (the update is [G, B, T, K], split by the page and offset indices)
        k_gbtk, v_gbtk = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
        at = (slice(None), self._page_bt, self._offset_bt)
        ck = ck.at[at].set(k_gbtk.astype(ck.dtype), mode="drop")
        cv = cv.at[at].set(v_gbtk.astype(cv.dtype), mode="drop")
        self.put(i, ck, cv)
        if self._exact:
            B, T = self._real_bt.shape
            table = jnp.repeat(self._table_bm, T, axis=0)
            positions = self.positions.reshape(B * T)
            real = self._real_bt.reshape(B * T)
            return token_attention(q, ck, cv, table, positions, real, sliding_window=window)
        assert self._pages_read is not None
        return paged_attention(
            q, ck, cv, self._table_bm, self._pos_b, self._pages_read, sliding_window=window
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepRows:
    """A ragged step's rows (`RaggedStep`), one token each, N rows in all (each shard of the
    rows ``N / shards`` of them, naming pages of its own range): each row's position and the
    page its key and value go into (past the pool for a padding row: written nowhere); the
    decode part, the first ``R / shards`` rows of each shard (each a query at ``pos_r`` over
    its page table ``table_r`` [R, M] where ``decode_r``); and the prompt chunks
    (`StepChunks`, ``S / shards`` a shard, rows counted from the shard's first, ``count``
    [shards])."""

    # arrays, on the host as the engine lays them out or on the devices
    pos: Any  # int32 [N]
    page: Any  # int32 [N]
    table_r: Any  # int32 [R, M]
    pos_r: Any  # int32 [R]
    decode_r: Any  # bool [R]
    chunks: StepChunks


def _local_rows(rows: StepRows, num_pages: int, page_size: int, first: jax.Array) -> Any:
    """A shard's `StepRows` in its own page ids (pool ``first ..`` of ``num_pages``): its
    rows' pages, its decode part's `DecodeTables`, its chunks' tables."""
    page = rows.page - first
    page = jnp.where((page >= 0) & (page < num_pages), page, num_pages)
    tables = decode_tables(rows.table_r, rows.pos_r, rows.decode_r, num_pages, page_size, first)
    chunks = dataclasses.replace(rows.chunks, table=rows.chunks.table - first)
    return page, tables, chunks


def _step_layer(
    q_nhk: jax.Array,
    k_ngk: jax.Array,
    v_ngk: jax.Array,
    ck: jax.Array,
    cv: jax.Array,
    page_n: jax.Array,
    pos_n: jax.Array,
    tables: DecodeTables,
    pos_r: jax.Array,
    decode_r: jax.Array,
    chunks: StepChunks,
    sliding_window: Any,
    kernel: str,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer of a ragged step on one shard: every row's key and value into its page, then
    the decode part (the first rows, `_decode_layer`'s kernels: `ragged_attention` for a
    layer with a ``sliding_window``) and the prompt chunks (`chunk_attention`). Returns the
    attention [N, H, K] and the layer's pages."""
    offset = pos_n % ck.shape[2]
    ck = ck.at[:, page_n, offset].set(k_ngk.transpose(1, 0, 2).astype(ck.dtype), mode="drop")
    cv = cv.at[:, page_n, offset].set(v_ngk.transpose(1, 0, 2).astype(cv.dtype), mode="drop")
    R = pos_r.shape[0]
    q_r = q_nhk[:R]
    if sliding_window is None and kernel == "pallas":
        decoded = pallas_paged_attention(q_r, ck, cv, tables.table, pos_r, decode_r)
    elif sliding_window is None and kernel == "triton":
        decoded = triton_paged_attention(q_r, ck, cv, tables.table, pos_r, decode_r, interpret)
    else:
        decoded = ragged_attention(q_r, ck, cv, tables.pairs, pos_r, sliding_window=sliding_window)
    decoded = jnp.where(decode_r[:, None, None], decoded, 0)
    chunked = chunk_attention(q_nhk, ck, cv, chunks, sliding_window=sliding_window)
    out = chunked.at[:R].add(decoded)
    return out, ck, cv


class RaggedStep(LayerPools):
    """A ragged step's attention over every layer's pool buffer (`PagedChunk`'s interface,
    for a forward of rows of one token each, [N, 1]): the rows are decoding slots' next
    tokens and prompt chunks of several sequences, each its own query length, positions and
    pages (`StepRows`). ``attend(i, q, k, v)`` writes the rows' keys and values into layer
    i's buffer, then attends: the decode part by the decode kernel (`ragged_attention`, or
    the TPU / GPU kernel), the chunks by `chunk_attention`; each shard of the rows its own
    pages, under ``jax.shard_map`` (nothing crosses chips). ``attend(i, q, k, v,
    sliding_window=W)``: a layer whose queries read only their last W positions (its decode
    part by `ragged_attention`, whatever ``decode_kernel``). ``k`` and ``v`` then hold every
    layer's updated buffer, in order."""

    def __init__(
        self,
        sharder: Sharder,
        k_pools: tuple[jax.Array, ...],
        v_pools: tuple[jax.Array, ...],
        rows: StepRows,
        decode_kernel: str,
    ) -> None:
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={decode_kernel!r}: of {', '.join(DECODE_KERNELS)}")
        _, P, ps, _ = k_pools[0].shape
        rules, mesh = sharder.rules, sharder.mesh
        local = P // sharder.shards("batch")
        split = rules.spec(("batch",))
        heads, pages = rules.spec(("batch", "kv_heads", "head_dim")), rules.spec(PAGE_AXES)

        def localize(rows: StepRows) -> Any:
            return _local_rows(rows, local, ps, sharder.shard_index("batch") * local)

        self._rows = rows
        self.positions = rows.pos[:, None]
        self._local = jax.shard_map(
            localize, mesh=mesh, in_specs=(split,), out_specs=split, check_vma=False
        )(rows)
        self._layer = _layer_programs(
            partial(_step_layer, kernel=decode_kernel, interpret=platform_of(sharder) != "gpu"),
            mesh,
            (heads, heads, heads, pages, pages, *(split,) * 6),
            (heads, pages, pages),
        )
        super().__init__(k_pools, v_pools)

    def attend(
        self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, sliding_window: Any = None
    ) -> jax.Array:
        window = check_sliding_window(sliding_window)  # before the layer's one call is taken
        ck, cv = self.claim(i)
        page, tables, chunks = self._local
        rows = self._rows
        out, ck, cv = self._layer(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            ck,
            cv,
            page,
            rows.pos,
            tables,
            rows.pos_r,
            rows.decode_r,
            chunks,
            sliding_window=window,
        )
        self.put(i, ck, cv)
        return out[:, None]
