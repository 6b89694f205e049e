"""The training attention's fused kernels (`kernel_attention`: JAX's splash attention for
TPU, JAX's Pallas GPU (Triton) flash attention for GPU) against the XLA computation
(`decoder.attention` under ``forced_kernel("xla")``): in Pallas's interpret modes on CPU, alone
and on a sharded mesh of fake CPU devices (inside ``shard_map``); compiled for a TPU (an
abstract v5e 2x2) and lowered for a GPU (an abstract H100), where `forward`'s training loss
must pick the platform's kernel with no argument forcing it.

Rows of 300 tokens (padded to 384 for the kernel: three blocks of 128) pack several segments
of unequal lengths, one crossing block boundaries, then padding (segment 0); H = 4 query heads
over G = 2 kv heads. K = 16, so the scale K**-0.5 = 1/4 is a power of two: the kernel's
scaling of q in q's dtype rounds nothing, and the two paths' roundings are the ones below.

Tolerances, entry by entry: each path's error against the exact result of the same inputs is
bounded, and the two bounds are added. With u the unit roundoff of the inputs' dtype (2^-24
fp32, 2^-8 bf16), every weight p is computed in fp32 with a relative error at most
ε = (2·K·A + K + (R + 1)·S)·2^-24 (its score a K-term dot product of size at most A, the
largest ``|q|·|k| / sqrt(K)``, which exp turns into a relative error twice, the score's and
the maximum's; its normaliser a sum of S terms; the sums that use it, of up to R·S terms) and
is rounded to the dtype once (e = u + ε in all). Then, P the exact weights, with ``|·|``
entrywise:
  out: 2·e·P|V| + 2·u·|O|  (the XLA path rounds the normalised weights to the dtype before
       the values' matmul; the kernel multiplies fp32 weights by fp32 values; each rounds
       its output once);
  dS = P∘(dP − D): 4·e·P∘(M + N) + 2·u·|dS|, M = |dO||V|ᵀ bounding |dP|, N = rowsum(P∘M)
       bounding |D| (the kernel takes D from its output rounded to the dtype, the XLA path
       from fp32 weights; each rounds dS to the dtype before the matmuls);
  dQ, dK: sqrt(K)⁻¹·(δdS + 2·ε·|dS|)·|K| or ᵀ·|Q|, plus 2·u·|dQ| or 2·u·|dK|;
  dV: 2·e·Pᵀ|dO| + 2·u·|dV| (both round the weights to the dtype for it).
The Triton kernel adds roundings the bounds above do not hold (its `kernel_attention` notes):
each score times the fp32-rounded K**-0.5·log2(e), rounded (the score's and the maximum's
relative error grow by 2·2^-24 each: ε gains 4·A·2^-24), base-2 exponentials (2 ulps more:
ε gains 2·2^-24), dS times the same scale before its rounding (2^-24·|dS| more), and, per kv
head, R query heads' key and value gradients each rounded to the dtype, then summed in fp32:
u·Σ_r(|x_r| + b_r) more, x_r the exact per-head gradient and b_r its bound before that
rounding.
Padding queries get a zero cotangent (nothing reads them); their rows of P are zero here, and
both paths then give exactly zero gradient to padding keys, values and queries.
"""

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jax_agent_rl.models import (
    ModelConfig,
    Packed,
    Sharder,
    ShardingRules,
    abstract_params,
    forward,
    lm_logits,
    make_mesh,
)
from jax_agent_rl.models.attention_kernels import (
    HEAD_AXES,
    ROW_AXES,
    forced_kernel,
    kernel_attention,
    runs_on_tpu,
    training_kernel,
)
from jax_agent_rl.models.decoder import attention
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.models.sharding import one_device_sharder

B, T, H, G, K = 2, 300, 4, 2, 16
R = H // G
WINDOW = 260  # the longest sequence of `_segments`


def _segments(rows: int = B) -> np.ndarray:
    seg = np.zeros((rows, T), np.int32)
    for b in range(0, rows, 2):
        seg[b, :40], seg[b, 40:170], seg[b, 170:290] = 1, 2, 3  # 290..299 padding
    for b in range(1, rows, 2):
        seg[b, :260] = 1  # one long segment over every block, then padding
    return seg


