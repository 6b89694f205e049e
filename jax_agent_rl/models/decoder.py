"""The Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE decoder as plain functions over pytrees.

Shapes use these letters: B batch, T query tokens, S key positions, D hidden size,
H query heads, G kv heads, R = H // G query heads per kv head, K head dim, F MLP size,
V vocab, L layers, P pages of a KV pool, J (row, page) pairs, E experts, M expert MLP size.
Layers are stacked on a leading L axis and run under ``lax.scan``. Qwen3-MoE's sparse MLP
and its weights' layout are in `jax_agent_rl.models.moe`.

Every parameter is declared once, in `param_specs` (shape, logical axes, initializer); init,
shardings, checkpoint import/export and weight sync all derive from that tree. LoRA adapters
(`jax_agent_rl.models.lora`, a config's ``lora``) are layer parameters like the others
(``Layer.lora``); a projection they target adds ``s (x A) B`` to ``x W`` (`_project`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jax_agent_rl.models.attention_kernels import kernel_attention, runs_on_tpu, training_kernel
from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.contract import NO_ROUTING, Forward, Packed, Paged, Routing
from jax_agent_rl.models.lora import Adapter, LayerAdapters, lora_delta, peft_uniform
from jax_agent_rl.models.moe import check_expert_ids, mlp_of_kind, scan_inputs, sparse_layers
from jax_agent_rl.models.paged import (
    PAGE_AXES,
    KVPages,
    check_sliding_window,
    exact_attention,
    segment_positions,
)
from jax_agent_rl.models.rope import rope_inv_freq
from jax_agent_rl.models.sharding import Sharder

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical name of each dimension, and how to initialise it."""

    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]  # None: a dimension never split
    init: Initializer | None  # None: the policy initialises its tree whole (`Policy.init`)

    def initial(self, key: jax.Array, dtype: Any) -> jax.Array:
        """This parameter's initial value under ``key``."""
        assert self.init is not None, f"{self} is initialised with its policy's whole tree"
        return self.init(key, self.shape, dtype)


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
    gate: Any = None  # [L, D, F]     (a dense layer in the config)
    up: Any = None  # [L, D, F]
    down: Any = None  # [L, F, D]
    router: Any = None  # [L, D, E]   (a sparse layer in the config: `moe`)
    expert_gate: Any = None  # [L, E, D, M]
    expert_up: Any = None  # [L, E, D, M]
    expert_down: Any = None  # [L, E, M, D]
    q_bias: Any = None  # [L, H, K]      (qkv_bias)
    k_bias: Any = None  # [L, G, K]
    v_bias: Any = None  # [L, G, K]
    q_norm: Any = None  # [L, K]         (qk_norm)
    k_norm: Any = None  # [L, K]
    lora: LayerAdapters | None = None  # (a config's ``lora``) q: a [L, D, r], b [L, r, H, K]...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """A whole decoder. ``lm_head`` is ``None`` when the embeddings are tied."""

    embed: Any  # [V, D]
    layers: Layer | tuple[Layer, ...]  # stacked; one tree per layer in `serving_layout`
    final_norm: Any  # [D]
    lm_head: Any = None  # [D, V]


