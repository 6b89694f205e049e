"""The Llama 3 / Qwen2 / Qwen3 decoder as plain functions over pytrees.

Shapes use these letters: B batch, T query tokens, S key positions, D hidden size,
H query heads, G kv heads, R = H // G query heads per kv head, K head dim, F MLP size,
V vocab, L layers, P pages of a KV pool, J (row, page) pairs. Layers are stacked on a
leading L axis and run under ``lax.scan``.

Every parameter is declared once, in `param_specs` (shape, logical axes, initializer); init,
shardings, checkpoint import/export and weight sync all derive from that tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, overload

import jax
import jax.numpy as jnp

from jax_agent_rl.models.attention_kernels import pallas_attention, runs_on_tpu
from jax_agent_rl.models.config import ModelConfig, rope_inv_freq
from jax_agent_rl.models.paged import PAGE_AXES, decode_steps, paged_attention
from jax_agent_rl.models.sharding import Sharder

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical name of each dimension, and how to initialise it."""

    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    init: Initializer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """All decoder layers' weights, stacked on a leading L axis. Optional parts are ``None``."""

    attn_norm: Any  # [L, D]
    q: Any  # [L, D, H, K]
    k: Any  # [L, D, G, K]
    v: Any  # [L, D, G, K]
    o: Any  # [L, H, K, D]
    mlp_norm: Any  # [L, D]
    gate: Any  # [L, D, F]
    up: Any  # [L, D, F]
    down: Any  # [L, F, D]
    q_bias: Any = None  # [L, H, K]      (qkv_bias)
    k_bias: Any = None  # [L, G, K]
    v_bias: Any = None  # [L, G, K]
    q_norm: Any = None  # [L, K]         (qk_norm)
    k_norm: Any = None  # [L, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """A whole decoder. ``lm_head`` is ``None`` when the embeddings are tied."""

    embed: Any  # [V, D]
    layers: Layer | tuple[Layer, ...]  # stacked; one tree per layer in `serving_layout`
    final_norm: Any  # [D]
    lm_head: Any = None  # [D, V]


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


