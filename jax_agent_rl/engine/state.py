"""What the engine's programs carry and share: the decode state (a slot axis over every
request's sampling state, the paged KV pool, each slot's length), what prefill and generate
hand back, and the pure per-token steps (sample, finish code) both run.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.engine.sampling import sample, sampling_logprobs, token_logprobs
from jax_agent_rl.models import (
    Forward,
    KVPages,
    ModelConfig,
    Paged,
    Policy,
    Routing,
    Sharder,
    Weights,
    page_shardings,
)
from jax_agent_rl.models.attention_kernels import platform_of
from jax_agent_rl.models.moe import expert_id_dtype
from jax_agent_rl.protocol import SamplingParams

# finish codes, per slot and step
RUNNING, STOPPED, LENGTH = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Per-slot decoding state, every field with a leading slot axis [N]: arrays, or their
    ShapeDtypeStructs (`abstract_decode_state`)."""

    token: Any  # int32: the last sampled token, next step's input
    active: Any  # bool
    generated: Any  # int32: tokens sampled so far
    max_tokens: Any  # int32
    temperature: Any  # float32 (0 = greedy)
    top_k: Any  # int32 (<= 0 = off)
    top_p: Any  # float32
    stop_ids: Any  # int32 [N, max_stop_ids], -1 padded
    key: Any  # uint32 [N, 2]: raw threefry key data of the request's seed