ATTN_BLOCK = 128  # query tokens per block, and keys per step, of (training) `attention`
# a sliding window's mask in `attention`'s loop: each token's position [B, T] (int32) and the
# window W (an int32 scalar); None without one
Sliding = tuple[jax.Array, jax.Array] | None


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
    E, M = cfg.num_experts, cfg.moe_intermediate_size
    dense, sparse = not all(cfg.moe_layers), any(cfg.moe_layers)

    def p(
        shape: tuple[int, ...], axes: tuple[str | None, ...], init: Initializer = _normal
    ) -> ParamSpec:
        return ParamSpec(shape, axes, init)

    def expert(shape: tuple[int, ...], axes: tuple[str, ...]) -> ParamSpec | None:
        return p((L, E, *shape), ("layers", "experts", *axes)) if sparse else None

    def adapter(base: ParamSpec, n_in: int) -> Adapter:
        """A [L, in..., r] (PEFT's init) and B [L, r, out...] (zeros) of ``base``'s
        [L, in..., out...]; the rank dimension is replicated (`ShardingRules.lora_rank`)."""
        assert cfg.lora is not None
        r, shape, axes = cfg.lora.rank, base.shape, base.logical_axes
        return Adapter(
            a=p((*shape[: 1 + n_in], r), (*axes[: 1 + n_in], "lora_rank"), peft_uniform),
            b=p((L, r, *shape[1 + n_in :]), ("layers", "lora_rank", *axes[1 + n_in :]), _zeros),
        )

    layers = Layer(
        attn_norm=p((L, D), ("layers", "embed"), _ones),
        q=p((L, D, H, K), ("layers", "embed", "heads", "head_dim")),
        k=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
        v=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
        o=p((L, H, K, D), ("layers", "heads", "head_dim", "embed")),
        mlp_norm=p((L, D), ("layers", "embed"), _ones),
        gate=p((L, D, F), ("layers", "embed", "mlp")) if dense else None,
        up=p((L, D, F), ("layers", "embed", "mlp")) if dense else None,
        down=p((L, F, D), ("layers", "mlp", "embed")) if dense else None,
        router=p((L, D, E), ("layers", "expert_embed", "experts")) if sparse else None,
        expert_gate=expert((D, M), ("expert_embed", "expert_mlp")),
        expert_up=expert((D, M), ("expert_embed", "expert_mlp")),
        expert_down=expert((M, D), ("expert_mlp", "expert_embed")),
        q_bias=p((L, H, K), ("layers", "heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        k_bias=p((L, G, K), ("layers", "kv_heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        v_bias=p((L, G, K), ("layers", "kv_heads", "head_dim"), _zeros) if cfg.qkv_bias else None,
        q_norm=p((L, K), ("layers", "head_dim"), _ones) if cfg.qk_norm else None,
        k_norm=p((L, K), ("layers", "head_dim"), _ones) if cfg.qk_norm else None,
    )
    if cfg.lora is not None:
        targets = {t: adapter(getattr(layers, t), 2 if t == "o" else 1) for t in cfg.lora.targets}
        layers = dataclasses.replace(layers, lora=LayerAdapters(**targets))
    return Weights(
        embed=p((V, D), ("vocab", "embed")),
        layers=layers,
        final_norm=p((D,), ("embed",), _ones),
        lm_head=None if cfg.tie_embeddings else p((D, V), ("embed", "vocab")),
    )


def is_spec(x: object) -> bool:
    return isinstance(x, ParamSpec)


def spec_shardings(specs: Any, sharder: Sharder) -> Any:
    """NamedShardings of a `ParamSpec` tree (each dimension's divisibility checked)."""
    return jax.tree.map(lambda s: sharder.sharding(s.logical_axes, s.shape), specs, is_leaf=is_spec)


def spec_structs(specs: Any, dtype: Any, sharder: Sharder) -> Any:
    """ShapeDtypeStructs of a `ParamSpec` tree in ``dtype``, laid out by ``sharder``."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
        specs,
        spec_shardings(specs, sharder),
        is_leaf=is_spec,
    )


def param_shardings(cfg: ModelConfig, sharder: Sharder) -> Weights:
    """A `Weights` tree of NamedShardings (each dimension's divisibility checked)."""
    shardings: Weights = spec_shardings(param_specs(cfg), sharder)
    return shardings


def abstract_params(cfg: ModelConfig, sharder: Sharder) -> Weights:
    """ShapeDtypeStructs for every parameter (restore and weight-sync targets)."""
    structs: Weights = spec_structs(param_specs(cfg), cfg.jnp_dtype, sharder)
    return structs


def initial_params(cfg: ModelConfig, key: jax.Array, dtype: Any) -> Weights:
    """Random weights (HF's scheme: N(0, 0.02) matrices, unit norms, zero biases), each
    parameter under its own key."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    values = [s.initial(k, dtype) for s, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, values)


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
    sharder: Sharder,
    dtype: Any = None,
) -> KVPages:
    """An empty pool of ``num_pages`` pages of ``page_size`` positions, laid out by
    ``sharder``: each part is created where it lives. Keys and values in ``dtype`` (default:
    the model's)."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    at = page_shardings(cfg, sharder, num_pages, page_size).k
    return KVPages(
        k=tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype, device=d) for d in at),
        v=tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype, device=d) for d in at),
    )


def layer_list(layers: Any) -> tuple[Any, ...]:
    """Each layer's weights on their own: ``layers`` as they are if they are a tuple already,
    else the stacked tree sliced (copies)."""
    if isinstance(layers, tuple):
        return layers
    n = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda x: x[i], layers) for i in range(n))  # noqa: B023


def stacked_layers(layers: Any) -> Any:
    """The layers as one tree stacked on a leading L axis (``layers`` itself if it is one,
    not a tuple of per-layer trees: `serving_layout`'s)."""
    if not isinstance(layers, tuple):
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


