"""What the engine's programs carry and share: the decode state (a slot axis over every
request's sampling state, the paged KV pool, each slot's length), what prefill and generate
hand back, and the pure per-token steps (sample, finish code) both run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_agent_rl.engine.sampling import sample, sampling_logprobs, token_logprobs
from jax_agent_rl.models import KVPages, ModelConfig, Sharder

# finish codes, per slot and step
RUNNING, STOPPED, LENGTH = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Per-slot decoding state, every field with a leading slot axis [N]."""

    token: jax.Array  # int32: the last sampled token, next step's input
    active: jax.Array  # bool
    generated: jax.Array  # int32: tokens sampled so far
    max_tokens: jax.Array  # int32
    temperature: jax.Array  # float32 (0 = greedy)
    top_k: jax.Array  # int32 (<= 0 = off)
    top_p: jax.Array  # float32
    stop_ids: jax.Array  # int32 [N, max_stop_ids], -1 padded
    key: jax.Array  # uint32 [N, 2]: raw threefry key data of the request's seed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    pages: KVPages  # the pool: [G, P, page_size, K] per layer
    pos: jax.Array  # int32 [N]: tokens each slot's pages hold
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepTokens:
    """What ``generate`` produced, [num_steps, batch] each (the batch: the first slots);
    ``valid`` marks slots that were active."""

    token: jax.Array
    logprob: jax.Array
    valid: jax.Array
    finish: jax.Array


def page_bytes(cfg: ModelConfig, page_size: int, width: int) -> int:
    """Bytes of one page of the pool: keys and values of every layer, ``width`` bytes each."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * width


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


def finish_code(slots: Slots, token: jax.Array, pos: jax.Array, max_len: int) -> jax.Array:
    """STOPPED if the token is a stop id, LENGTH if the budget or the model length is used up.

    ``pos`` counts cached tokens; the just-sampled token is not cached yet, so the sequence
    holds ``pos + 1`` tokens and may not grow past ``max_len``.
    """
    stopped = jnp.any(token[:, None] == slots.stop_ids, axis=-1)
    length = (slots.generated >= slots.max_tokens) | (pos + 1 >= max_len)
    return jnp.where(stopped, STOPPED, jnp.where(length, LENGTH, RUNNING)).astype(jnp.int32)


def slot_axes(x: jax.Array) -> tuple[str | None, ...]:
    """A per-slot array's logical axes: the leading slot axis is the batch."""
    return ("batch",) + (None,) * (x.ndim - 1)


def laid_out(state: DecodeState, sharder: Sharder | None, pages: KVPages | None) -> DecodeState:
    """An abstract decode state with the engine's layout: ``pages`` (the pool's shardings),
    the slots and lengths split over ``batch``."""
    if sharder is None or pages is None:
        return state

    def at(x: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return DecodeState(
        pages=jax.tree.map(at, state.pages, pages),
        pos=at(state.pos, sharder.sharding(("batch",), state.pos.shape)),
        slots=jax.tree.map(lambda x: at(x, sharder.sharding(slot_axes(x), x.shape)), state.slots),
    )


def sample_step(logits_bv: jax.Array, slots: Slots) -> tuple[jax.Array, jax.Array]:
    """Each slot's next token under its own sampling parameters and RNG, and its logprob."""
    logprobs = sampling_logprobs(logits_bv, slots.temperature, slots.top_k, slots.top_p)
    keys = jax.random.wrap_key_data(slots.key)
    token = sample(logprobs, slots.temperature == 0, keys, slots.generated)
    return token, token_logprobs(logprobs, token)