ATTN_BLOCK = 128  # query tokens per block of (training) `attention`


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _ones(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def _zeros(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def param_specs(cfg: ModelConfig) -> Weights:
    """The declaration of every parameter (a `Weights` tree whose leaves are `ParamSpec`)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def p(shape: tuple[int, ...], axes: tuple[str, ...], init: Initializer = _normal) -> ParamSpec:
        return ParamSpec(shape, axes, init)

    layers = Layer(
        attn_norm=p((L, D), ("layers", "embed"), _ones),
        q=p((L, D, H, K), ("layers", "embed", "heads", "head_dim")),
        k=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
        v=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
        o=p((L, H, K, D), ("layers", "heads", "head_dim", "embed")),
        mlp_norm=p((L, D), ("layers", "embed"), _ones),
        gate=p((L, D, F), ("layers", "embed", "mlp")),
        up=p((L, D, F), ("layers", "embed", "mlp")),
        down=p((L, F, D), ("layers", "mlp", "embed")),
        q_bias=p((L, H, K), ("layers", "heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        k_bias=p((L, G, K), ("layers", "kv_heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        v_bias=p((L, G, K), ("layers", "kv_heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        q_norm=p((L, K), ("layers", "head_dim"), _ones) if cfg.qk_norm else None,
        k_norm=p((L, K), ("layers", "head_dim"), _ones) if cfg.qk_norm else None,
    )
    return Weights(
        embed=p((V, D), ("vocab", "embed")),
        layers=layers,
        final_norm=p((D,), ("embed",), _ones),
        lm_head=None if cfg.tie_embeddings else p((D, V), ("embed", "vocab")),
    )


def is_spec(x: object) -> bool:
    return isinstance(x, ParamSpec)


def param_shardings(cfg: ModelConfig, sharder: Sharder) -> Weights:
    """A `Weights` tree of NamedShardings (each dimension's divisibility checked)."""
    return jax.tree.map(
        lambda s: sharder.sharding(s.logical_axes, s.shape), param_specs(cfg), is_leaf=is_spec
    )


def abstract_params(cfg: ModelConfig, sharder: Sharder | None = None) -> Weights:
    """ShapeDtypeStructs for every parameter (restore and weight-sync targets)."""
    specs = param_specs(cfg)
    shardings = jax.tree.map(lambda _: None, specs, is_leaf=is_spec)
    if sharder is not None:
        shardings = param_shardings(cfg, sharder)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, cfg.jnp_dtype, sharding=sh),
        specs,
        shardings,
        is_leaf=is_spec,
    )


def init_params(key: jax.Array, cfg: ModelConfig, sharder: Sharder | None = None) -> Weights:
    """Random weights (HF's scheme: N(0, 0.02) matrices, unit norms, zero biases)."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    @partial(jax.jit, out_shardings=None if sharder is None else param_shardings(cfg, sharder))
    def init(keys: jax.Array) -> Weights:
        return jax.tree.unflatten(
            treedef, [s.init(k, s.shape, cfg.jnp_dtype) for s, k in zip(leaves, keys, strict=True)]
        )

    return init(keys)


def page_shardings(cfg: ModelConfig, sharder: Sharder, num_pages: int, page_size: int) -> KVPages:
    """A `KVPages` of NamedShardings for a pool of ``num_pages`` pages (divisibility of the
    pages over ``batch``'s mesh axes and of the kv heads over theirs checked)."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    kv = (sharder.sharding(PAGE_AXES, shape),) * cfg.num_layers
    return KVPages(k=kv, v=kv)


def init_pages(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    sharder: Sharder | None = None,
    dtype: Any = None,
) -> KVPages:
    """An empty pool of ``num_pages`` pages of ``page_size`` positions, laid out by
    ``sharder``: each part is created where it lives. Keys and values in ``dtype`` (default:
    the model's)."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    at: tuple[Any, ...] = (None,) * cfg.num_layers
    if sharder is not None:
        at = page_shardings(cfg, sharder, num_pages, page_size).k
    return KVPages(
        k=tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype, device=d) for d in at),
        v=tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype, device=d) for d in at),
    )


def layer_list(layers: Layer | tuple[Layer, ...]) -> tuple[Layer, ...]:
    """Each layer's weights on their own: ``layers`` as they are if they are a tuple already,
    else the stacked tree sliced (copies)."""
    if isinstance(layers, tuple):
        return layers
    n = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda x: x[i], layers) for i in range(n))  # noqa: B023


def stacked_layers(layers: Layer | tuple[Layer, ...]) -> Layer:
    """The layers as one tree stacked on a leading L axis (``layers`` itself if it is one)."""
    if isinstance(layers, Layer):
        return layers
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def serving_layout(w: Weights) -> Weights:
    """``w`` laid out for decoding (the engine's): the layers as a tuple of per-layer trees,
    each leaf a buffer of its own (a cached `forward` reads them without copying), and a tied
    embedding's head as a [D, V] copy (the head's matmul then reads the weight in the order
    it is stored; contracting the embedding's minor axis re-packed all of it every step)."""
    head = w.embed.T if w.lm_head is None else w.lm_head
    return dataclasses.replace(w, layers=layer_list(w.layers), lm_head=head)


def training_layout(w: Weights, tie_embeddings: bool) -> Weights:
    """``w`` back in the declared layout (`param_specs`) from `serving_layout`; ``w`` itself
    if its layers are stacked already."""
    if isinstance(w.layers, Layer):
        return w
    return dataclasses.replace(
        w, layers=stacked_layers(w.layers), lm_head=None if tie_embeddings else w.lm_head
    )


# ----------------------------------------------------------------------------------- blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``w * x / sqrt(mean(x^2) + eps)``, the statistics in fp32, the scale in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` accumulated and returned in fp32, then rounded once to ``x``'s
    dtype. The same numbers as a plain einsum up to that one rounding, and for bf16 the
    fast path of every backend: XLA:CPU runs bf16 x bf16 -> fp32 natively but converts both
    operands of a bf16 -> bf16 matmul to fp32 first (each weight, at every step)."""
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rope(x_btnk: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, HF's half-split convention: ``x * cos + rotate_half(x) * sin``."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, K/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x_btnk.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x_btnk.dtype)
    x1, x2 = jnp.split(x_btnk, 2, axis=-1)
    return x_btnk * cos + jnp.concatenate([-x2, x1], -1) * sin


def _qkv(
    cfg: ModelConfig, lw: Layer, x_btd: jax.Array, positions_bt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = matmul("btd,dhk->bthk", x_btd, lw.q)
    k = matmul("btd,dgk->btgk", x_btd, lw.k)
    v = matmul("btd,dgk->btgk", x_btd, lw.v)
    if cfg.qkv_bias:
        q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
    if cfg.qk_norm:
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    return rope(q, positions_bt, inv_freq), rope(k, positions_bt, inv_freq), v


def attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int | None = None,
    sharder: Sharder | None = None,
    *,
    kernel: bool | None = None,
) -> jax.Array:
    """Causal grouped-query attention within packed segments, for training; query head h
    reads kv head h // R. A token attends to the earlier-or-equal tokens of its own segment
    (segment 0 is padding, attended by none). Scores and softmax in fp32.

    On TPU (the ``sharder``'s mesh devices', else the default backend's) the Pallas TPU
    kernel computes it (`pallas_attention`, each device on its rows and heads); elsewhere
    the XLA computation below. ``kernel`` forces the choice (True: the kernel, which off TPU
    runs only in Pallas's TPU interpret mode).

    Queries go in blocks of `ATTN_BLOCK` tokens, each over the keys up to its last token only:
    the blocks above the diagonal, all masked, are never computed (about half the work of a
    dense T x T attention). ``window`` (static; a row's sequences are all at most this long):
    a block reads only the keys of its last ``window`` positions before its first query, so
    rows packed with short sequences cost attention by their sequences' lengths, not the
    row's. Each block's scores are one batched matmul of (b, g) [R * n, K] x
    [K, S] (the R query heads of a kv head side by side), a layout XLA:CPU runs without
    transposing the scores. A query whose row is all masked (padding) gets uniform weights
    over its block's keys, never NaN; no other token reads it.

    The gradient (a custom VJP) keeps only each row's softmax maximum and sum and computes the
    scores again, block by block, for the weights ``p`` (the same numbers as the forward's):
    ``ds = p * (dp - sum(p * dp))``, ``dp = dout . v``. Autodiff kept every layer's weights,
    fp32 and rounded, for the backward pass (gigabytes at 8 x 512 tokens, written and read
    once each).
    """
    use_kernel = runs_on_tpu(sharder) if kernel is None else kernel
    if use_kernel:
        return pallas_attention(q_bthk, k_btgk, v_btgk, segment_ids_bt, sharder, window)
    B, T, H, K = q_bthk.shape
    G = k_btgk.shape[2]
    q = q_bthk.reshape(B, T, G, H // G, K).transpose(0, 2, 1, 3, 4)  # [B, G, T, R, K]
    k_bgtk, v_bgtk = k_btgk.transpose(0, 2, 1, 3), v_btgk.transpose(0, 2, 1, 3)
    out = _attention(q, k_bgtk, v_bgtk, segment_ids_bt, window or T)
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, H, K)


def _attention_blocks(T: int, window: int) -> list[tuple[int, int, int]]:
    """Query blocks (start, end, first): queries start .. end - 1 see keys first .. end - 1 at
    most (``window`` before ``start``)."""
    return [
        (start, min(start + ATTN_BLOCK, T), max(0, start - window + 1))
        for start in range(0, T, ATTN_BLOCK)
    ]


def _block_scores(
    q_bgtrk: jax.Array,
    k_bgtk: jax.Array,
    segment_ids_bt: jax.Array,
    start: int,
    end: int,
    first: int,
) -> jax.Array:
    """Scaled scores [B, G, n, R, end - first] (fp32) of queries start .. end - 1 over keys
    first .. end - 1; -1e30 if masked."""
    B, G, _, R, K = q_bgtrk.shape
    n, s = end - start, end - first
    q_i = q_bgtrk[:, :, start:end].reshape(B, G, n * R, K)
    scores = jnp.einsum(
        "bgqk,bgsk->bgqs", q_i, k_bgtk[:, :, first:end], preferred_element_type=jnp.float32
    ).reshape(B, G, n, R, s)
    seg_q, seg_k = segment_ids_bt[:, start:end, None], segment_ids_bt[:, None, first:end]
    causal_ns = jnp.arange(start, end)[:, None] >= jnp.arange(first, end)[None, :]
    mask_bns = causal_ns[None] & (seg_q == seg_k) & (seg_k != 0)
    return jnp.where(mask_bns[:, None, :, None], scores * (K**-0.5), -1e30)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(
    q_bgtrk: jax.Array,
    k_bgtk: jax.Array,
    v_bgtk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int,
) -> jax.Array:
    """`attention` in the layout it computes in: out [B, G, T, R, K]."""
    return _attention_fwd(q_bgtrk, k_bgtk, v_bgtk, segment_ids_bt, window)[0]


def _attention_fwd(
    q_bgtrk: jax.Array,
    k_bgtk: jax.Array,
    v_bgtk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    B, G, T, R, K = q_bgtrk.shape
    outs, tops, totals = [], [], []
    for start, end, first in _attention_blocks(T, window):
        n = end - start
        scores = _block_scores(q_bgtrk, k_bgtk, segment_ids_bt, start, end, first)
        top = scores.max(-1, keepdims=True)  # the softmax as `jax.nn.softmax` computes it
        unnormalized = jnp.exp(scores - top)
        total = unnormalized.sum(-1, keepdims=True)
        probs = (unnormalized / total).astype(v_bgtk.dtype).reshape(B, G, n * R, end - first)
        out = jnp.einsum("bgqs,bgsk->bgqk", probs, v_bgtk[:, :, first:end])
        outs.append(out.reshape(B, G, n, R, K))
        tops.append(top)
        totals.append(total)
    res = (q_bgtrk, k_bgtk, v_bgtk, segment_ids_bt, jnp.concatenate(tops, 2))
    return jnp.concatenate(outs, axis=2), (*res, jnp.concatenate(totals, 2))


def _attention_bwd(
    window: int, res: tuple[jax.Array, ...], dout_bgtrk: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    q, k, v, segment_ids_bt, top, total = res
    B, G, T, R, K = q.shape
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for start, end, first in _attention_blocks(T, window):
        n, s = end - start, end - first
        scores = _block_scores(q, k, segment_ids_bt, start, end, first)
        probs = jnp.exp(scores - top[:, :, start:end]) / total[:, :, start:end]
        dout = dout_bgtrk[:, :, start:end].reshape(B, G, n * R, K)
        dprobs = jnp.einsum(
            "bgqk,bgsk->bgqs", dout, v[:, :, first:end], preferred_element_type=jnp.float32
        ).reshape(B, G, n, R, s)
        dscores = probs * (dprobs - (probs * dprobs).sum(-1, keepdims=True)) * (K**-0.5)
        dscores = dscores.astype(q.dtype).reshape(B, G, n * R, s)
        dq = jnp.einsum(
            "bgqs,bgsk->bgqk", dscores, k[:, :, first:end], preferred_element_type=jnp.float32
        )
        dq_blocks.append(dq.reshape(B, G, n, R, K))
        q_i = q[:, :, start:end].reshape(B, G, n * R, K)
        dk_i = jnp.einsum("bgqs,bgqk->bgsk", dscores, q_i, preferred_element_type=jnp.float32)
        p_i = probs.astype(v.dtype).reshape(B, G, n * R, s)
        dv_i = jnp.einsum("bgqs,bgqk->bgsk", p_i, dout, preferred_element_type=jnp.float32)
        dk = dk.at[:, :, first:end].add(dk_i)
        dv = dv.at[:, :, first:end].add(dv_i)
    dq_all = jnp.concatenate(dq_blocks, axis=2).astype(q.dtype)
    return dq_all, dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _mlp(lw: Layer, x_btd: jax.Array) -> jax.Array:
    """SwiGLU over the tokens flattened to N = B * T rows: the same numbers as over [B, T, D],
    and on XLA:CPU the weight gradients' matmuls then read the activations' gradients as they
    are (with B and T apart, each [B, T, F] one was first copied transposed, slowly)."""
    B, T, D = x_btd.shape
    x_nd = x_btd.reshape(B * T, D)
    gate = matmul("nd,df->nf", x_nd, lw.gate)
    up = matmul("nd,df->nf", x_nd, lw.up)
    return matmul("nf,fd->nd", jax.nn.silu(gate) * up, lw.down).reshape(B, T, D)


def _constrain(sharder: Sharder | None, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return x if sharder is None else sharder.constrain(x, axes)


# ---------------------------------------------------------------------------------- forward


@overload
def forward(
    w: Weights,
    cfg: ModelConfig,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    segment_ids_bt: jax.Array,
    sharder: Sharder | None = None,
    remat: bool = False,
    *,
    cache: None = None,
    window: int | None = None,
) -> jax.Array: ...


@overload
def forward(
    w: Weights,
    cfg: ModelConfig,
    tokens_bt: jax.Array,
    positions_bt: None = None,
    segment_ids_bt: None = None,
    sharder: Sharder | None = None,
    remat: bool = False,
    *,
    cache: KVPages,
    page_table_bm: jax.Array,
    pos_b: jax.Array,
    num_new_b: jax.Array,
    pages_read: int | None = None,
    decode_kernel: str = "ragged",
) -> tuple[jax.Array, KVPages]: ...


def forward(
    w: Weights,
    cfg: ModelConfig,
    tokens_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    sharder: Sharder | None = None,
    remat: bool = False,
    *,
    cache: KVPages | None = None,
    page_table_bm: jax.Array | None = None,
    pos_b: jax.Array | None = None,
    num_new_b: jax.Array | None = None,
    pages_read: int | None = None,
    decode_kernel: str = "ragged",
    window: int | None = None,
) -> jax.Array | tuple[jax.Array, KVPages]:
    """The decoder over a chunk of tokens; returns final hidden [B, T, D] (`lm_logits` gives
    logits), and with a ``cache`` the updated pages too.

    Without a cache (training): whole, possibly packed, sequences. ``segment_ids`` number the
    sequences packed in a row (0 marks padding): a token attends to earlier-or-equal tokens of
    its own segment. ``positions`` restart at 0 in every segment. ``window`` (static): no
    sequence is longer (`attention` then reads fewer keys).

    With a cache (prefill and decode): row b's pages are ``page_table[b]`` and it holds
    ``pos[b]`` tokens already; its chunk's tokens take positions ``pos[b] + t`` and attend to
    the row's earlier positions plus the chunk's own earlier tokens. Only the row's first
    ``num_new[b]`` tokens are real (their keys and values are written into its pages); the
    rest of its T are padding, written nowhere (a row of none is idle). The caller advances
    ``pos``. ``pages_read`` (static, chunks of T > 1 tokens: prefill): the pages each row
    reads, a bucket that covers its positions (`paged_attention`). A chunk of T = 1 (decode)
    reads each row's own pages only (`ragged_attention`, or with ``decode_kernel`` "pallas" the
    TPU kernel, `pallas_paged_attention`).

    Without a cache the layers run under ``lax.scan`` over stacked weights (a tuple of layers
    is stacked first); with one, one after another in Python, each reading and writing its
    own pool buffer in place (weights as `serving_layout` lays them out are read without
    copies too).
    """
    B, T = tokens_bt.shape
    x = _constrain(sharder, w.embed[tokens_bt], ("batch", "seq", "act_embed"))

    def attend(
        lw: Layer, x_btd: jax.Array, positions_bt: jax.Array, attn: Callable[..., jax.Array]
    ) -> jax.Array:
        """``x_btd`` plus the layer's attention: ``attn`` of the queries [B, T, H, K] and the
        chunk's keys and values [B, T, G, K]."""
        with jax.named_scope("attention"):
            h = rms_norm(x_btd, lw.attn_norm, cfg.rms_norm_eps)
            q, k, v = _qkv(cfg, lw, h, positions_bt)
            return x_btd + matmul("bthk,hkd->btd", attn(q, k, v), lw.o)

    def mlp(lw: Layer, x_btd: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            x_btd = x_btd + _mlp(lw, rms_norm(x_btd, lw.mlp_norm, cfg.rms_norm_eps))
        return _constrain(sharder, x_btd, ("batch", "seq", "act_embed"))

    if cache is None:
        if positions_bt is None or segment_ids_bt is None:
            raise ValueError("forward without a cache needs positions and segment ids")
        train_positions, train_segments = positions_bt, segment_ids_bt

        def layer(x_btd: jax.Array, lw: Layer) -> tuple[jax.Array, None]:
            def attn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
                return attention(q, k, v, train_segments, window, sharder)

            return mlp(lw, attend(lw, x_btd, train_positions, attn)), None

        body = jax.checkpoint(layer) if remat else layer
        x, _ = jax.lax.scan(body, x, stacked_layers(w.layers))
        return rms_norm(x, w.final_norm, cfg.rms_norm_eps)

    # with pages: layer by layer in Python, each reading and writing its own pool buffer
    if page_table_bm is None or pos_b is None or num_new_b is None:
        raise ValueError("forward with a cache needs page_table_bm, pos_b and num_new_b")
    if T > 1 and pages_read is None:
        raise ValueError("a prefill chunk (T > 1) needs pages_read")
    if decode_kernel not in ("ragged", "pallas"):
        raise ValueError(f"decode_kernel={decode_kernel!r}: of 'ragged', 'pallas'")
    _, P, ps, _ = cache.k[0].shape
    M = page_table_bm.shape[1]
    cache_positions = pos_b[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rows_bt = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    page_bt = page_table_bm[rows_bt, jnp.minimum(cache_positions // ps, M - 1)]
    # a chunk's padding (and an inactive row's token) is written nowhere: page P is dropped
    page_bt = jnp.where(jnp.arange(T)[None, :] < num_new_b[:, None], page_bt, P)
    offset_bt = cache_positions % ps
    # decode (T = 1): each shard of the rows reads and writes its own pages only
    make_tables, decode_layer = decode_steps(sharder, P, ps, decode_kernel)
    active_b = num_new_b > 0
    tables = make_tables(page_table_bm, pos_b, active_b) if T == 1 else None
    new_k, new_v = [], []
    for lw, ck, cv in zip(layer_list(w.layers), cache.k, cache.v, strict=True):

        def paged(
            q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array = ck, cv: jax.Array = cv
        ) -> jax.Array:
            if tables is not None:
                out, ck, cv = decode_layer(
                    q[:, 0], k[:, 0], v[:, 0], ck, cv, tables, pos_b, active_b
                )
                new_k.append(ck)
                new_v.append(cv)
                return out[:, None]
            # the chunk's keys and values go into their pages first, then attention reads
            # them (the update is [G, B, T, K], split by the page and offset indices)
            k_gbtk, v_gbtk = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
            ck = ck.at[:, page_bt, offset_bt].set(k_gbtk.astype(ck.dtype), mode="drop")
            cv = cv.at[:, page_bt, offset_bt].set(v_gbtk.astype(cv.dtype), mode="drop")
            new_k.append(ck)
            new_v.append(cv)
            assert pages_read is not None
            return paged_attention(q, ck, cv, page_table_bm, pos_b, pages_read)

        x = mlp(lw, attend(lw, x, cache_positions, paged))
    h_btd = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
    return h_btd, KVPages(k=tuple(new_k), v=tuple(new_v))


def lm_logits(w: Weights, h_btd: jax.Array) -> jax.Array:
    """Logits [B, T, V] in fp32 (the tied embedding when there is no separate head)."""
    if w.lm_head is None:
        return jnp.einsum("btd,vd->btv", h_btd, w.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", h_btd, w.lm_head, preferred_element_type=jnp.float32)