# an idle slot's state, field by field: what a row that decodes nothing reads (its sampling
# switched off: a zero top_p would make every step sort the vocabulary for the filters)
IDLE = Slots(
    token=0,
    active=False,
    generated=0,
    max_tokens=1,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    stop_ids=-1,
    key=0,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Arrays, or their ShapeDtypeStructs (`abstract_decode_state`)."""

    pages: KVPages  # the pool: [G, P, page_size, K] per layer
    pos: Any  # int32 [N]: tokens each slot's pages hold
    slots: Slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled sequence (its keys and values are in its pages): its slot state, how many
    positions its pages hold, its first token's logprob and finish code, [1] each."""

    slots: Slots
    pos: jax.Array  # int32
    logprob: jax.Array  # float32
    finish: jax.Array  # int32: RUNNING, STOPPED or LENGTH after the first token
    # a MoE model's: the experts [1, sparse layers, k] of the position that sampled the first
    # token (the chunk's last), `expert_id_dtype`; None for a dense model
    experts: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepTokens:
    """What ``generate`` produced, [num_steps, batch] each (the batch: the rows of
    `Engine.decode_rows`, whose slots ``slot`` [batch] names); ``valid`` marks rows that were
    active. A MoE model's ``experts`` [num_steps, batch, sparse
    layers, k] (`expert_id_dtype`) are those of the position each token was sampled from
    (the step's input, the token before it); None for a dense model."""

    token: jax.Array
    logprob: jax.Array
    valid: jax.Array
    finish: jax.Array
    experts: Any = None
    slot: Any = None  # int32 [batch]: each row's slot


def paged_forward(
    policy: Policy, params: Weights, rows: Paged, sharder: Sharder
) -> tuple[jax.Array, KVPages, jax.Array | None]:
    """``policy``'s forward of ``rows``: final hidden, pages, and the experts [sparse layers,
    B, T, k] a policy with experts chose (`expert_id_dtype`; None for one that does not)."""
    experts = policy.experts
    if experts is None:
        out = policy.forward(params, rows, sharder=sharder)
        return out.hidden, _pages(out), None
    out = policy.forward(params, rows, sharder=sharder, routing=Routing(record=True))
    assert out.expert_ids is not None
    return out.hidden, _pages(out), out.expert_ids.astype(expert_id_dtype(experts.count))


def _pages(out: Forward) -> KVPages:
    assert out.cache is not None, "a forward of Paged rows returns its pages"
    return out.cache


def page_bytes(cfg: ModelConfig, page_size: int, width: int) -> int:
    """Bytes of one page of the pool: keys and values of every layer, ``width`` bytes each."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * width


def compile_platform(sharder: Sharder) -> str:
    """The platform the engine's programs compile for: the sharder's devices' (a mesh of
    abstract TPU devices compiles for TPU on any host; `attention_kernels.platform_of`)."""
    return platform_of(sharder)


def cache_dtype(cfg: ModelConfig, platform: str) -> Any:
    """The pool's dtype on ``platform``: the model's, but fp32 on XLA:CPU, which writes a
    16-bit cache through fp32, converting every page of it at every step (the same numbers:
    bf16 values are exact in fp32)."""
    return jnp.float32 if platform == "cpu" else cfg.jnp_dtype


def pool_pages(
    cfg: ModelConfig, page_size: int, width: int, kv_cache_gib: float, slots: int, max_len: int
) -> int:
    """The pool's pages: as many as ``kv_cache_gib`` holds, or (0) as many as ``slots``
    sequences of ``max_len`` tokens need."""
    if kv_cache_gib > 0:
        return int(kv_cache_gib * 2**30 // page_bytes(cfg, page_size, width))
    return slots * -(-max_len // page_size)


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two times ``smallest`` below ``largest``, then ``largest``."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return (*sizes, largest)


def step_buckets(
    max_step_tokens: int, slots_per_shard: int, smallest: int, batch_buckets: bool
) -> tuple[int, ...]:
    """The row counts a ragged step computes on each shard: powers of two times ``smallest``
    up to ``max_step_tokens`` (or, without batch buckets, always ``max_step_tokens``), which
    must hold every decoding slot of a shard."""
    if max_step_tokens < max(slots_per_shard, smallest):
        raise ValueError(
            f"max_step_tokens={max_step_tokens} is fewer than the "
            f"{max(slots_per_shard, smallest)} rows a shard decodes in one step"
        )
    return buckets(smallest, max_step_tokens) if batch_buckets else (max_step_tokens,)


def finish_code(slots: Slots, token: jax.Array, pos: jax.Array, max_len: int) -> jax.Array:
    """STOPPED if the token is a stop id, LENGTH if the budget or the model length is used up.

    ``pos`` counts cached tokens; the just-sampled token is not cached yet, so the sequence
    holds ``pos + 1`` tokens and may not grow past ``max_len``.
    """
    stopped = jnp.any(token[:, None] == slots.stop_ids, axis=-1)
    length = (slots.generated >= slots.max_tokens) | (pos + 1 >= max_len)
    return jnp.where(stopped, STOPPED, jnp.where(length, LENGTH, RUNNING)).astype(jnp.int32)


def check_shards(table_bm: np.ndarray, slots_per_shard: int, shard_pages: int) -> None:
    """Raises unless each row (slot) b of the page tables names pages of its shard only:
    ``b // slots_per_shard``, whose pages are ``shard_pages`` from ``shard * shard_pages``."""
    shard_bm = table_bm // shard_pages
    wrong = np.argwhere(shard_bm != np.arange(len(table_bm))[:, None] // slots_per_shard)
    if len(wrong):
        slot, i = wrong[0]
        raise ValueError(
            f"slot {slot} (shard {slot // slots_per_shard}) names page {table_bm[slot, i]}, "
            f"not one of its shard's {shard_pages} pages"
        )


def decode_rows(
    active: Collection[int],
    slots_in_use: int | None,
    batch_buckets: Sequence[int],
    slots: int,
) -> np.ndarray:
    """The slots a decode call computes, row by row [batch]: the first slots, the batch
    bucket that covers the highest active one (and ``slots_in_use``); or, where the active
    slots are scattered so that a smaller bucket holds them all, the active slots in order,
    then idle ones as padding (sharded slots have one bucket, all of them: they keep their
    rows)."""

    def bucket(n: int) -> int:
        return batch_buckets[bisect.bisect_left(batch_buckets, n)]

    covered = bucket(max(max(active, default=0) + 1, slots_in_use or 0))
    rows = bucket(max(len(active), slots_in_use or 0, 1))
    if rows == covered:
        return np.arange(covered, dtype=np.int32)
    busy = sorted(active)
    taken = set(busy)
    idle = (s for s in range(slots) if s not in taken)
    return np.array([*busy, *itertools.islice(idle, rows - len(busy))], np.int32)


def row_access(
    slot_b: jax.Array, gather: bool
) -> tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array, jax.Array], jax.Array]]:
    """How a decode step reads the rows ``slot_b`` [batch] of a per-slot array [N, ...] and
    writes them back: by gathering those slots, or (``gather`` false: sharded slots, whose
    rows are the first ones, `decode_rows`) by slicing the first rows, which keeps each
    shard's rows on it (a gather by index would cross shards)."""
    rows = slot_b.shape[0]
    if gather:
        return (lambda x: x[slot_b]), (lambda every, part: every.at[slot_b].set(part))
    return (lambda x: x[:rows]), (lambda every, part: every.at[:rows].set(part))