def _inputs(rows: int, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """q, k, v and a cotangent of the output that is zero on padding tokens."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    real = jnp.asarray(_segments(rows) != 0)[:, :, None, None]
    return (
        jax.random.normal(kq, (rows, T, H, K)).astype(dtype),
        jax.random.normal(kk, (rows, T, G, K)).astype(dtype),
        jax.random.normal(kv, (rows, T, G, K)).astype(dtype),
        (jax.random.normal(kd, (rows, T, H, K)) * real).astype(dtype),
    )


def _out_and_grads(fn: Callable[..., jax.Array], *args: jax.Array) -> tuple[jax.Array, ...]:
    """``fn(q, k, v)``'s output and the gradients of <output, cotangent> w.r.t. q, k, v."""
    q, k, v, dout = args
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(dout))


def _bounds(seg: np.ndarray, *args: jax.Array, triton: bool = False) -> tuple[np.ndarray, ...]:
    """Bounds on |kernel − XLA| for the output and the gradients w.r.t. q, k, v (see the
    module's docstring), from a float64 computation of the exact results; ``triton`` adds the
    Triton kernel's further roundings."""
    q, k, v, dout = (np.asarray(x.astype(jnp.float32), np.float64) for x in args)
    rows = q.shape[0]
    u = 2.0**-24 if args[0].dtype == jnp.float32 else 2.0**-8
    c = K**-0.5
    qg, dog = q.reshape(rows, T, G, R, K), dout.reshape(rows, T, G, R, K)
    causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
    seen = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    seen = seen[:, None, None]  # [B, 1, 1, T, S]: padding queries see nothing here
    size = np.einsum("btgrk,bsgk->bgrts", np.abs(qg), np.abs(k)) * c
    A = size[np.broadcast_to(seen, size.shape)].max()
    eps = (2 * K * A + K + (R + 1) * T + (4 * A + 2 if triton else 0)) * 2.0**-24
    e = u + eps
    s = np.where(seen, np.einsum("btgrk,bsgk->bgrts", qg, k) * c, -np.inf)
    top = np.where(seen.any(-1, keepdims=True), s.max(-1, keepdims=True), 0.0)
    p = np.exp(s - top)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)  # rows of padding queries: zero
    out = np.einsum("bgrts,bsgk->btgrk", p, v)
    dp = np.einsum("btgrk,bsgk->bgrts", dog, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = c * np.einsum("bgrts,bsgk->btgrk", ds, k)
    dk = c * np.einsum("bgrts,btgrk->bsgk", ds, qg)
    dv = np.einsum("bgrts,btgrk->bsgk", p, dog)
    m = np.einsum("btgrk,bsgk->bgrts", np.abs(dog), np.abs(v))
    n = (p * m).sum(-1, keepdims=True)
    d_ds = 4 * e * p * (m + n) + 2 * u * np.abs(ds) + 2 * eps * np.abs(ds)
    d_ds += 2.0**-24 * np.abs(ds) if triton else 0
    out_bound = 2 * e * np.einsum("bgrts,bsgk->btgrk", p, np.abs(v)) + 2 * u * np.abs(out)
    dq_bound = c * np.einsum("bgrts,bsgk->btgrk", d_ds, np.abs(k)) + 2 * u * np.abs(dq)
    dk_bound = c * np.einsum("bgrts,btgrk->bsgk", d_ds, np.abs(qg)) + 2 * u * np.abs(dk)
    dv_bound = 2 * e * np.einsum("bgrts,btgrk->bsgk", p, np.abs(dog)) + 2 * u * np.abs(dv)
    if triton:  # each query head's key and value gradient rounded before the fp32 sum
        dk_r = np.abs(c * np.einsum("bgrts,btgrk->bsgrk", ds, qg))
        dk_r += c * np.einsum("bgrts,btgrk->bsgrk", d_ds, np.abs(qg))
        dv_r = np.abs(np.einsum("bgrts,btgrk->bsgrk", p, dog))
        dv_r += 2 * e * np.einsum("bgrts,btgrk->bsgrk", p, np.abs(dog))
        dk_bound += u * dk_r.sum(3)
        dv_bound += u * dv_r.sum(3)
    return out_bound.reshape(rows, T, H, K), dq_bound.reshape(rows, T, H, K), dk_bound, dv_bound


def _assert_equal_within_bounds(
    seg: np.ndarray,
    kernel: tuple[jax.Array, ...],
    xla: tuple[jax.Array, ...],
    args: tuple,
    triton: bool = False,
) -> None:
    real = seg != 0
    for name, got, want, bound in zip(
        ("out", "dq", "dk", "dv"), kernel, xla, _bounds(seg, *args, triton=triton), strict=True
    ):
        assert got.dtype == want.dtype == args[0].dtype, name
        diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        limit = bound[real] if name == "out" else bound  # a padding token's output: unread
        diff = diff[real] if name == "out" else diff
        assert np.isfinite(diff).all() and np.isfinite(limit).all(), name
        worst = np.unravel_index(np.argmax(diff - limit), diff.shape)
        assert (diff <= limit).all(), (name, worst, diff[worst], limit[worst])
    for grad in kernel[1:]:  # nothing flows into or out of padding tokens
        assert not np.asarray(grad, np.float64)[~real].any()


def _interpreted(kernel: str) -> contextlib.AbstractContextManager:
    """Where ``kernel`` runs on CPU: splash in the TPU interpreter, triton in the generic one
    (`kernel_attention` turns it on off a GPU)."""
    return pltpu.force_tpu_interpret_mode() if kernel == "splash" else contextlib.nullcontext()


@pytest.mark.parametrize("kernel", ["splash", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_xla_attention_in_interpret_mode(kernel: str, dtype: jnp.dtype) -> None:
    """Outputs on real tokens and the gradients w.r.t. q, k, v, with a ``window`` (splash
    then skips key blocks further back: a local mask)."""
    assert K**0.5 == 4  # the scale is a power of two (module docstring)
    seg = _segments()
    args = _inputs(B, dtype)
    segments = jnp.asarray(seg)

    def attend(name: str) -> Callable[..., jax.Array]:
        def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            with forced_kernel(name):
                return attention(q, k, v, segments, WINDOW, sharder=one_device_sharder())

        return fn

    with _interpreted(kernel):
        got = jax.jit(_out_and_grads, static_argnums=0)(attend(kernel), *args)
    want = jax.jit(_out_and_grads, static_argnums=0)(attend("xla"), *args)
    _assert_equal_within_bounds(seg, got, want, args, triton=kernel == "triton")


@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_kernel_under_a_sharded_mesh_equals_xla_attention(kernel: str) -> None:
    """On a (data 1, fsdp 2, tensor 2) mesh of fake CPU devices: each device runs the kernel
    (interpret mode, inside shard_map) on one row and its 2 query heads over 1 kv head. Four
    devices, not the tests' eight: with eight, this jax's TPU interpreter hangs (its kernels
    wait on a barrier of every device, and the eight device programs do not all run at once
    on XLA:CPU)."""
    sharder = Sharder(make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4]))
    rows = 2
    seg = _segments(rows)
    args = _inputs(rows, jnp.float32)
    heads = sharder.sharding(HEAD_AXES, (rows, T, H, K))
    kv_heads = sharder.sharding(HEAD_AXES, (rows, T, G, K))
    placed = [
        jax.device_put(x, s) for x, s in zip(args, (heads, kv_heads, kv_heads, heads), strict=True)
    ]
    segments = jax.device_put(jnp.asarray(seg), sharder.sharding(ROW_AXES, seg.shape))
    assert not runs_on_tpu(sharder)  # CPU devices: the XLA path unless forced
    assert training_kernel(sharder, jnp.bfloat16) is None

    def fused(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        with forced_kernel(kernel):
            return attention(q, k, v, segments, sharder=sharder)

    def xla(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention(q, k, v, jnp.asarray(seg), sharder=one_device_sharder())

    with _interpreted(kernel):
        got = jax.jit(_out_and_grads, static_argnums=0)(fused, *placed)
    assert got[0].sharding.is_equivalent_to(heads, 4)
    want = jax.jit(_out_and_grads, static_argnums=0)(xla, *args)
    _assert_equal_within_bounds(seg, got, want, args, triton=kernel == "triton")


def test_a_sharded_sequence_is_refused() -> None:
    sharder = Sharder(make_mesh(data=2, fsdp=2, tensor=2), ShardingRules(seq="fsdp", batch="data"))
    q, k, v, _ = _inputs(2, jnp.float32)
    with pytest.raises(ValueError, match="'seq' is sharded"):
        kernel_attention(q, k, v, jnp.asarray(_segments()), sharder)


def test_training_loss_compiles_for_tpu_with_the_kernel() -> None:
    """`forward`'s loss and gradient, compiled on this CPU host for an abstract TPU v5e 2x2
    (data 2 x tensor 2), with no argument forcing the choice: the program's attention is the
    splash kernels' Mosaic custom calls (forward, and the backward's dK/dV and dQ), one
    program for the scan over layers. Rows of 320 tokens (not a multiple of 128: padded to
    384 for the kernel) with a window of 128; head dim 128 as in the models we train."""
    # libtpu takes a lock per host unless told that several processes may load it (compiling
    # only, no chip is touched: other test processes may be compiling at the same time)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    sharder = Sharder(make_mesh(data=2, tensor=2, devices=topology.devices))
    assert runs_on_tpu(sharder)
    cfg = dataclasses.replace(
        ModelConfig.from_hf(TINY["qwen2"]), num_heads=4, num_kv_heads=2, head_dim=128,
        dtype="bfloat16",
    )  # fmt: skip
    rows, tokens = 4, 320

    def loss(w: object, tokens_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        rows = Packed(tokens_bt, positions, segment_ids_bt, window=128)
        h = forward(w, cfg, rows, sharder=sharder).hidden
        return jnp.mean(lm_logits(w, h))

    batch = jax.ShapeDtypeStruct(
        (rows, tokens), jnp.int32, sharding=sharder.sharding(ROW_AXES, (rows, tokens))
    )
    lowered = jax.jit(jax.value_and_grad(loss)).lower(abstract_params(cfg, sharder), batch, batch)
    hlo = lowered.compile().as_text()
    call = r"%(splash_mha_\w+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\""
    kernels = re.findall(call, hlo)
    assert {re.sub(r"_(no_)?residuals$", "", k) for k in kernels} == {
        "splash_mha_fwd_segmented",
        "splash_mha_dkv_segmented",
        "splash_mha_dq_segmented",
    }


def _lowered_for_gpu(cfg: ModelConfig, sharder: Sharder, mesh: object) -> str:
    """`forward`'s loss and gradient with remat, lowered for ``mesh``'s abstract GPU."""
    rows, tokens = 2, 320

    def loss(w: object, tokens_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        rows = Packed(tokens_bt, positions, segment_ids_bt)
        h = forward(w, cfg, rows, sharder=sharder, remat=True).hidden
        return jnp.mean(lm_logits(w, h))

    batch = jax.ShapeDtypeStruct(
        (rows, tokens), jnp.int32, sharding=sharder.sharding(ROW_AXES, (rows, tokens))
    )
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(jax.value_and_grad(loss)).trace(
            abstract_params(cfg, sharder), batch, batch
        )
        return str(traced.lower(lowering_platforms=("cuda",)).as_text())


def test_training_loss_lowers_for_gpu_with_the_triton_kernel() -> None:
    """`forward`'s loss and gradient with remat, bf16, lowered on this CPU host for an abstract
    H100 (an abstract mesh of one GPU), with no argument forcing the choice: the program's
    attention is the Triton kernels' calls (the forward, again in remat's recompute, and the
    backward's preprocessing and fused dq/dk/dv), and fp32 keeps the XLA loop (no Triton
    call: the kernel's fp32 matmuls would run in TF32 on the card)."""
    card = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"), abstract_device=card)
    sharder = Sharder(mesh)
    calls = {}
    for dtype in ("bfloat16", "float32"):
        cfg = dataclasses.replace(
            ModelConfig.from_hf(TINY["qwen2"]), num_heads=4, num_kv_heads=2, head_dim=128,
            dtype=dtype,
        )  # fmt: skip
        assert training_kernel(sharder, cfg.dtype) == ("triton" if dtype == "bfloat16" else None)
        text = _lowered_for_gpu(cfg, sharder, mesh)
        calls[dtype] = sorted(re.findall(r'"(mha_\w+)"', text))
    assert calls == {
        "bfloat16": ["mha_backward", "mha_forward", "mha_forward", "mha_preprocess_backward"],
        "float32": [],
    }, calls