def checked_weights(cfg: ModelConfig, w: Weights) -> Weights:
    """``w`` in the declared layout (`training_layout`), its tree and every shape checked
    against `param_specs`: a `ValueError` naming the first that differs."""
    return checked_against(param_specs(cfg), training_layout(w, cfg.tie_embeddings))


def checked_against(specs: Any, w: Any) -> Any:
    """``w``, its tree and every shape checked against the `ParamSpec` tree ``specs``."""
    want: Any = jax.tree.structure(specs, is_leaf=is_spec)
    got: Any = jax.tree.structure(w)
    if got != want:
        raise ValueError(f"weights tree {got} does not match the model's {want}")
    for spec, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(w), strict=True):
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"weight of shape {x.shape} where {spec.shape} is declared")
    return w


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


def _project(cfg: ModelConfig, lw: Layer, name: str, spec: str, x: jax.Array) -> jax.Array:
    """``matmul(spec, x, W)`` of the layer's projection ``name``, plus its LoRA adapter's
    ``s (x A) B`` (`lora_delta`) where the layer carries one."""
    y = matmul(spec, x, getattr(lw, name))
    adapter = None if lw.lora is None else getattr(lw.lora, name)
    if adapter is None:
        return y
    assert cfg.lora is not None
    return y + lora_delta(spec, x, adapter, cfg.lora.scale)


def _qkv(
    cfg: ModelConfig, lw: Layer, x_btd: jax.Array, positions_bt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = _project(cfg, lw, "q", "btd,dhk->bthk", x_btd)
    k = _project(cfg, lw, "k", "btd,dgk->btgk", x_btd)
    v = _project(cfg, lw, "v", "btd,dgk->btgk", x_btd)
    if cfg.qkv_bias:
        q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
    if cfg.qk_norm:
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    return rope(q, positions_bt, inv_freq), rope(k, positions_bt, inv_freq), v


def attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    window: int | None = None,
    *,
    sharder: Sharder,
    reach_bt: jax.Array | None = None,
    positions_bt: jax.Array | None = None,
    sliding_window: Any = None,
) -> jax.Array:
    """Causal grouped-query attention within packed segments, for training; query head h
    reads kv head h // R. A token attends to the earlier-or-equal tokens of its own segment
    (segment 0 is padding, attended by none). Scores and softmax in fp32; the weights rounded
    to the values' dtype for their matmul (fp32 sums).

    The mask is computed from each key's reach: query ``q`` reads key ``k`` iff ``k <= q <
    reach[k]``. Packed segments give ``reach[k]`` = the end of ``k``'s segment (0 on padding,
    `segment_reach`); tree rows (`rl.tree`) pass ``reach_bt`` themselves: a prefix shared by
    several sequences, laid out before their continuations (depth first), reaches to the end
    of its last continuation, so each continuation reads its prefix and itself and no other
    branch. Tree rows run on this XLA path only (the fused kernels mask by segment ids).

    ``sliding_window`` W (a layer's, `paged.check_sliding_window`; None: none) keeps of that
    mask the keys less than W *positions* behind the query: ``positions[q] - positions[k] <
    W`` (HF's sliding-window causal mask), so it needs ``positions_bt``: in tree rows index
    distance is not position distance (a continuation's first token follows its prefix's
    last in position, not in index).

    Packed rows run on the fused kernel `attention_kernels.training_kernel` picks for the
    platform and dtype (splash on TPU, Pallas's Triton flash attention on GPU for 16-bit
    inputs; `attention_kernels.forced_kernel` overrides the pick), else on this XLA loop.
    With a sliding window only splash, for a static int window: its local mask counts
    indices, which within a packed segment are positions (they restart at 0 in each:
    `contract.Packed`); Triton takes no window, and a window scanned with the layers (an
    array) is not static: this XLA loop.

    Work: a loop over query blocks of `ATTN_BLOCK`, each over only the key blocks its mask
    reaches (`key_blocks`), with an online softmax: a query block reads its own sequence's
    blocks (and its prefixes'), never a packed neighbour's or a sibling branch's, so a row
    costs what its sequences cost apart, plus at most a block per sequence boundary; with a
    sliding window, not the blocks wholly further back than the window either.
    ``window`` (no sequence is longer) is the TPU kernel's bound; the mask makes it here.

    The gradient (a custom VJP) keeps only each query's softmax maximum and sum (and the
    output) and computes the scores again, block by block, for the weights ``p``:
    ``ds = p * (dp - sum(p * dp))``, ``dp = dout . v``, where ``sum(p * dp) = dout . out``.
    Autodiff would keep every step's weights for the backward pass.
    """
    windowed = check_sliding_window(sliding_window) is not None
    if windowed and positions_bt is None:
        raise ValueError(
            f"sliding_window={sliding_window!r} without positions_bt: the window counts "
            "positions, which indices are not in tree rows"
        )
    kernel = training_kernel(sharder, q_bthk.dtype) if reach_bt is None else None
    if windowed and not (kernel == "splash" and isinstance(sliding_window, int)):
        kernel = None
    if kernel is not None:
        return kernel_attention(
            q_bthk, k_btgk, v_btgk, segment_ids_bt, sharder, window, kernel, sliding_window
        )
    B, T, H, K = q_bthk.shape
    G = k_btgk.shape[2]
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a positive number of positions, or None")
    Tp = -(-T // ATTN_BLOCK) * ATTN_BLOCK
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    q = jnp.pad(q_bthk, pad).reshape(B, Tp, G, H // G, K).transpose(0, 2, 1, 3, 4)
    k_bgtk, v_bgtk = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k_btgk, v_btgk))
    reach = segment_reach(segment_ids_bt) if reach_bt is None else reach_bt
    reach = jnp.pad(reach.astype(jnp.int32), ((0, 0), (0, Tp - T)))  # padding: read by none
    sliding = None
    if windowed:
        assert positions_bt is not None
        positions = jnp.pad(positions_bt.astype(jnp.int32), ((0, 0), (0, Tp - T)))
        sliding = (positions, jnp.asarray(sliding_window, jnp.int32))
    out_bgtrk = _attention(q, k_bgtk, v_bgtk, reach, sliding)
    return out_bgtrk[:, :, :T].transpose(0, 2, 1, 3, 4).reshape(B, T, H, K)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def exact_training_attention(
    q_bthk: jax.Array,
    k_btgk: jax.Array,
    v_btgk: jax.Array,
    segment_ids_bt: jax.Array,
    page_size: int,
    window: int | None,
    sharder: Sharder,  # noqa: ARG001 (the gradient's)
    positions_bt: jax.Array | None = None,  # noqa: ARG001 (the gradient's)
    sliding_window: Any = None,
) -> jax.Array:
    """`attention` of packed segments with the numbers the engine's decode step computes for
    each token, bit for bit (`paged.exact_attention`, pages of ``page_size``; ``window``: no
    segment is longer): a model with ``exact_pages`` trains on logprobs equal to its
    sampler's. The gradient is `attention`'s (the same function up to rounding: only the
    forward must match the sampler).

    ``sliding_window``: a layer's window (`attention`'s), in positions counted from each
    segment's start as the forward's pages count them: ``positions_bt`` are the rows' (they
    restart at 0 in each segment, `contract.Packed`), or None to count them from the segment
    ids (`paged.segment_positions`). Neither has a gradient."""
    return exact_attention(
        q_bthk, k_btgk, v_btgk, segment_ids_bt, page_size, window, sliding_window=sliding_window
    )