def slot_axes(ndim: int) -> tuple[str | None, ...]:
    """A per-slot array's logical axes (``ndim`` of them): the leading slot axis is the
    batch."""
    return ("batch",) + (None,) * (ndim - 1)


def sample_step(logits_bv: jax.Array, slots: Slots) -> tuple[jax.Array, jax.Array]:
    """Each slot's next token under its own sampling parameters and RNG, and its logprob."""
    logprobs = sampling_logprobs(logits_bv, slots.temperature, slots.top_k, slots.top_p)
    keys = jax.random.wrap_key_data(slots.key)
    token = sample(logprobs, slots.temperature == 0, keys, slots.generated)
    return token, token_logprobs(logprobs, token)


def abstract_decode_state(
    cfg: ModelConfig,
    slots: int,
    max_stop_ids: int,
    num_pages: int,
    page_size: int,
    dtype: Any,
    sharder: Sharder,
) -> DecodeState:
    """ShapeDtypeStructs of the decode state of ``slots`` slots and a pool of ``num_pages``
    pages in ``dtype``, laid out by ``sharder`` (slots over the batch, pages by
    `page_shardings`)."""
    # each slot field's (dtype, shape after the slot axis)
    fields = Slots(
        token=(jnp.int32, ()),
        active=(jnp.bool_, ()),
        generated=(jnp.int32, ()),
        max_tokens=(jnp.int32, ()),
        temperature=(jnp.float32, ()),
        top_k=(jnp.int32, ()),
        top_p=(jnp.float32, ()),
        stop_ids=(jnp.int32, (max_stop_ids,)),
        key=(jnp.uint32, (2,)),  # raw threefry key data
    )
    layout = page_shardings(cfg, sharder, num_pages, page_size)
    pages = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    def per_slot(field: tuple[Any, tuple[int, ...]]) -> jax.ShapeDtypeStruct:
        shape = (slots, *field[1])
        at = sharder.sharding(slot_axes(len(shape)), shape)
        return jax.ShapeDtypeStruct(shape, field[0], sharding=at)

    return DecodeState(
        pages=jax.tree.map(
            lambda at: jax.ShapeDtypeStruct(pages, dtype, sharding=at),
            layout,
            is_leaf=lambda x: x is None,
        ),
        pos=per_slot((jnp.int32, ())),
        slots=jax.tree.map(per_slot, fields, is_leaf=lambda x: isinstance(x, tuple)),
    )


def empty_decode_state(abstract: DecodeState) -> DecodeState:
    """The decode state ``abstract`` describes, every slot idle and the pool zeros, each part
    created where it lives."""

    def full(x: jax.ShapeDtypeStruct, value: Any = 0) -> jax.Array:
        return jnp.full(x.shape, value, x.dtype, device=x.sharding)

    return DecodeState(
        pages=jax.tree.map(full, abstract.pages),
        pos=full(abstract.pos),
        slots=jax.tree.map(full, abstract.slots, IDLE),
    )


@dataclasses.dataclass(frozen=True)
class StepChunk:
    """One sequence's share of a ragged step (`Engine.step`): in slot ``slot``, whose pages
    hold ``start`` positions already, the new ``tokens`` at positions ``start ..`` (a prompt's
    chunk), or none: a decode row, the slot's last sampled token at position ``start``. A
    decode row samples its next token; a chunk samples only where ``first`` is given (it ends
    its prompt): the request's sampling parameters, RNG seed and the tokens it sampled before
    (a preempted request computed again goes on with its stream and budget)."""

    slot: int
    start: int
    tokens: Sequence[int] = ()
    first: tuple[SamplingParams, int, int] | None = None  # (sampling, seed, generated)

    @property
    def size(self) -> int:
        """The token rows it takes."""
        return len(self.tokens) or 1

    @property
    def samples(self) -> bool:
        return not self.tokens or self.first is not None
