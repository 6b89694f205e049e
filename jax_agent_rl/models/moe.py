"""Qwen3-MoE's sparse MLP: a router and ``E`` SwiGLU experts, of which each token uses ``k``.

Shapes: N tokens (B * T flattened), D hidden size, E experts, k = ``num_experts_per_tok``,
M = ``moe_intermediate_size``, L layers.

The math is HF's ``Qwen3MoeSparseMoeBlock``: router logits ``x @ router`` [N, E], their
softmax in fp32, the ``k`` largest probabilities and their experts; with ``norm_topk_prob``
the ``k`` probabilities are divided by their sum. The output is the gate-weighted sum of the
chosen experts' SwiGLU MLPs. No capacity limit: every token reaches all its ``k`` experts.

Compute. The N * k (token, expert) assignments are sorted by expert, so each expert's tokens
are one contiguous group, and each group is multiplied by its expert's weights (grouped
matmuls: the FLOPs of the ``k`` chosen experts, not of all ``E``); the outputs are put back in
token order and summed with the gates. On TPU the grouped matmuls are ``jax.lax.ragged_dot``
(a grouped-matmul lowering). XLA:CPU lowers ``ragged_dot`` densely (every expert on every
assignment, E times the FLOPs), so elsewhere each group is padded to whole blocks of rows and
every block multiplied by its expert's weights in one batched matmul (`_blocked_mlp`: at most
``E * (block - 1)`` padding rows; ~3x faster than ``ragged_dot`` for the tiny MoE's training
layer on CPU, docs/speed.md). Each block reads its expert's weights: with many experts and
long rows (Qwen3-30B-A3B: 128 experts, a few hundred blocks a layer) that is a few times the
experts' bytes per layer, moved but not kept. Neither path has been timed on a GPU here.

Layout. The experts' weights are stacked [L, E, ...] fields of `Layer` (``router`` [L, D, E],
``expert_gate`` / ``expert_up`` [L, E, D, M], ``expert_down`` [L, E, M, D]) so the layers stay
one uniform tree scanned by ``lax.scan``, as for the dense families. A config whose layers are
all sparse (every released Qwen3-MoE: ``mlp_only_layers`` empty, ``decoder_sparse_step`` 1)
has no dense MLP fields at all. A config that mixes the two kinds holds both weight sets in
every layer and picks the layer's kind with ``lax.cond`` (one branch runs); the set a layer
does not use is never read and never exported (a checkpoint loads it as zeros). That costs
memory only for such mixed configs, and keeps one scan, one layer body and one set of
shardings; two interleaved stacks would need a scan per run of same-kind layers.

Expert parallelism, as it compiles today: the experts are split over ``fsdp`` (their width
over ``tensor``) and GSPMD places the collectives. Compiled for a TPU (v5e:2x2, fsdp 2 x
tensor 2, the tiny MoE's training forward and gradient), each sparse layer all-gathers the
router's chosen ids of the whole fsdp group (``s32[N*k]``), assembles the group's sorted
token rows with an all-reduce (``[N*k, D]``), all-gathers its experts' weights over fsdp
(``[E, D, M/tensor]``, FSDP-style: the weights travel, not the tokens) and all-reduces the
down projection over tensor. So every fsdp device runs every expert on the whole group's
tokens: the MoE layer's compute and its sorted buffers are repeated fsdp times. What removes
that: the sort and grouped matmuls per shard (``shard_map`` over the token axes, the weights
gathered as now), or a true all-to-all of each token to its experts' owner.

Routing replay (RL): `forward` can return the experts each token chose in every sparse layer,
and take such ids instead of its own top-k; the gates are then the router's fresh
probabilities of the given experts (renormalised as ``norm_topk_prob`` says), so the gradient
still reaches the router. A token given ``NO_EXPERTS`` (-1) routes itself (its own top-k): a
rollout knows the experts of the tokens the sampler computed, not of a prompt's or a tool's.
Stored ids are compact (`expert_id_dtype`). `forward` can also return the router logits of
every sparse layer, from which `load_balancing_loss` is HF's auxiliary loss
(``router_aux_loss_coef`` in HF's config; ``algorithm.router_aux_loss_coef`` in the RL loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_agent_rl.models.config import ModelConfig

# the expert id of a token with no given experts: it routes itself
NO_EXPERTS = -1


def expert_id_dtype(num_experts: int) -> Any:
    """The narrowest signed int holding ids ``0 .. num_experts - 1`` and `NO_EXPERTS`: what a
    rollout stores per token and sparse layer (int8 up to 128 experts, Qwen3-MoE's)."""
    for dtype in (jnp.int8, jnp.int16):
        if num_experts <= jnp.iinfo(dtype).max + 1:
            return dtype
    return jnp.int32


def router_logits(router_de: jax.Array, x_nd: jax.Array) -> jax.Array:
    """The router's logits [N, E] in fp32, rounded to the model dtype first as HF's are."""
    logits_ne = jnp.einsum("nd,de->ne", x_nd, router_de, preferred_element_type=jnp.float32)
    return logits_ne.astype(x_nd.dtype).astype(jnp.float32)


def route(
    cfg: ModelConfig, logits_ne: jax.Array, given_nk: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The gates [N, k] (fp32) and experts [N, k] (int32) of each token from its router
    logits [N, E]: the router's top-k, or with ``given_nk`` those experts (a token given
    `NO_EXPERTS` takes its top-k), gated by their probabilities."""
    probs_ne = jax.nn.softmax(logits_ne, axis=-1)
    gates_nk, ids_nk = jax.lax.top_k(probs_ne, cfg.num_experts_per_tok)
    if given_nk is not None:
        given = given_nk.astype(jnp.int32)
        ids_nk = jnp.where(given[:, :1] == NO_EXPERTS, ids_nk, given)
        # a top-k token's gates are its top-k probabilities again, gathered
        gates_nk = jnp.take_along_axis(probs_ne, ids_nk, axis=-1)
    if cfg.norm_topk_prob:
        gates_nk = gates_nk / gates_nk.sum(-1, keepdims=True)
    return gates_nk, ids_nk.astype(jnp.int32)


def experts(
    lw: Any, x_nd: jax.Array, gates_nk: jax.Array, ids_nk: jax.Array, ragged: bool
) -> jax.Array:
    """The gate-weighted sum [N, D] of each token's experts, by grouped matmuls over the
    assignments sorted by expert: ``jax.lax.ragged_dot`` with ``ragged`` (TPU), else
    `_blocked_mlp`. ``lw`` holds ``expert_gate``, ``expert_up`` [E, D, M] and
    ``expert_down`` [E, M, D] (one layer's)."""
    N, k = ids_nk.shape
    E = lw.expert_gate.shape[0]
    flat = ids_nk.reshape(N * k)
    order = jnp.argsort(flat, stable=True)  # assignment j of the sorted list is order[j]
    sizes_e = jnp.bincount(flat, length=E).astype(jnp.int32)
    x_jd = x_nd[order // k]  # each assignment's token, grouped by expert
    y_jd = (_ragged_mlp if ragged else _blocked_mlp)(lw, x_jd, sizes_e)
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype))
    y_nkd = y_jd[unsort].reshape(N, k, -1)
    gates = gates_nk.astype(x_nd.dtype)
    return jnp.einsum("nkd,nk->nd", y_nkd, gates, preferred_element_type=jnp.float32).astype(
        x_nd.dtype
    )


def _swiglu(
    lw: Any, x: jax.Array, matmul: Callable[[jax.Array, jax.Array], jax.Array]
) -> jax.Array:
    """The experts' SwiGLU MLP of ``x`` by ``matmul`` (of rows and stacked expert weights)."""
    return matmul(jax.nn.silu(matmul(x, lw.expert_gate)) * matmul(x, lw.expert_up), lw.expert_down)


def _ragged_mlp(lw: Any, x_jd: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """Each sorted assignment's expert MLP [J, D], by ``ragged_dot`` over the groups of
    ``sizes_e`` [E] rows."""

    def grouped(x: jax.Array, w: jax.Array) -> jax.Array:
        y = jax.lax.ragged_dot(x, w, sizes_e, preferred_element_type=jnp.float32)
        return y.astype(x_jd.dtype)

    return _swiglu(lw, x_jd, grouped)


def block_rows(J: int, E: int) -> int:
    """Rows per block of `_blocked_mlp` for J assignments over E experts: the power of two at
    least an expert's mean share J / E, within [8, 256] (padding stays under ~J; blocks stay
    large enough for an efficient matmul)."""
    return int(min(256, max(8, 1 << max(0, J // E - 1).bit_length())))


def _blocked_mlp(lw: Any, x_jd: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """Each sorted assignment's expert MLP [J, D]: every group of ``sizes_e`` [E] rows is
    padded to whole blocks of `block_rows` rows, so each block belongs to one expert; the
    blocks are multiplied by their experts' weights in one batched matmul. The buffer holds
    every group padded (J + E * (b - 1) rows, rounded up to blocks: static); blocks past the
    last group hold zeros, are given the last expert, and are never read back."""
    J, D = x_jd.shape
    E = sizes_e.shape[0]
    b = block_rows(J, E)
    P = -(-(J + E * (b - 1)) // b) * b
    padded_e = (sizes_e + b - 1) // b * b
    ends_e = jnp.cumsum(padded_e)
    expert_j = jnp.repeat(jnp.arange(E), sizes_e, total_repeat_length=J)
    rank_j = jnp.arange(J) - (jnp.cumsum(sizes_e) - sizes_e)[expert_j]
    row_j = (ends_e - padded_e)[expert_j] + rank_j  # each assignment's row in the buffer
    first_rows = jnp.arange(P // b) * b
    expert_p = jnp.minimum(jnp.searchsorted(ends_e, first_rows, side="right"), E - 1)

    def blocks(x: jax.Array, w: jax.Array) -> jax.Array:
        y = jnp.einsum("pbd,pdm->pbm", x, w[expert_p], preferred_element_type=jnp.float32)
        return y.astype(x_jd.dtype)

    x_pbd = jnp.zeros((P, D), x_jd.dtype).at[row_j].set(x_jd).reshape(P // b, b, D)
    return _swiglu(lw, x_pbd, blocks).reshape(P, D)[row_j]


def sparse_mlp(
    cfg: ModelConfig,
    lw: Any,
    x_btd: jax.Array,
    given_btk: jax.Array | None = None,
    ragged: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's sparse MLP over [B, T, D], the experts each token used [B, T, k] and its
    router logits [B, T, E] (fp32); ``ragged``: `experts`' grouped matmuls."""
    B, T, D = x_btd.shape
    x_nd = x_btd.reshape(B * T, D)
    given = None if given_btk is None else given_btk.reshape(B * T, -1)
    logits_ne = router_logits(lw.router, x_nd)
    gates_nk, ids_nk = route(cfg, logits_ne, given)
    out = experts(lw, x_nd, gates_nk, ids_nk, ragged)
    return out.reshape(B, T, D), ids_nk.reshape(B, T, -1), logits_ne.reshape(B, T, -1)


def load_balancing_loss(cfg: ModelConfig, logits_sbte: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """The router's auxiliary load-balancing loss (Switch Transformer, eqs. 4-6), as HF's
    ``load_balancing_loss_func`` computes it for Qwen3-MoE, from the router logits of the S
    sparse layers [S, B, T, E] and the tokens HF's ``attention_mask`` covers [B, T] (1: a real
    token, 0: padding)::

        aux = E * sum_e f_e * P_e
        f_e = (assignments of real tokens to e by the top-k of every sparse layer) / (S * n)
        P_e = (sum over real tokens and sparse layers of softmax(logits)_e) / (S * n)

    with n the real tokens. ``f`` sums to k (each token makes k assignments), so perfectly
    balanced routing gives aux = k. The top-k is the router's own (what it would choose, also
    when routing replay gives the forward other experts); only ``P`` carries a gradient."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    S = logits_sbte.shape[0]
    mask = mask_bt.astype(jnp.float32)[None, :, :, None]  # [1, B, T, 1]
    probs_sbte = jax.nn.softmax(logits_sbte.astype(jnp.float32), axis=-1)
    _, ids_sbtk = jax.lax.top_k(probs_sbte, k)
    assigned_sbte = jax.nn.one_hot(ids_sbtk, E, dtype=jnp.float32).sum(-2)
    rows = S * jnp.maximum(mask.sum(), 1.0)
    f_e = (assigned_sbte * mask).sum((0, 1, 2)) / rows
    p_e = (probs_sbte * mask).sum((0, 1, 2)) / rows
    return E * jnp.sum(f_e * p_e)


def check_expert_ids(cfg: ModelConfig, ids: jax.Array, B: int, T: int) -> None:
    """``ids`` must be [sparse layers, B, T, k] of ints (a `ValueError` naming the shapes)."""
    want = (sum(cfg.moe_layers), B, T, cfg.num_experts_per_tok)
    if cfg.num_experts == 0 or not want[0]:
        raise ValueError(f"expert_ids given to a {cfg.family} model without sparse layers")
    if tuple(ids.shape) != want or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"expert_ids of shape {tuple(ids.shape)} ({ids.dtype}): expected ints of (sparse "
            f"layers, B, T, num_experts_per_tok) = {want}"
        )


def mlp_of_kind(
    cfg: ModelConfig,
    lw: Any,
    h_btd: jax.Array,
    sparse: bool | jax.Array,
    given_btk: jax.Array | None,
    dense: Callable[[Any, jax.Array], jax.Array],
    ragged: bool,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One layer's MLP over [B, T, D] (``dense`` of the layer and ``h_btd``, or `sparse_mlp`
    with ``ragged``) and its routing: the experts its tokens chose [B, T, k] and the router
    logits [B, T, E]; None in a model without sparse layers, zeros in a dense layer of one
    with. ``sparse``: the layer's kind, a traced bool in a scan over layers of both kinds
    (`lax.cond` runs one branch)."""
    if not any(cfg.moe_layers):
        return dense(lw, h_btd), None
    B, T, _ = h_btd.shape
    none = (
        jnp.zeros((B, T, cfg.num_experts_per_tok), jnp.int32),
        jnp.zeros((B, T, cfg.num_experts), jnp.float32),
    )

    def sparse_branch() -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        out, ids, logits = sparse_mlp(cfg, lw, h_btd, given_btk, ragged)
        return out, (ids, logits)

    if isinstance(sparse, bool):
        return sparse_branch() if sparse else (dense(lw, h_btd), none)
    return jax.lax.cond(sparse, sparse_branch, lambda: (dense(lw, h_btd), none))


def scan_inputs(
    cfg: ModelConfig, expert_ids: jax.Array | None
) -> tuple[jax.Array | None, jax.Array | None]:
    """For a scan over all L layers: each layer's kind [L] (None unless the kinds mix: the
    kind is then static), and the experts to replay [L, B, T, k] (None without; a dense
    layer's rows are zeros, never read)."""
    kinds = cfg.moe_layers
    mixed = any(kinds) and not all(kinds)
    if expert_ids is None:
        return (jnp.asarray(kinds) if mixed else None), None
    given = jnp.zeros((cfg.num_layers, *expert_ids.shape[1:]), jnp.int32)
    given = given.at[jnp.asarray(sparse_layers(cfg))].set(expert_ids)
    return (jnp.asarray(kinds) if mixed else None), given


def sparse_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the sparse layers."""
    return [i for i, sparse in enumerate(cfg.moe_layers) if sparse]