def _exact_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: jax.Array,
    page_size: int,
    window: int | None,
    sharder: Sharder,  # noqa: ARG001 (the gradient's)
    positions: jax.Array | None,
    sliding_window: Any,
) -> tuple[jax.Array, tuple[Any, ...]]:
    out = exact_attention(q, k, v, seg, page_size, window, sliding_window=sliding_window)
    return out, (q, k, v, seg, positions, sliding_window)


def _exact_bwd(
    page_size: int,  # noqa: ARG001 (the forward's)
    window: int | None,
    sharder: Sharder,
    res: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array | None, ...]:
    q, k, v, seg, positions, sliding_window = res
    if sliding_window is not None and positions is None:
        positions = segment_positions(seg)

    def training(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention(
            q, k, v, seg, window, sharder=sharder, positions_bt=positions,
            sliding_window=sliding_window,
        )  # fmt: skip

    _, pull = jax.vjp(training, q, k, v)
    return (*pull(g), None, None, None)


exact_training_attention.defvjp(_exact_fwd, _exact_bwd)


def segment_reach(segment_ids_bt: jax.Array) -> jax.Array:
    """[B, T] int32: one past the last position of each token's segment (its segment's
    tokens read it), 0 on padding (segment 0: read by none). Segments are contiguous runs."""
    B, T = segment_ids_bt.shape
    ends = jnp.concatenate(
        [segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1], jnp.ones((B, 1), bool)], axis=1
    )
    end_bt = jnp.where(ends, jnp.arange(1, T + 1, dtype=jnp.int32), T)
    reach = jax.lax.cummin(end_bt, axis=1, reverse=True)
    return jnp.where(segment_ids_bt > 0, reach, 0)


