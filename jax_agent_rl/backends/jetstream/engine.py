"""This project's JAX `Engine` behind JetStream's ``engine_api.Engine``, for JetStream's own
orchestrator (``Driver``) and gRPC server to serve. Imported only under ``.venv-jetstream``.

Our engine already has JetStream's shape (prefill / insert / generate over decode slots); what
the adapter adds is what JetStream 0.2.2's interface leaves out:

- ``prefill`` receives the padded prompt and its true length, nothing about the request. So
  the sampling (temperature, top-k, top-p) and the stop ids are the server's, fixed at start,
  and each prompt's RNG seed is drawn from the server's seeded generator. The request's
  budget, ``max_tokens``, is JetStream's to enforce: its detokenizer completes a request whose
  length passes it. A slot stops by itself at a stop id or at the model length.
- Our engine's prefill writes into the decode state's KV pages, which JetStream's
  ``prefill`` does not receive: here ``prefill`` keeps the prompt and its seed, and
  ``insert`` (which has the decode state) gives the slot pages from the adapter's
  `PagePool` and prefills into them, in chunks if the prompt is long; a slot's pages are
  freed when it finishes or its slot is taken again. Prefill and generate run interleaved
  on one engine anyway (see ``get_prefix_destination_sharding``).
- Our prefill samples the first token. Each ``generate`` emits ``steps`` tokens per slot: the
  token still pending from before, then ``steps - 1`` of the ``steps`` it samples (the last
  becomes pending), each ``valid`` where the slot produced it. A stop token is emitted (the
  rollout protocol returns it) and then the slot's tokens are invalid, which is what ends a
  request in JetStream's detokenizer. Its tokenizer therefore has no stop tokens of its own
  (JetStream drops a stop token instead of returning it).
- The params the driver passes back are a `LiveParams` holder: `LiveParams.swap` puts new
  weights of the same shapes in it, so nothing compiles again.
"""

# ruff: noqa: ARG002 - JetStream's interface fixes these signatures; not every argument is used
from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from jax_agent_rl.engine import DecodeState, Engine
from jax_agent_rl.engine.pages import PagePool
from jax_agent_rl.models import Weights
from jax_agent_rl.protocol import SamplingParams

# JetStream pads prompts to one of these lengths; its largest bucket must be one of them
_JETSTREAM_BUCKETS = tuple(2**k for k in range(4, 16))


class LiveParams:
    """The weights being served. The driver holds this object; `swap` changes what it holds."""

    def __init__(self, weights: Weights) -> None:
        self._lock = threading.Lock()
        self._weights = weights

    @property
    def current(self) -> Weights:
        with self._lock:
            return self._weights

    def swap(self, weights: Weights) -> None:
        with self._lock:
            self._weights = weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prompt to prefill at ``insert`` (its tokens [n] int32) and its RNG seed."""

    tokens: jax.Array | np.ndarray
    seed: int = dataclasses.field(metadata=dict(static=True))

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotsState:
    """Our decode state, and per slot whether it holds a sampled token not yet emitted."""

    state: DecodeState
    pending: jax.Array  # bool [N]


class TokenIds(tokenizer_api.Tokenizer):
    """The server takes and returns token ids only (the client tokenizes): nothing to encode,
    and no stop tokens of JetStream's own (see the module docstring)."""

    def encode(self, s: str, **kwargs: Any) -> tuple[np.ndarray, int]:
        raise ValueError("this server takes token ids, not text")

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return ""

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return -1

    @property
    def bos_id(self) -> int:
        return 0

    @property
    def stop_tokens(self) -> set[int]:
        return set()


def max_prefill_length(max_len: int) -> int:
    """JetStream's largest prompt bucket for a model length: the smallest of its buckets that
    holds the longest prompt (``max_len - 1`` tokens)."""
    for bucket in _JETSTREAM_BUCKETS:
        if bucket >= max_len - 1:
            return bucket
    raise ValueError(f"max_len={max_len} is beyond JetStream's prompt buckets")


