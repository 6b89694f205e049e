"""Training attention by a Pallas TPU kernel: JAX's splash attention over packed rows.

`pallas_attention` computes what `decoder.attention` computes (causal grouped-query attention
within packed segments, segment 0 padding that no real token reads, scores in fp32) with the
kernel JAX ships in ``jax.experimental.pallas.ops.tpu.splash_attention``: a flash-attention
forward and backward (its own custom VJP) that skips the key blocks above the diagonal (and,
with a ``window``, those further back), reads the segment ids to mask across sequences, and
serves each kv head's R query heads from the one kv head (no repeated keys and values).

A ``pallas_call`` is not partitioned by the compiler: under a mesh the kernel runs inside
``jax.shard_map``, each device on its rows (``batch``'s mesh axes) and its heads (the query
heads' and kv heads' alike, ``act_heads``'s), whole rows and whole heads each. Off TPU it runs
only in Pallas's TPU interpret mode (``pltpu.force_tpu_interpret_mode()`` around the trace).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from jax_agent_rl.models.sharding import Sharder

LANES = 128  # the kernel's blocks are multiples of a TPU vreg's lanes; rows are padded to them
KERNEL_BLOCKS = (512, 256, LANES)  # block sizes tried, largest first: the first dividing T
ROW_AXES = ("batch", "seq")
HEAD_AXES = ("batch", "seq", "act_heads", "head_dim")  # q, k, v and out alike


def runs_on_tpu(sharder: Sharder) -> bool:
    """Whether the computation is laid out on TPUs: the mesh's devices' platform (so a program
    compiled on a CPU host for an abstract TPU topology counts)."""
    return bool(sharder.mesh.devices.flat[0].platform == "tpu")


def kernel_block(T: int) -> int:
    """The block of queries and keys the kernel steps by for rows of ``T`` (a multiple of
    `LANES`) tokens: the largest of `KERNEL_BLOCKS` that divides T."""
    return next(b for b in KERNEL_BLOCKS if T % b == 0)


def pallas_attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    sharder: Sharder,
    window: int | None = None,
) -> jax.Array:
    """`decoder.attention` by the splash-attention kernel: out [B, T, H, K] in q's dtype.

    Under ``sharder`` each device runs the kernel on its share of the rows and heads (inside
    ``shard_map``); the rows and heads must divide over their mesh axes, and neither the
    sequence nor the head dimension may be sharded (the kernel reads whole rows and heads).
    ``window`` (static): no sequence is longer, so key blocks further back are skipped.

    Numbers: the queries are scaled by K**-0.5 in their own dtype before the kernel (exact
    when K is a power of 4; one rounding of q otherwise, for 16-bit q), where
    `decoder.attention` scales the fp32 scores. The kernel takes fp32 scores and softmax
    statistics and, in the forward pass, multiplies the fp32 weights by the values converted
    to fp32 (`decoder.attention` rounds the normalized weights to the values' dtype first);
    its backward pass rounds the weights and the score gradients to the inputs' dtype before
    each matmul, as `decoder.attention`'s does, but takes the row sums ``sum(p * dp)`` from
    its output rounded to that dtype (`decoder.attention`: from the fp32 weights).
    """
    H, G = q_bthk.shape[2], k_btgk.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not divide into {G} kv heads")
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a positive number of positions, or None")
    local = partial(_attention, window=window)
    heads = sharder.sharding(HEAD_AXES, q_bthk.shape).spec  # the shapes' divisibility checked
    kv_heads = sharder.sharding(HEAD_AXES, k_btgk.shape).spec
    rows = sharder.sharding(ROW_AXES, segment_ids_bt.shape).spec
    for axis, mesh_axes in zip(HEAD_AXES, heads, strict=True):
        if axis in ("seq", "head_dim") and mesh_axes is not None:
            raise ValueError(
                f"logical axis {axis!r} is sharded over {mesh_axes}: the attention kernel "
                "needs whole rows and whole heads on each device"
            )
    sharded = jax.shard_map(
        local,
        mesh=sharder.mesh,
        in_specs=(heads, kv_heads, kv_heads, rows),
        out_specs=heads,
        check_vma=False,
    )
    return sharded(q_bthk, k_btgk, v_btgk, segment_ids_bt)


def _attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int | None,
) -> jax.Array:
    """The kernel on one device's rows and heads, mapped over the rows. Rows are padded to a
    multiple of `LANES` with padding tokens (segment 0, never read by a real token)."""
    _, T, H, K = q_bthk.shape
    pad = -T % LANES
    n = T + pad
    block = kernel_block(n)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    if window is None or window >= n:
        head_mask: splash.Mask = splash.CausalMask((n, n))
    else:  # keys of positions q - window + 1 .. q: causal, and blocks further back skipped
        head_mask = splash.LocalMask((n, n), window_size=(window - 1, 0), offset=0)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([head_mask] * H), block_sizes=sizes, head_shards=1, q_seq_shards=1
    )

    def rows_first(x_btnk: jax.Array) -> jax.Array:  # [B, T, N, K] -> [B, N, n, K]
        return jnp.pad(x_btnk, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    def row(args: tuple[jax.Array, ...]) -> jax.Array:
        q_hnk, k_gnk, v_gnk, segments_n = args
        return kernel(q_hnk, k_gnk, v_gnk, splash.SegmentIds(q=segments_n, kv=segments_n))

    q_bhnk = rows_first((q_bthk * K**-0.5).astype(q_bthk.dtype))
    segments_bn = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    # one row after another (a device holds few rows: one with packing); a vmap would fold
    # the rows into the kernel's grid, which this jax's TPU interpret mode cannot run
    out_bhnk = jax.lax.map(row, (q_bhnk, rows_first(k_btgk), rows_first(v_btgk), segments_bn))
    return out_bhnk.transpose(0, 2, 1, 3)[:, :T]