def key_blocks(reach_bt: jax.Array, sliding: Sliding = None) -> tuple[jax.Array, jax.Array]:
    """The key blocks each query block of `attention` reads, T a multiple of `ATTN_BLOCK`:
    [B, Q, Q] block indices, for row b and query block i those it reads first in
    increasing order, and [B, Q] how many. Block j (j <= i) is read when some key in it
    reaches past the query block's first position (a key of an earlier sequence, or of a
    sibling branch, reaches no further than that sequence's end): a query block reads its
    own sequence's (and prefixes') blocks, never a neighbour's.

    With ``sliding`` (the positions [B, T] and the window W) not the blocks whose keys lie
    W or more positions behind every query of the block either. Only the pairs the reach
    allows count: block i's queries some key of block j reaches, block j's keys that reach
    into block i (so the first queries of a sequence, at positions from 0, do not make a
    query block read the whole sequence before theirs)."""
    B, T = reach_bt.shape
    n = ATTN_BLOCK
    blocks = jnp.arange(T // n)
    reach_bj = reach_bt.reshape(B, T // n, n).max(-1)
    read_bij = (blocks[None, None, :] <= blocks[None, :, None]) & (
        reach_bj[:, None, :] > blocks[None, :, None] * n
    )
    if sliding is not None:
        positions_bjn, window = sliding[0].reshape(B, T // n, n), sliding[1]
        far = 1 << 29  # past every position, and the difference of two still an int32
        index_in = (blocks[:, None] * n + jnp.arange(n))[None, :, None, :]  # [1, i, 1, n]
        first_bij = jnp.where(
            index_in < reach_bj[:, None, :, None], positions_bjn[:, :, None, :], far
        ).min(-1)
        reaching = reach_bt.reshape(B, 1, T // n, n) > (blocks * n)[None, :, None, None]
        last_bij = jnp.where(reaching, positions_bjn[:, None], -far).max(-1)
        read_bij &= first_bij - last_bij < window
    order = jnp.argsort(~read_bij, axis=-1, stable=True).astype(jnp.int32)
    return order, read_bij.sum(-1, dtype=jnp.int32)


def _block_of(x: jax.Array, first_b: jax.Array, axis: int) -> jax.Array:
    """Row b's ``ATTN_BLOCK`` entries from ``first_b[b]`` along ``axis`` (of the row)."""
    take = lambda x, f: jax.lax.dynamic_slice_in_dim(x, f, ATTN_BLOCK, axis=axis)  # noqa: E731
    if x.shape[0] == 1:  # a single row: a slice, not a gather
        return take(x[0], first_b[0])[None]
    return jax.vmap(take)(x, first_b)


def _add_block(x: jax.Array, x_j: jax.Array, first_b: jax.Array) -> jax.Array:
    """``x`` [B, G, T, K] with ``x_j`` [B, G, n, K] added at each row's ``first_b``."""

    def add(x: jax.Array, x_j: jax.Array, f: jax.Array) -> jax.Array:
        x_j = x_j + jax.lax.dynamic_slice_in_dim(x, f, ATTN_BLOCK, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(x, x_j, f, axis=1)

    if x.shape[0] == 1:
        return add(x[0], x_j[0], first_b[0])[None]
    return jax.vmap(add)(x, x_j, first_b)


def _block_scores(
    q_bgqk: jax.Array,
    k_bgck: jax.Array,
    reach_bc: jax.Array,
    start: jax.Array,
    first_b: jax.Array,
    live_b: jax.Array,
    sliding: Sliding,
) -> jax.Array:
    """Scaled scores [B, G, n * R, n] (fp32) of the query block at ``start`` (its n R query
    rows ``q_bgqk``, [B, G, n * R, K]) over each row's key block at ``first_b`` (its keys
    ``k_bgck`` and their reach), -inf where masked (all of it in rows not ``live_b``; with
    ``sliding``, the positions [B, T] and the window W, where the query's position is W or
    more past the key's)."""
    B, G, nR, K = q_bgqk.shape
    n = ATTN_BLOCK
    scores = jnp.einsum("bgqk,bgck->bgqc", q_bgqk, k_bgck, preferred_element_type=jnp.float32)
    q_n = start + jnp.arange(n)
    k_bc = first_b[:, None] + jnp.arange(n)
    mask_bnc = (
        (k_bc[:, None, :] <= q_n[None, :, None])
        & (q_n[None, :, None] < reach_bc[:, None, :])
        & live_b[:, None, None]
    )
    if sliding is not None:
        positions_bt, window = sliding
        query_bn = jax.lax.dynamic_slice_in_dim(positions_bt, start, n, axis=1)
        key_bc = _block_of(positions_bt, first_b, 0)
        mask_bnc &= query_bn[:, :, None] - key_bc[:, None, :] < window
    scores = scores.reshape(B, G, n, nR // n, n)
    scores = jnp.where(mask_bnc[:, None, :, None], scores * (K**-0.5), -jnp.inf)
    return scores.reshape(B, G, nR, n)


# the running maximum's start: below every score, so a query that sees no key keeps a finite
# maximum and weights exp(-inf - top) = 0
_NO_SCORE = -1e30


@jax.custom_vjp
def _attention(
    q_bgtrk: jax.Array,
    k_bgtk: jax.Array,
    v_bgtk: jax.Array,
    reach_bt: jax.Array,
    sliding: Sliding,
) -> jax.Array:
    """`attention` in the layout it computes in, T a multiple of `ATTN_BLOCK`: out [B, G, T,
    R, K]. ``sliding`` (no gradient, as ``reach_bt``): a sliding window's positions and W."""
    return _attention_fwd(q_bgtrk, k_bgtk, v_bgtk, reach_bt, sliding)[0]


def _attention_fwd(
    q_bgtrk: jax.Array,
    k_bgtk: jax.Array,
    v_bgtk: jax.Array,
    reach_bt: jax.Array,
    sliding: Sliding,
) -> tuple[jax.Array, tuple[Any, ...]]:
    B, G, T, R, K = q_bgtrk.shape
    n = ATTN_BLOCK
    order, count = key_blocks(reach_bt, sliding)

    def query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out_bgtrk, top_bgtr, total_bgtr = carry
        start = i * n
        q_i = jax.lax.dynamic_slice_in_dim(q_bgtrk, start, n, axis=2).reshape(B, G, n * R, K)

        def key_block(step: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            top, total, out = acc  # [B, G, n * R] (fp32), and out [B, G, n * R, K]
            first_b = order[:, i, step] * n
            k_j, v_j = (_block_of(x, first_b, 1) for x in (k_bgtk, v_bgtk))
            live_b = step < count[:, i]
            scores = _block_scores(
                q_i, k_j, _block_of(reach_bt, first_b, 0), start, first_b, live_b, sliding
            )
            new_top = jnp.maximum(top, scores.max(-1))
            rescale = jnp.exp(top - new_top)
            weights = jnp.exp(scores - new_top[..., None])
            out_j = jnp.einsum(
                "bgqc,bgck->bgqk",
                weights.astype(v_bgtk.dtype),
                v_j,
                preferred_element_type=jnp.float32,
            )
            return new_top, total * rescale + weights.sum(-1), out * rescale[..., None] + out_j

        rows = (jnp.full((B, G, n * R), _NO_SCORE), jnp.zeros((B, G, n * R)))
        start_acc = (*rows, jnp.zeros((B, G, n * R, K)))
        top, total, out = jax.lax.fori_loop(0, count[:, i].max(), key_block, start_acc)
        total = jnp.where(total > 0, total, 1.0)  # a query that sees no key: out 0
        out = (out / total[..., None]).reshape(B, G, n, R, K)

        def put(x: jax.Array, x_i: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_slice_in_dim(x, x_i, start, axis=2)

        return (
            put(out_bgtrk, out),
            put(top_bgtr, top.reshape(B, G, n, R)),
            put(total_bgtr, total.reshape(B, G, n, R)),
        )

    rows = (jnp.zeros((B, G, T, R)), jnp.zeros((B, G, T, R)))
    out, top, total = jax.lax.fori_loop(0, T // n, query_block, (jnp.zeros((B, G, T, R, K)), *rows))
    res = (q_bgtrk, k_bgtk, v_bgtk, reach_bt, sliding, out, top, total)
    return out.astype(q_bgtrk.dtype), res


def _attention_bwd(
    res: tuple[Any, ...], dout_bgtrk: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, None, None]:
    q, k, v, reach_bt, sliding, out, top, total = res
    B, G, T, R, K = q.shape
    n = ATTN_BLOCK
    order, count = key_blocks(reach_bt, sliding)
    # sum_s p_s dp_s = dout . sum_s p_s v_s = dout . out, per query [B, G, T, R]
    dout_dot_out = jnp.einsum("bgtrk,bgtrk->bgtr", dout_bgtrk.astype(jnp.float32), out)

    def query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dq, dk, dv = carry  # fp32
        start = i * n

        def rows(x: jax.Array) -> jax.Array:
            """The query block's rows of ``x`` [B, G, T, R, ...], as [B, G, n * R, ...]."""
            x_i = jax.lax.dynamic_slice_in_dim(x, start, n, axis=2)
            return x_i.reshape(B, G, n * R, *x.shape[4:])

        q_i, dout_i = rows(q), rows(dout_bgtrk)
        top_i, total_i, dot_i = rows(top), rows(total), rows(dout_dot_out)

        def key_block(step: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq_i, dk, dv = acc
            first_b = order[:, i, step] * n
            k_j, v_j = (_block_of(x, first_b, 1) for x in (k, v))
            live_b = step < count[:, i]
            scores = _block_scores(
                q_i, k_j, _block_of(reach_bt, first_b, 0), start, first_b, live_b, sliding
            )
            probs = jnp.exp(scores - top_i[..., None]) / total_i[..., None]
            dprobs = jnp.einsum("bgqk,bgck->bgqc", dout_i, v_j, preferred_element_type=jnp.float32)
            dscores = (probs * (dprobs - dot_i[..., None]) * (K**-0.5)).astype(q.dtype)
            dq_i = dq_i + jnp.einsum(
                "bgqc,bgck->bgqk", dscores, k_j, preferred_element_type=jnp.float32
            )
            dk_j = jnp.einsum("bgqc,bgqk->bgck", dscores, q_i, preferred_element_type=jnp.float32)
            p_j = probs.astype(v.dtype)
            dv_j = jnp.einsum("bgqc,bgqk->bgck", p_j, dout_i, preferred_element_type=jnp.float32)
            return dq_i, _add_block(dk, dk_j, first_b), _add_block(dv, dv_j, first_b)

        start_acc = (jnp.zeros((B, G, n * R, K)), dk, dv)
        dq_i, dk, dv = jax.lax.fori_loop(0, count[:, i].max(), key_block, start_acc)
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i.reshape(B, G, n, R, K), start, axis=2)
        return dq, dk, dv

    zeros = (jnp.zeros(q.shape), jnp.zeros(k.shape), jnp.zeros(v.shape))
    dq, dk, dv = jax.lax.fori_loop(0, T // n, query_block, zeros)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _mlp(cfg: ModelConfig, lw: Layer, x_btd: jax.Array) -> jax.Array:
    """SwiGLU over the tokens flattened to N = B * T rows: the same numbers as over [B, T, D],
    and on XLA:CPU the weight gradients' matmuls then read the activations' gradients as they
    are (with B and T apart, each [B, T, F] one was first copied transposed, slowly)."""
    B, T, D = x_btd.shape
    x_nd = x_btd.reshape(B * T, D)
    gate = _project(cfg, lw, "gate", "nd,df->nf", x_nd)
    up = _project(cfg, lw, "up", "nd,df->nf", x_nd)
    return _project(cfg, lw, "down", "nf,fd->nd", jax.nn.silu(gate) * up).reshape(B, T, D)


def _attend(
    cfg: ModelConfig,
    lw: Layer,
    x_btd: jax.Array,
    positions_bt: jax.Array,
    attn: Callable[..., jax.Array],
) -> jax.Array:
    """``x_btd`` plus the layer's attention: ``attn`` of the queries [B, T, H, K] and the
    chunk's keys and values [B, T, G, K]."""
    with jax.named_scope("attention"):
        h = rms_norm(x_btd, lw.attn_norm, cfg.rms_norm_eps)
        q, k, v = _qkv(cfg, lw, h, positions_bt)
        return x_btd + _project(cfg, lw, "o", "bthk,hkd->btd", attn(q, k, v))


def _mlp_block(
    cfg: ModelConfig,
    sharder: Sharder,
    lw: Layer,
    x_btd: jax.Array,
    sparse: bool | jax.Array,
    given_btk: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """``x_btd`` plus the layer's MLP, and its routing (experts, router logits: `mlp_of_kind`)."""
    with jax.named_scope("mlp"):
        h = rms_norm(x_btd, lw.mlp_norm, cfg.rms_norm_eps)
        out, routing = mlp_of_kind(
            cfg, lw, h, sparse, given_btk, partial(_mlp, cfg), runs_on_tpu(sharder)
        )
    return sharder.constrain(x_btd + out, ("batch", "seq", "act_embed")), routing


# ---------------------------------------------------------------------------------- forward


def forward(
    w: Weights,
    cfg: ModelConfig,
    rows: Packed | Paged,
    *,
    sharder: Sharder,
    remat: bool = False,
    routing: Routing = NO_ROUTING,
) -> Forward:
    """The decoder over ``rows`` (`contract`): the final hidden states [B, T, D]
    (`lm_logits` gives logits), with `Paged` rows the updated pages, and the ``routing``
    asked for (Qwen3-MoE: `moe`; a model without sparse layers is refused any).

    `Packed` rows (training) run the layers under ``lax.scan`` over stacked weights (a tuple
    of layers is stacked first). `Paged` rows run them one after another in Python, each
    reading and writing its own pool buffer in place (weights as `serving_layout` lays them
    out are read without copies too); a chunk of T > 1 tokens reads ``pages_read`` pages a
    row (`paged_attention`), T = 1 each row's own pages (`ragged_attention`, or the
    platform's kernel), and ``rows`` one ragged step (`paged.RaggedStep`)."""
    B, T = rows.tokens.shape
    kinds = cfg.moe_layers
    if routing.replay is not None:
        check_expert_ids(cfg, routing.replay, B, T)
    if routing.asked and not any(kinds):
        raise ValueError(f"routing asked of a {cfg.family} model without sparse layers")
    x = sharder.constrain(w.embed[rows.tokens], ("batch", "seq", "act_embed"))
    if isinstance(rows, Paged):
        if routing.router_logits:
            raise ValueError("router logits are for the training forward (Packed rows)")
        return _forward_paged(w, cfg, x, sharder, rows, routing)
    if cfg.exact_pages and rows.reach is not None:
        raise ValueError("tree rows (reach) with exact_pages: exact logprobs read segments")
    mlp = partial(_mlp_block, cfg, sharder)
    packed = rows
    # per layer: its weights, its kind where the layers mix both, the experts to replay
    xs = (stacked_layers(w.layers), *scan_inputs(cfg, routing.replay))

    def layer(x_btd: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, Any]:
        lw, sparse, given = xs

        def attn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            if cfg.exact_pages:
                return exact_training_attention(
                    q, k, v, packed.segments, cfg.exact_pages, packed.window, sharder
                )
            return attention(
                q, k, v, packed.segments, packed.window, sharder=sharder, reach_bt=packed.reach
            )

        x_btd = _attend(cfg, lw, x_btd, packed.positions, attn)
        return mlp(lw, x_btd, any(kinds) if sparse is None else sparse, given)

    body = jax.checkpoint(layer) if remat else layer
    x, routed = jax.lax.scan(body, x, xs)
    h_btd = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
    if not (routing.record or routing.router_logits):
        return Forward(h_btd)
    assert routed is not None
    sparse_rows = jnp.asarray(sparse_layers(cfg))
    ids_all, logits_all = routed
    return Forward(
        h_btd,
        expert_ids=ids_all[sparse_rows] if routing.record else None,
        router_logits=logits_all[sparse_rows] if routing.router_logits else None,
    )


def _forward_paged(
    w: Weights, cfg: ModelConfig, x: jax.Array, sharder: Sharder, rows: Paged, routing: Routing
) -> Forward:
    """`forward` of `Paged` rows, from their embedded tokens ``x`` [B, T, D]."""
    kinds = cfg.moe_layers
    mlp = partial(_mlp_block, cfg, sharder)
    # with pages: layer by layer in Python, each reading and writing its own pool buffer
    page_size = rows.cache.k[0].shape[2]
    if cfg.exact_pages and page_size != cfg.exact_pages:
        raise ValueError(
            f"pages of {page_size} positions for a model whose exact logprobs read pages of "
            f"{cfg.exact_pages} (exact_pages): its training forward would not match"
        )
    chunk = rows.attention(sharder, exact=bool(cfg.exact_pages))
    chosen: list[jax.Array | None] = []  # the experts of each sparse layer
    given = list(routing.replay) if routing.replay is not None else []
    for i, lw in enumerate(layer_list(w.layers)):
        paged = partial(chunk.attend, i)
        replay = given[len(chosen)] if given and kinds[i] else None
        x, routed = mlp(lw, _attend(cfg, lw, x, chunk.positions, paged), kinds[i], replay)
        chosen += [routed[0]] if routed is not None and kinds[i] else []
    h_btd = rms_norm(x, w.final_norm, cfg.rms_norm_eps)
    pages = KVPages(k=chunk.k, v=chunk.v)
    if routing.record:
        return Forward(h_btd, pages, jnp.stack([ids for ids in chosen if ids is not None]))
    return Forward(h_btd, pages)


def lm_logits(w: Weights, h_btd: jax.Array) -> jax.Array:
    """Logits [B, T, V] in fp32 (the tied embedding when there is no separate head)."""
    if w.lm_head is None:
        return jnp.einsum("btd,vd->btv", h_btd, w.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", h_btd, w.lm_head, preferred_element_type=jnp.float32)