class JetStreamEngine(engine_api.Engine):
    """`Engine` in JetStream's interface (see the module docstring). ``sampling`` holds the
    server's temperature, top-k, top-p and stop ids (its ``max_tokens`` is ignored)."""

    def __init__(
        self, engine: Engine, params: LiveParams, sampling: SamplingParams, steps: int, seed: int
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps={steps}: must be at least 1")
        self.engine = engine
        self.params = params
        # our slots stop at a stop id or the model length; JetStream enforces max_tokens
        self.sampling = dataclasses.replace(sampling, max_tokens=engine.max_len)
        self.steps = steps
        self._rng = random.Random(seed)
        self._mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        # host view of the slots: cached length of each active one, refreshed from the last
        # generate's output (which JetStream copies to the host anyway)
        self._lengths: dict[int, int] = {}
        self._pool = PagePool(engine.num_pages, engine.shards)
        self._pages: dict[int, list[int]] = {}  # each slot's pages
        self._table = engine.page_table([[]] * engine.max_concurrent_decodes)
        self._fresh: set[int] = set()  # slots inserted since the last generate
        self._last: jax.Array | None = None
        s = steps
        self._tokens_idx, self._valid_idx, self._length_idx = (0, s), (s, 2 * s), (2 * s, 2 * s + 1)
        self._active_col, self._pos_col = 2 * s + 1, 2 * s + 2
        self._columns = 2 * s + 3
        self._mark = jax.jit(lambda pending, slot: pending.at[slot].set(True))
        self._snapshot = jax.jit(lambda st: (st.slots.token, st.slots.generated))
        self._pack = jax.jit(self._pack_impl)

    # ------------------------------------------------------------------ the Engine interface

    def load_params(self, *args: Any, **kwargs: Any) -> LiveParams:
        return self.params

    def get_prefix_destination_sharding(self) -> Any:
        return None  # one engine serves prefill and generate (interleaved): nothing moves

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenIds:
        return TokenIds()

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return max_prefill_length(self.engine.max_len)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    def init_decode_state(self, *args: Any, **kwargs: Any) -> SlotsState:
        n = self.engine.max_concurrent_decodes
        self._lengths.clear()
        for slot in list(self._pages):
            self._pool.release(self._pages.pop(slot))
        self._fresh.clear()
        self._last = None
        return SlotsState(self.engine.init_decode_state(), jnp.zeros((n,), bool))

    def prefill(
        self,
        *,
        params: LiveParams,
        existing_prefix: Prefilled | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
    ) -> Prefilled:
        if existing_prefix is not None:
            raise ValueError("prefilling on top of a cached prefix is not served here")
        tokens = np.asarray(padded_tokens)[:true_length].astype(np.int32)
        return Prefilled(tokens, self._rng.getrandbits(31))

    def insert(self, prefix: Prefilled, decode_state: SlotsState, slot: int) -> SlotsState:
        engine, tokens = self.engine, [int(t) for t in np.asarray(prefix.tokens)]
        self._free(slot)
        need = engine.pages_for(min(len(tokens) + self.steps, engine.max_len))
        pages = self._pool.take(need, engine.slot_shard(slot))  # of the slot's shard
        if pages is None:  # every slot holds at most a whole sequence's pages: never
            raise RuntimeError("the KV page pool is exhausted")
        state = decode_state.state
        for start in range(0, len(tokens), engine.prefill_chunk):
            chunk = tokens[start : start + engine.prefill_chunk]
            state, prefilled = engine.prefill(
                self.params.current, state, pages, start, chunk, self.sampling, prefix.seed
            )
        state = engine.insert(prefilled, state, slot)
        self._pages[slot] = pages
        self._table[slot, : len(pages)] = pages
        self._lengths[slot] = prefix.length
        self._fresh.add(slot)
        return SlotsState(state, self._mark(decode_state.pending, jnp.int32(slot)))

    def generate(
        self, params: LiveParams, decode_state: SlotsState
    ) -> tuple[SlotsState, engine_api.ResultTokens]:
        self._refresh()
        self._grow()
        first, generated = self._snapshot(decode_state.state)
        state, out = self.engine.generate(
            params.current,
            decode_state.state,
            self._table,
            self._lengths.keys(),
            self.steps,
            slots_in_use=self.engine.max_concurrent_decodes,  # `_pack` reads every slot
        )
        data, pending = self._pack(first, generated, decode_state.pending, out, state)
        self._last = data
        self._fresh.clear()
        for slot in self._lengths:  # an upper bound until the next refresh
            self._lengths[slot] += self.steps
        result = engine_api.ResultTokens(
            data=data,
            tokens_idx=self._tokens_idx,
            valid_idx=self._valid_idx,
            length_idx=self._length_idx,
            samples_per_slot=1,
        )
        return SlotsState(state, pending), result

    def warmup(self) -> None:
        """Compiles the adapter's own programs (the engine's are compiled by its warmup): one
        prompt through prefill, insert and generate; then the slots start empty again."""
        state = self.init_decode_state()
        prefix = self.prefill(
            params=self.params, padded_tokens=np.zeros(1, np.int32), true_length=1
        )
        state, result = self.generate(self.params, self.insert(prefix, state, 0))
        np.asarray(result.data)
        self.init_decode_state()

    # ------------------------------------------------------------------ internals

    def _refresh(self) -> None:
        """Keeps the lengths of the slots the last generate left active (its output is on
        the host by now, or nearly: JetStream's detokenizer waits for it too)."""
        if self._last is None:
            return
        data = np.asarray(self._last)
        self._last = None
        for slot in list(self._lengths):
            if slot in self._fresh:  # its row in the last output belongs to the slot's past
                continue
            if data[slot, self._active_col]:
                self._lengths[slot] = int(data[slot, self._pos_col])
            else:
                del self._lengths[slot]
                self._free(slot)

    def _free(self, slot: int) -> None:
        """Releases the pages of the sequence that held ``slot`` (finished, or replaced)."""
        pages = self._pages.pop(slot, None)
        if pages is not None:
            self._pool.release(pages)

    def _grow(self) -> None:
        """Gives each active slot the pages the next ``steps`` tokens are written into."""
        for slot, length in self._lengths.items():
            pages = self._pages[slot]
            need = self.engine.pages_for(min(length + self.steps, self.engine.max_len))
            if len(pages) < need:
                more = self._pool.take(need - len(pages), self.engine.slot_shard(slot))
                if more is None:
                    raise RuntimeError("the KV page pool is exhausted")
                self._table[slot, len(pages) : need] = more
                pages += more

    def _pack_impl(
        self,
        first: jax.Array,
        generated: jax.Array,
        pending: jax.Array,
        out: Any,
        state: DecodeState,
    ) -> tuple[jax.Array, jax.Array]:
        """[N, columns] int32: emitted tokens, their validity, the first one's 1-based index,
        then (for the host) whether each slot is still active and its cached length."""
        tokens = jnp.concatenate([first[:, None], out.token[:-1].T], axis=1)
        valid = jnp.concatenate([pending[:, None], out.valid[:-1].T], axis=1)
        columns: Sequence[jax.Array] = (
            tokens,
            valid.astype(jnp.int32),
            generated[:, None],
            state.slots.active[:, None].astype(jnp.int32),
            state.pos[:, None],
        )
        return jnp.concatenate(columns, axis=1).astype(jnp.int32), out.valid[-1]
