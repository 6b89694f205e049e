"""The JAX inference engine, in the shape of JetStream's Engine API.

``prefill`` runs one prompt (optionally on top of an existing cached prefix) and samples its
first token; ``insert`` places the result in a decode slot; ``generate`` advances every
active slot by ``num_steps`` tokens in one device call, computing only the slots in use
(the first ones, rounded up to a power-of-two batch bucket: a decode step costs what its
batch costs, not what ``max_concurrent_decodes`` does). Each slot carries its own sampling
parameters, RNG, stop ids and budget, so requests of any mix run side by side.

Compilation is bounded: prompts pad to a fixed set of bucket lengths and attention reads a
bucketed prefix of the cache, so prefill compiles at most once per (prompt bucket, attention
bucket) pair, ``generate`` once per (attention bucket, batch bucket) pair and ``insert``
once; ``warmup`` compiles them all up front. ``compile_counts`` counts traces per
function, so a test can hold the engine to that bound. Weights are arguments, never
constants: swapping in new weights of the same shapes reuses every compiled program. Each
layer's weights and each layer's KV cache are buffers of their own (`serving_layout`,
`KVCache`), which the decode step reads and writes without copying.

With a ``sharder`` (an inference mesh, see `models.inference_mesh`), the params follow the
model's logical-axis table (heads, kv heads, MLP and vocab over ``tensor``) and the decode
state's slots split over ``data``: the KV cache is [L, N, G, S, K] with N over ``data`` and G
over ``tensor``. A prefilled prompt (one row) keeps its kv heads over ``tensor`` and is
replicated over ``data`` until ``insert`` writes it into its slot's shard.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.engine.sampling import SamplingParams, sample, sampling_logprobs, token_logprobs
from jax_agent_rl.models import (
    KVCache,
    ModelConfig,
    Sharder,
    Weights,
    cache_shardings,
    forward,
    init_cache,
    lm_logits,
    param_shardings,
    param_specs,
)
from jax_agent_rl.models.decoder import (
    cache_length,
    is_spec,
    reads_whole,
    serving_layout,
    training_layout,
)

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
    cache: KVCache  # [L, N, G, S, K]; cache.pos [N]
    slots: Slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled prompt: its cache row [L, 1, G, S, K], its slot state and first token."""

    cache: KVCache
    slots: Slots
    logprob: jax.Array  # [1] float32: the first token's logprob
    finish: jax.Array  # [1] int32: RUNNING, STOPPED or LENGTH after the first token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepTokens:
    """What ``generate`` produced, [num_steps, batch] each (the batch: the first slots);
    ``valid`` marks slots that were active."""

    token: jax.Array
    logprob: jax.Array
    valid: jax.Array
    finish: jax.Array


def _buckets(smallest: int, largest: int) -> tuple[int, ...]:
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return (*sizes, largest)


def _finish_code(slots: Slots, token: jax.Array, pos: jax.Array, max_len: int) -> jax.Array:
    """STOPPED if the token is a stop id, LENGTH if the budget or the model length is used up.

    ``pos`` counts cached tokens; the just-sampled token is not cached yet, so the sequence
    holds ``pos + 1`` tokens and may not grow past ``max_len``.
    """
    stopped = jnp.any(token[:, None] == slots.stop_ids, axis=-1)
    length = (slots.generated >= slots.max_tokens) | (pos + 1 >= max_len)
    return jnp.where(stopped, STOPPED, jnp.where(length, LENGTH, RUNNING)).astype(jnp.int32)


def _slot_axes(x: jax.Array) -> tuple[str | None, ...]:
    """A per-slot array's logical axes: the leading slot axis is the batch."""
    return ("batch",) + (None,) * (x.ndim - 1)


def _sample_step(logits_bv: jax.Array, slots: Slots) -> tuple[jax.Array, jax.Array]:
    logprobs = sampling_logprobs(logits_bv, slots.temperature, slots.top_k, slots.top_p)
    keys = jax.random.wrap_key_data(slots.key)
    token = sample(logprobs, slots.temperature == 0, keys, slots.generated)
    return token, token_logprobs(logprobs, token)


