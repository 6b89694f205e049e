"""Training attention by a fused Pallas kernel over packed rows: JAX's splash attention on
TPU, JAX's Pallas GPU (Triton) flash attention on CUDA GPUs.

`kernel_attention` computes what `decoder.attention` computes (causal grouped-query attention
within packed segments, segment 0 padding that no real token reads, scores in fp32) with one of
the kernels JAX ships, each a flash-attention forward and backward (its own custom VJP) that
reads the segment ids to mask across sequences:

- ``"splash"`` (``jax.experimental.pallas.ops.tpu.splash_attention``): skips the key blocks
  above the diagonal (and, with a ``window``, those further back) and serves each kv head's R
  query heads from the one kv head (no repeated keys and values).
- ``"triton"`` (``jax.experimental.pallas.ops.gpu.attention.mha``): causal blocks only; it
  takes as many kv heads as query heads, so each kv head is repeated R times going in and the
  R heads' key and value gradients are summed in fp32 coming out (`_repeat_heads`). Picked on
  a GPU for 16-bit inputs only: its matmuls of fp32 inputs run in TF32 there, which fp32
  training does not ask for (fp32 keeps the XLA loop).

`training_kernel` is the one place that picks (`decoder.attention` asks it): splash where the
mesh's devices are TPUs (so a program compiled on a CPU host for an abstract TPU topology
counts), triton where they are GPUs and the inputs are 16-bit, else None (the XLA loop).
`forced_kernel` overrides the pick within a ``with`` block, for tests and comparisons.

A ``pallas_call`` is not partitioned by the compiler: under a mesh the kernel runs inside
``jax.shard_map``, each device on its rows (``batch``'s mesh axes) and its heads (the query
heads' and kv heads' alike, ``act_heads``'s), whole rows and whole heads each. Off its platform
a kernel runs only in Pallas's interpret mode: splash in the TPU interpreter
(``pltpu.force_tpu_interpret_mode()`` around the trace), triton in the generic one (turned on
here whenever the devices are not GPUs).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as triton_attention
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from jax_agent_rl.models.sharding import Sharder

KERNELS = ("splash", "triton")
LANES = 128  # the kernels' blocks are multiples of a TPU vreg's lanes; rows are padded to them
KERNEL_BLOCKS = (512, 256, LANES)  # splash's block sizes tried, largest first: the first dividing T
# triton's blocks (queries x keys): the forward's 128 x 64 and the backward's 64 x 64 tiles of
# bf16 with head dim 128 fit an H100's shared memory at the kernel's 2 pipeline stages
TRITON_BLOCKS = triton_attention.BlockSizes(
    block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64
)
ROW_AXES = ("batch", "seq")
HEAD_AXES = ("batch", "seq", "act_heads", "head_dim")  # q, k, v and out alike

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("forced_kernel", default=None)


def platform_of(sharder: Sharder) -> str:
    """The platform the computation is laid out on: its mesh's devices' ("tpu", "gpu", "cpu";
    an abstract TPU topology's devices count as TPUs, and an abstract mesh's device kind)."""
    mesh = sharder.mesh
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return str(mesh.abstract_device.platform) if mesh.abstract_device else "cpu"
    return str(mesh.devices.flat[0].platform)


def runs_on_tpu(sharder: Sharder) -> bool:
    """Whether the computation is laid out on TPUs (`platform_of`)."""
    return platform_of(sharder) == "tpu"


@contextlib.contextmanager
def forced_kernel(name: str) -> Iterator[None]:
    """Within the block, `training_kernel` answers ``name`` ("splash", "triton", or "xla" for
    the XLA loop) wherever it is asked, whatever the platform: off its platform the kernel runs
    in Pallas's interpret mode (splash also needs ``pltpu.force_tpu_interpret_mode()``). It is
    read when a program is traced: a jitted function traced before keeps its kernel."""
    if name not in (*KERNELS, "xla"):
        raise ValueError(f"kernel {name!r}: of {', '.join((*KERNELS, 'xla'))}")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def training_kernel(sharder: Sharder, dtype: Any) -> str | None:
    """The fused kernel that computes training attention of ``dtype`` inputs on ``sharder``'s
    devices: "splash" on TPU, "triton" on GPU for 16-bit inputs, None for the XLA loop (CPU;
    fp32 on GPU, whose Triton matmuls would take TF32). `forced_kernel` overrides it."""
    forced = _FORCED.get()
    if forced is not None:
        return None if forced == "xla" else forced
    platform = platform_of(sharder)
    if platform == "tpu":
        return "splash"
    if platform == "gpu" and jnp.dtype(dtype).itemsize == 2:
        return "triton"
    return None


def kernel_block(T: int) -> int:
    """The block of queries and keys splash steps by for rows of ``T`` (a multiple of `LANES`)
    tokens: the largest of `KERNEL_BLOCKS` that divides T."""
    return next(b for b in KERNEL_BLOCKS if T % b == 0)


def kernel_attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    sharder: Sharder,
    window: int | None = None,
    kernel: str = "splash",
    sliding_window: int | None = None,
) -> jax.Array:
    """`decoder.attention` by the fused ``kernel`` (of `KERNELS`): out [B, T, H, K] in q's dtype.

    Under ``sharder`` each device runs the kernel on its share of the rows and heads (inside
    ``shard_map``); the rows and heads must divide over their mesh axes, and neither the
    sequence nor the head dimension may be sharded (the kernel reads whole rows and heads).
    ``window`` (static): no sequence is longer, so splash skips key blocks further back
    (triton reads every causal block whatever the window; the segments mask the same keys).
    ``sliding_window`` W (static, splash only): a query reads the keys less than W tokens
    back, itself included (a layer's sliding window; tokens are positions within a packed
    segment): splash's local mask of the smaller of the two windows. Triton takes none.

    Numbers, splash: the queries are scaled by K**-0.5 in their own dtype before the kernel
    (exact when K is a power of 4; one rounding of q otherwise, for 16-bit q), where
    `decoder.attention` scales the fp32 scores. The kernel takes fp32 scores and softmax
    statistics and, in the forward pass, multiplies the fp32 weights by the values converted
    to fp32 (`decoder.attention` rounds the normalized weights to the values' dtype first);
    its backward pass rounds the weights and the score gradients to the inputs' dtype before
    each matmul, as `decoder.attention`'s does, but takes the row sums ``sum(p * dp)`` from
    its output rounded to that dtype (`decoder.attention`: from the fp32 weights).

    Numbers, triton: the fp32 scores are scaled by K**-0.5 * log2(e) (one fp32 rounding more)
    and exponentiated in base 2; the forward rounds the unnormalised weights (at most 1) to the
    values' dtype before their matmul and divides the fp32 sum by the fp32 normaliser; the
    backward, like splash's, takes ``sum(p * dp)`` from the output rounded to the dtype and
    rounds the weights and score gradients to it before each matmul; each of a kv head's R
    query heads gives its own key and value gradient rounded to the dtype, summed in fp32.
    Padding queries' outputs (segment 0, which the kernel lets read padding keys) are zero.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: of {', '.join(KERNELS)}")
    H, G = q_bthk.shape[2], k_btgk.shape[2]
    if H % G:
        raise ValueError(f"{H} query heads do not divide into {G} kv heads")
    if sliding_window is not None:
        if kernel != "splash":
            raise ValueError(
                f"sliding_window={sliding_window}: splash's local mask; {kernel} has none"
            )
        window = sliding_window if window is None else min(window, sliding_window)
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a positive number of positions, or None")
    local: Callable[..., jax.Array]
    if kernel == "splash":
        local = partial(_splash, window=window)
    else:
        local = partial(_triton, interpret=platform_of(sharder) != "gpu")
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


def _rows_padded(x_btnk: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(x_btnk, ((0, 0), (0, pad), (0, 0), (0, 0)))


def _splash(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int | None,
) -> jax.Array:
    """Splash on one device's rows and heads, mapped over the rows. Rows are padded to a
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
        return _rows_padded(x_btnk, pad).transpose(0, 2, 1, 3)

    def row(args: tuple[jax.Array, ...]) -> jax.Array:
        q_hnk, k_gnk, v_gnk, segments_n = args
        return kernel(q_hnk, k_gnk, v_gnk, splash.SegmentIds(q=segments_n, kv=segments_n))

    q_bhnk = rows_first((q_bthk * K**-0.5).astype(q_bthk.dtype))
    segments_bn = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    # one row after another (a device holds few rows: one with packing); a vmap would fold
    # the rows into the kernel's grid, which this jax's TPU interpret mode cannot run
    out_bhnk = jax.lax.map(row, (q_bhnk, rows_first(k_btgk), rows_first(v_btgk), segments_bn))
    return out_bhnk.transpose(0, 2, 1, 3)[:, :T]


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _repeat_heads(x_btgk: jax.Array, r: int) -> jax.Array:
    """[B, T, G, K] -> [B, T, G * r, K], kv head g serving query heads g * r .. g * r + r - 1;
    its gradient sums each group's r heads in fp32 and rounds the sum once."""
    return jnp.repeat(x_btgk, r, axis=2)


def _repeat_heads_fwd(x_btgk: jax.Array, r: int) -> tuple[jax.Array, None]:
    return _repeat_heads(x_btgk, r), None


def _repeat_heads_bwd(r: int, _: None, d_bthk: jax.Array) -> tuple[jax.Array]:
    B, T, H, K = d_bthk.shape
    summed = d_bthk.astype(jnp.float32).reshape(B, T, H // r, r, K).sum(axis=3)
    return (summed.astype(d_bthk.dtype),)


_repeat_heads.defvjp(_repeat_heads_fwd, _repeat_heads_bwd)


def _triton(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    interpret: bool,
) -> jax.Array:
    """JAX's Pallas GPU flash attention on one device's rows and heads (Pallas's interpret
    mode off a GPU). Rows are padded to a multiple of `LANES` (every block size divides it)
    with padding tokens."""
    _, T, H, K = q_bthk.shape
    G = k_btgk.shape[2]
    pad = -T % LANES
    segments_bn = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    q, k, v = (
        _rows_padded(x, pad)
        for x in (q_bthk, _repeat_heads(k_btgk, H // G), _repeat_heads(v_btgk, H // G))
    )
    out_bnhk = triton_attention.mha(
        q,
        k,
        v,
        segments_bn,
        sm_scale=K**-0.5,
        causal=True,
        block_sizes=TRITON_BLOCKS,
        interpret=interpret,
    )
    real = (segments_bn != 0)[:, :, None, None]  # a padding query read padding keys: zero it
    return jnp.where(real, out_bnhk, 0).astype(q_bthk.dtype)[:, :T]