class Engine:
    """Slotted KV-cache inference over one decoder (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_concurrent_decodes: int = 32,
        max_len: int = 2048,
        min_prefill_bucket: int = 16,
        min_kv_bucket: int = 64,
        max_stop_ids: int = 8,
        batch_buckets: bool = True,
        sharder: Sharder | None = None,
    ) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        self.cfg = cfg
        self.max_concurrent_decodes = max_concurrent_decodes
        self.max_len = max_len
        self.max_stop_ids = max_stop_ids
        self.prefill_buckets = _buckets(min(min_prefill_bucket, max_len), max_len)
        # attention buckets: a cache short enough to be read whole has one
        whole = reads_whole(cache_length(max_len))
        self.kv_buckets = (max_len,) if whole else _buckets(min(min_kv_bucket, max_len), max_len)
        # decode batches: the first `rows` slots, `rows` a power of two; slots split over
        # devices (a `data` mesh axis) keep the whole batch, each device decoding its share
        n = max_concurrent_decodes
        split = sharder is not None and sharder.sharding(("batch",), (n,)).shard_shape((n,))[0] < n
        self.batch_buckets = _buckets(1, n) if batch_buckets and not split else (n,)
        # XLA:CPU writes a 16-bit cache through fp32, converting every row of it at every
        # step: there the cache is fp32 (the same numbers: bf16 values are exact in fp32)
        self.cache_dtype = jnp.float32 if jax.default_backend() == "cpu" else cfg.jnp_dtype
        self.sharder = sharder
        # one prompt row: the rows' axis cannot split over `data`, so prefill replicates it
        self._row_sharder = (
            None
            if sharder is None
            else dataclasses.replace(sharder, rules=dataclasses.replace(sharder.rules, batch=None))
        )
        # the decode state's cache and a prompt row, as laid out (building the first checks
        # that the slots and the kv heads split over their mesh axes)
        self._state_layout: KVCache | None = None
        self._row_layout: KVCache | None = None
        if sharder is not None and self._row_sharder is not None:
            self._state_layout = cache_shardings(cfg, sharder, max_concurrent_decodes, max_len)
            self._row_layout = cache_shardings(cfg, self._row_sharder, 1, max_len)
        self._empty_row: KVCache | None = None
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("kv_len",))
        self._insert = jax.jit(self._insert_impl, donate_argnames=("state",))
        self._generate = jax.jit(
            self._generate_impl,
            static_argnames=("num_steps", "kv_len", "rows"),
            donate_argnames=("state",),
        )
        self._release = jax.jit(self._release_impl, donate_argnames=("state",))
        # each layer's weights a buffer of its own, the head [D, V] (`serving_layout`)
        self._serving_layout = jax.jit(serving_layout)
        # a session's row leaves `extract` laid out exactly as an empty row, so prefilling on
        # top of it reuses the programs warm-up compiled for empty rows
        self._extract = jax.jit(self._extract_impl, out_shardings=self._row_layout)

    # ------------------------------------------------------------------------- params, state

    def load_params(self, weights: Weights) -> Weights:
        """Checks ``weights`` against the model's declaration, casts and places them in
        `serving_layout`. Takes the declared layout (a learner's) or this engine's own."""
        weights = training_layout(weights, self.cfg.tie_embeddings)
        specs = param_specs(self.cfg)
        want: Any = jax.tree.structure(specs, is_leaf=is_spec)
        got: Any = jax.tree.structure(weights)
        if got != want:
            raise ValueError(f"weights tree {got} does not match the model's {want}")
        for spec, x in zip(
            jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(weights), strict=True
        ):
            if tuple(x.shape) != spec.shape:
                raise ValueError(f"weight of shape {x.shape} where {spec.shape} is declared")
        cast = jax.tree.map(lambda x: jnp.asarray(x, self.cfg.jnp_dtype), weights)
        if self.sharder is not None:
            cast = jax.device_put(cast, param_shardings(self.cfg, self.sharder))
        return self._serving_layout(cast)

    def _lay_out(self, state: DecodeState) -> DecodeState:
        """Pins a decode state to the slot layout inside a jitted function (a no-op unsharded)."""
        if self.sharder is None:
            return state
        sharder = self.sharder
        slots = jax.tree.map(lambda x: sharder.constrain(x, _slot_axes(x)), state.slots)
        cache = jax.lax.with_sharding_constraint(state.cache, self._state_layout)
        return DecodeState(cache=cache, slots=slots)

    def _empty_slots(self, n: int) -> Slots:
        slots = Slots(
            token=jnp.zeros((n,), jnp.int32),
            active=jnp.zeros((n,), bool),
            generated=jnp.zeros((n,), jnp.int32),
            max_tokens=jnp.ones((n,), jnp.int32),
            temperature=jnp.ones((n,), jnp.float32),
            top_k=jnp.full((n,), -1, jnp.int32),
            top_p=jnp.ones((n,), jnp.float32),
            stop_ids=jnp.full((n, self.max_stop_ids), -1, jnp.int32),
            key=jnp.zeros((n, 2), jnp.uint32),
        )
        if self.sharder is None:
            return slots
        sharder = self.sharder
        return jax.tree.map(
            lambda x: jax.device_put(x, sharder.sharding(_slot_axes(x), x.shape)), slots
        )

    def init_decode_state(self) -> DecodeState:
        n = self.max_concurrent_decodes
        return DecodeState(
            cache=init_cache(self.cfg, n, self.max_len, self.sharder, self.cache_dtype),
            slots=self._empty_slots(n),
        )

    def empty_prefix_cache(self) -> KVCache:
        """The empty cache row a new prompt prefills into (allocated once: prefill never
        writes its input row in place)."""
        if self._empty_row is None:
            self._empty_row = init_cache(
                self.cfg, 1, self.max_len, self._row_sharder, self.cache_dtype
            )
        return self._empty_row

    def keep_prefix(self, row: KVCache, n: int) -> KVCache:
        """``row`` (one cached sequence) with only its first ``n`` positions live, laid out as
        rows are, so that prefilling on it reuses the compiled programs."""
        pos = jnp.array([n], jnp.int32)
        if self._row_layout is not None:
            pos = jax.device_put(pos, self._row_layout.pos)
        return KVCache(k=row.k, v=row.v, pos=pos)

    # ----------------------------------------------------------------------------- prefill

    def prefill_bucket(self, n_tokens: int) -> int:
        i = bisect.bisect_left(self.prefill_buckets, n_tokens)
        if i == len(self.prefill_buckets):
            raise ValueError(f"{n_tokens} prompt tokens exceed max_len={self.max_len}")
        return self.prefill_buckets[i]

    def prefill(
        self,
        params: Weights,
        existing_prefix: KVCache | None,
        tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
    ) -> Prefix:
        """Prefills ``tokens`` after the first ``existing_prefix.pos`` cached positions (or from
        scratch) and samples the first generated token."""
        cache = self.empty_prefix_cache() if existing_prefix is None else existing_prefix
        start = int(cache.pos[0])
        total = start + len(tokens)
        if not tokens or total >= self.max_len:
            raise ValueError(f"cannot prefill {len(tokens)} tokens after {start} cached ones")
        bucket = self.prefill_bucket(len(tokens))
        padded = np.zeros((1, bucket), np.int32)
        padded[0, : len(tokens)] = tokens
        stop = np.full((1, self.max_stop_ids), -1, np.int32)
        stop[0, : len(sampling.stop_token_ids)] = sampling.stop_token_ids
        slots = Slots(
            token=jnp.zeros((1,), jnp.int32),
            active=jnp.ones((1,), bool),
            generated=jnp.zeros((1,), jnp.int32),
            max_tokens=jnp.array([sampling.max_tokens], jnp.int32),
            temperature=jnp.array([sampling.temperature], jnp.float32),
            top_k=jnp.array([sampling.top_k], jnp.int32),
            top_p=jnp.array([sampling.top_p], jnp.float32),
            stop_ids=jnp.asarray(stop),
            key=jax.random.key_data(jax.random.key(seed))[None],
        )
        kv_len = self.kv_buckets[
            bisect.bisect_left(self.kv_buckets, min(start + bucket, self.max_len))
        ]
        return self._prefill(params, cache, jnp.asarray(padded), len(tokens), slots, kv_len=kv_len)

    def _prefill_impl(
        self,
        params: Weights,
        cache: KVCache,
        padded_bt: jax.Array,
        true_length: jax.Array,
        slots: Slots,
        kv_len: int,
    ) -> Prefix:
        self.compile_counts["prefill"] += 1  # runs at trace time only
        n = jnp.reshape(true_length, (1,)).astype(jnp.int32)
        h, cache = forward(
            params,
            self.cfg,
            padded_bt,
            sharder=self._row_sharder,
            cache=cache,
            num_new_b=n,
            kv_len=kv_len,
        )
        last = jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]
        token, logprob = _sample_step(lm_logits(params, last[:, None])[:, 0], slots)
        slots = dataclasses.replace(slots, token=token, generated=slots.generated + 1)
        finish = _finish_code(slots, token, cache.pos, self.max_len)
        return Prefix(cache=cache, slots=slots, logprob=logprob, finish=finish)

    # -------------------------------------------------------------------- insert / release

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """Places a prefilled prompt in decode slot ``slot`` (its cache row and its state)."""
        return self._insert(prefix, state, jnp.int32(slot))

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
        self.compile_counts["insert"] += 1
        c = state.cache
        cache = KVCache(
            k=tuple(
                all_.at[slot].set(one[0]) for all_, one in zip(c.k, prefix.cache.k, strict=True)
            ),
            v=tuple(
                all_.at[slot].set(one[0]) for all_, one in zip(c.v, prefix.cache.v, strict=True)
            ),
            pos=c.pos.at[slot].set(prefix.cache.pos[0]),
        )
        slots = jax.tree.map(lambda all_, one: all_.at[slot].set(one[0]), state.slots, prefix.slots)
        slots = dataclasses.replace(
            slots, active=slots.active.at[slot].set(prefix.finish[0] == RUNNING)
        )
        return self._lay_out(DecodeState(cache=cache, slots=slots))

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Deactivates a slot (finished or aborted); its cache row is simply overwritten later."""
        return self._release(state, jnp.int32(slot))

    def _release_impl(self, state: DecodeState, slot: jax.Array) -> DecodeState:
        self.compile_counts["release"] += 1
        slots = dataclasses.replace(state.slots, active=state.slots.active.at[slot].set(False))
        return self._lay_out(DecodeState(cache=state.cache, slots=slots))

    def extract(self, state: DecodeState, slot: int) -> KVCache:
        """A copy of one slot's cache row, to prefill the session's next turn on top of it."""
        return self._extract(state.cache, jnp.int32(slot))

    def _extract_impl(self, cache: KVCache, slot: jax.Array) -> KVCache:
        self.compile_counts["extract"] += 1
        take = partial(jax.lax.dynamic_slice_in_dim, start_index=slot, slice_size=1, axis=0)
        return KVCache(
            k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)), pos=cache.pos[slot][None]
        )

    # ---------------------------------------------------------------------------- generate

    def kv_bucket(self, state_max_pos: int, num_steps: int) -> int:
        need = min(state_max_pos + num_steps, self.max_len)
        return self.kv_buckets[bisect.bisect_left(self.kv_buckets, need)]

    def batch_bucket(self, slots_in_use: int) -> int:
        """The decode batch that covers slots ``0 .. slots_in_use - 1``."""
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, slots_in_use)]

    def generate(
        self,
        params: Weights,
        state: DecodeState,
        num_steps: int = 1,
        max_pos: int | None = None,
        slots_in_use: int | None = None,
    ) -> tuple[DecodeState, StepTokens]:
        """Advances every active slot ``num_steps`` tokens. ``max_pos`` (the largest cache
        position of an active slot, known to the caller) picks the attention bucket, and
        ``slots_in_use`` (one more than the highest active slot) the decode batch: the step
        computes that many slots rounded up to a batch bucket, not all of them. The tokens
        come back for the batch's slots, [num_steps, batch]."""
        kv_len = self.max_len if max_pos is None else self.kv_bucket(max_pos, num_steps)
        rows = self.batch_bucket(
            self.max_concurrent_decodes if slots_in_use is None else slots_in_use
        )
        return self._generate(params, state, num_steps=num_steps, kv_len=kv_len, rows=rows)

    def _generate_impl(
        self, params: Weights, state: DecodeState, num_steps: int, kv_len: int, rows: int
    ) -> tuple[DecodeState, StepTokens]:
        self.compile_counts["generate"] += 1

        def step(state: DecodeState, _: None) -> tuple[DecodeState, StepTokens]:
            every = state.slots
            slots = jax.tree.map(lambda x: x[:rows], every)
            active = slots.active
            h, cache = forward(
                params,
                self.cfg,
                slots.token[:, None],
                sharder=self.sharder,
                cache=state.cache,
                num_new_b=active.astype(jnp.int32),
                kv_len=kv_len,
            )
            token, logprob = _sample_step(lm_logits(params, h)[:, 0], slots)
            token = jnp.where(active, token, slots.token)
            slots = dataclasses.replace(
                slots, token=token, generated=slots.generated + active.astype(jnp.int32)
            )
            finish = jnp.where(
                active, _finish_code(slots, token, cache.pos[:rows], self.max_len), RUNNING
            )
            slots = dataclasses.replace(slots, active=active & (finish == RUNNING))
            out = StepTokens(token=token, logprob=logprob, valid=active, finish=finish)
            slots = jax.tree.map(lambda all_, part: all_.at[:rows].set(part), every, slots)
            return self._lay_out(DecodeState(cache=cache, slots=slots)), out

        return jax.lax.scan(step, state, None, length=num_steps)

    def warmup(self, params: Weights, num_steps: int) -> None:
        """Compiles every program serving can need (each prefill bucket at each attention
        length it can meet, and ``generate`` at each attention bucket), so that no request
        stalls on a compilation later: a trace holds the GIL and stalls the whole process.
        ``generate`` compiles at each (attention bucket, batch bucket) pair."""
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        state = self.init_decode_state()
        empty = self.empty_prefix_cache()
        for kv in self.kv_buckets:
            for bucket in self.prefill_buckets:
                if bucket > kv:
                    break
                start = kv - bucket  # this bucket prefilled after `start` cached tokens
                n = min(bucket, self.max_len - 1 - start)  # still lands in this bucket
                row = self.keep_prefix(empty, start)
                prefix = self.prefill(params, row, [0] * n, greedy, seed=0)
            state = self.insert(prefix, state, 0)
            for rows in self.batch_buckets:
                state, out = self.generate(
                    params, state, num_steps, max_pos=max(kv - num_steps, 0), slots_in_use=rows
                )
                jax.block_until_ready(out)
        jax.block_until_ready(self.extract(state, 0))
        self.release(state, 0)
