"""The JAX inference engine over a paged KV cache, in the shape of JetStream's Engine API.

Keys and values live in one pool of fixed-size pages per layer (`models.KVPages`); a
sequence holds a page table (its pages in order), so memory follows real lengths and
sequences that share a prefix share its pages. Which sequence holds which pages is the
caller's business (`engine.pages.PagePool` keeps the ledger); the engine computes:

``step`` is how the embedded backend serves: one forward over a ragged batch of token
rows, each decoding slot's next token beside prompt chunks of several sequences (each its
own query length, positions and pages: `state.StepChunk`), up to ``max_step_tokens`` rows
a shard; the decode rows attend by the decode kernel (`models.paged.ragged_attention` over
each row's own pages, the work the sum of the real lengths; on TPU with a 16-bit cache JAX's
Pallas kernel, on GPU the Triton one), the chunks in query blocks over their own pages
(`models.paged.chunk_attention`); then the rows that end a prompt or decode sample (a
prompt's last row installs its request's sampling state in its slot). ``generate``
advances every active slot ``num_steps`` tokens in one device call (its batch a
power-of-two bucket or the active slots gathered: `state.decode_rows`): the embedded
backend's call is a step, then ``generate`` of the slots it sampled. JetStream's calls
(``prefill`` a chunk of one sequence and sample, ``insert`` it into a slot, ``generate``)
serve the JetStream backend. ``copy_page`` copies a shared
page before a write. Each slot carries its own sampling parameters, RNG, stop ids and
budget. A MoE model's programs also return the experts each sampled token came from
(routing replay).

Compilation is bounded: a step pads its rows to a power-of-two bucket up to
``max_step_tokens`` (its attention loops over the real pairs, chunks, blocks and pages:
counts known on the device only), one program per bucket; JetStream's prefill chunks pad to
bucket lengths (up to ``prefill_chunk``) and read a power-of-two number of pages, and
``generate`` compiles once per batch bucket. ``warmup`` (``warmup_slots``) compiles them all
up front.
``compile_counts`` counts traces per function, so a test can hold the engine to that bound.
Weights are arguments, never constants: new weights of the same shapes reuse every compiled
program. Each layer's weights and pages are buffers of their own (`serving_layout`), read
and written in place.

On ``sharder``'s mesh (an inference mesh, see `models.inference_mesh`; alone, a
`models.one_device_sharder`), the params follow the
model's logical-axis table (heads, kv heads, MLP and vocab over ``tensor``); the decode
slots split over ``data`` into ``shards`` and so do the pool's pages (kv heads over
``tensor``): slot i decodes on shard ``slot_shard(i)`` and names pages of that shard's
range only (the caller's ledger sees to it; ``step`` and ``generate`` check it), and each shard's
attention reads its own pages (`models.paged.decode_steps`): no keys or values cross chips.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.config.model import EXACT_ROWS
from jax_agent_rl.engine.state import (
    IDLE,
    RUNNING,
    DecodeState,
    Prefix,
    Slots,
    StepChunk,
    StepTokens,
    abstract_decode_state,
    buckets,
    cache_dtype,
    check_shards,
    compile_platform,
    decode_rows,
    empty_decode_state,
    finish_code,
    page_bytes,
    paged_forward,
    row_access,
    sample_step,
    slot_axes,
    step_buckets,
)
from jax_agent_rl.models import (
    ModelConfig,
    Paged,
    Sharder,
    Weights,
    page_shardings,
)
from jax_agent_rl.models.adapters import served_adapters
from jax_agent_rl.models.config import compiler_options
from jax_agent_rl.models.lora import LayerAdapters
from jax_agent_rl.models.paged import DECODE_KERNELS, StepChunks, StepRows, copy_page
from jax_agent_rl.models.policy import Policy, policy_of, policy_shardings
from jax_agent_rl.protocol import SamplingParams


def _check_exact(
    cfg: ModelConfig,
    page_size: int,
    slots_per_shard: int,
    prefill_chunk: int,
    max_len: int,
    kernel: str,
) -> None:
    """An engine whose logprobs equal the training forward's (``cfg.exact_pages``) decodes
    with the training forward's page size, with at least `EXACT_ROWS` rows on each shard, by
    the XLA loop (`ragged_attention`: the kernels sum in another order)."""
    problems = []
    if page_size != cfg.exact_pages:
        problems.append(f"page_size={page_size} (the learner reads pages of {cfg.exact_pages})")
    if slots_per_shard < EXACT_ROWS:
        problems.append(f"{slots_per_shard} decode slots a shard (at least {EXACT_ROWS})")
    if prefill_chunk < EXACT_ROWS:
        problems.append(f"prefill_chunk={prefill_chunk} (at least {EXACT_ROWS})")
    if max_len < EXACT_ROWS:
        problems.append(f"max_len={max_len} (at least {EXACT_ROWS}: a prefill chunk's rows)")
    if kernel not in ("auto", "ragged"):
        problems.append(f"decode_kernel={kernel!r} (only 'ragged' sums as the learner does)")
    if problems:
        raise ValueError("exact logprobs cannot be served with " + "; ".join(problems))


class Engine:
    """Slotted decoding over a paged KV cache (see the module docstring)."""

    def __init__(
        self,
        model: ModelConfig | Policy,
        *,
        sharder: Sharder,
        max_concurrent_decodes: int = 32,
        max_len: int = 2048,
        page_size: int = 32,
        num_pages: int | None = None,
        prefill_chunk: int = 512,
        min_prefill_bucket: int = 16,
        max_stop_ids: int = 8,
        batch_buckets: bool = True,
        decode_kernel: str = "auto",
        max_step_tokens: int = 512,
    ) -> None:
        # what computes (`models.policy`): the run's policy, or a bare config's family's
        self.policy = policy_of(model)
        self.cfg = cfg = self.policy.cfg
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        if page_size < 1 or prefill_chunk < 1:
            raise ValueError(
                f"page_size={page_size} and prefill_chunk={prefill_chunk} must be >= 1"
            )
        self.max_concurrent_decodes = max_concurrent_decodes
        self.max_len, self.max_stop_ids, self.page_size = max_len, max_stop_ids, page_size
        self.pages_per_seq = -(-max_len // page_size)  # M: a page table's length
        # default: as many pages as every slot at max_len needs (a dense cache's memory)
        self.num_pages = num_pages or max_concurrent_decodes * self.pages_per_seq
        # the slots split over `batch`'s mesh axes into `shards` contiguous ranges, and the
        # pool's pages likewise (`PAGE_AXES`): slot i decodes on shard i // slots_per_shard,
        # reading pages of that shard's range only (`slot_shard`, `shard_pages`)
        n = max_concurrent_decodes
        local = sharder.sharding(("batch",), (n,)).shard_shape((n,))[0]
        self.shards, self.slots_per_shard = n // local, local
        # each shard an equal range: a budget's pages (`pool_pages`) rounded down to them
        self.num_pages -= self.num_pages % self.shards
        self.shard_pages = self.num_pages // self.shards
        if self.shard_pages < self.pages_per_seq:
            raise ValueError(
                f"a pool of {self.num_pages} pages of {page_size} over {self.shards} shards "
                f"cannot hold one sequence of max_len={max_len} ({self.pages_per_seq} pages) "
                "on each shard"
            )
        exact = cfg.exact_pages
        if exact:
            _check_exact(
                cfg, page_size, self.slots_per_shard, prefill_chunk, max_len, decode_kernel
            )
            min_prefill_bucket = max(min_prefill_bucket, EXACT_ROWS)
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.prefill_buckets = buckets(
            min(min_prefill_bucket, self.prefill_chunk), self.prefill_chunk
        )
        self.page_buckets = buckets(1, self.pages_per_seq)  # pages a prefill chunk reads
        # decode batches of a power of two (`decode_rows`); sharded, the whole batch
        smallest = EXACT_ROWS if exact else 1
        self.batch_buckets = buckets(smallest, n) if batch_buckets and self.shards == 1 else (n,)
        # no step holds more than every slot of a shard's whole sequence (as prefill_chunk
        # is held to max_len): a larger budget is that one
        self.max_step_tokens = min(max_step_tokens, max(local * max_len, smallest))
        self.step_buckets = step_buckets(self.max_step_tokens, local, smallest, batch_buckets)
        self.cache_dtype = cache_dtype(cfg, compile_platform(sharder))
        self.sharder = sharder
        # decode attention: "ragged" (pure JAX, any device), "pallas" (the TPU kernel) or
        # "triton" (the GPU one), each kernel for a 16-bit cache (the GPU kernel's fp32
        # matmuls would take TF32); sharded, each shard runs it on its own slots and pages
        if decode_kernel == "auto":
            kernels = {"tpu": "pallas", "gpu": "triton"}
            platform = compile_platform(sharder)
            wide = self.cache_dtype == jnp.float32
            decode_kernel = "ragged" if wide or exact else kernels.get(platform, "ragged")
        if decode_kernel not in DECODE_KERNELS:
            named = ", ".join(map(repr, ("auto", *DECODE_KERNELS)))
            raise ValueError(f"decode_kernel={decode_kernel!r}: of {named}")
        self.decode_kernel = decode_kernel
        # a prefill chunk (one row) cannot split over `data`: its activations replicate
        self._row_sharder = dataclasses.replace(
            sharder, rules=dataclasses.replace(sharder.rules, batch=None)
        )
        # (building it checks that the pages split over the mesh)
        self._pages_layout = page_shardings(cfg, sharder, self.num_pages, page_size)
        self.compile_counts: collections.Counter[str] = collections.Counter()
        options = compiler_options(cfg)  # the learner's, where logprobs are exact
        self._prefill = jax.jit(
            self._prefill_impl,
            static_argnames=("pages_read",),
            donate_argnames=("state",),
            compiler_options=options,
        )
        self._insert = jax.jit(self._insert_impl, donate_argnames=("state",))
        self._generate = jax.jit(
            self._generate_impl,
            static_argnames=("num_steps",),
            donate_argnames=("state",),
            compiler_options=options,
        )
        self._step = jax.jit(self._step_impl, donate_argnames=("state",), compiler_options=options)
        self._copy_page = jax.jit(self._copy_page_impl, donate_argnames=("state",))
        # each layer's weights a buffer of its own, the head [D, V] (`serving_layout`)
        self._serving_layout = jax.jit(self.policy.serving_layout)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, keys and values of every layer."""
        return page_bytes(self.cfg, self.page_size, jnp.dtype(self.cache_dtype).itemsize)

    def pages_for(self, n_tokens: int) -> int:
        """Pages a sequence of ``n_tokens`` cached positions holds."""
        return -(-n_tokens // self.page_size)

    # ------------------------------------------------------------------------- params, state

    def load_params(self, weights: Weights) -> Weights:
        """Checks ``weights`` against the model's declaration, casts and places them in
        `serving_layout`. Takes the declared layout (a learner's) or this engine's own."""
        weights = self.policy.checked(weights)
        cast = jax.tree.map(lambda x: jnp.asarray(x, self.cfg.jnp_dtype), weights)
        cast = jax.device_put(cast, policy_shardings(self.policy, self.sharder))
        return self._serving_layout(cast)

    def load_adapters(self, params: Weights, adapters: LayerAdapters) -> Weights:
        """``params`` (this engine's, `load_params`'s) with new LoRA ``adapters`` (what a LoRA
        push sends: `served_adapters`); the base arrays are the same ones, untouched."""
        return served_adapters(self.cfg, params, adapters, self.sharder)

    def _lay_out(self, state: DecodeState) -> DecodeState:
        """Pins a decode state to its layout inside a jitted function."""
        sharder = self.sharder
        slots = jax.tree.map(lambda x: sharder.constrain(x, slot_axes(x.ndim)), state.slots)
        pages = jax.lax.with_sharding_constraint(state.pages, self._pages_layout)
        pos = sharder.constrain(state.pos, ("batch",))
        return DecodeState(pages=pages, pos=pos, slots=slots)

    def abstract_decode_state(self) -> DecodeState:
        """The decode state's shapes, dtypes and layouts (ShapeDtypeStructs): what
        `init_decode_state` makes, and what a program compiled ahead of time takes."""
        return abstract_decode_state(
            self.cfg,
            self.max_concurrent_decodes,
            self.max_stop_ids,
            self.num_pages,
            self.page_size,
            self.cache_dtype,
            self.sharder,
        )

    def init_decode_state(self) -> DecodeState:
        """An empty decode state (every slot idle, the pool zeros), each part created where
        it lives."""
        return empty_decode_state(self.abstract_decode_state())

    def slot_shard(self, slot: int) -> int:
        """The shard that decodes ``slot`` (whose pages are ``shard_pages`` from
        ``shard * shard_pages``)."""
        return slot // self.slots_per_shard

    def page_table(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Page tables [len(rows), M] of sequences holding the pages ``rows[i]``, row i the
        table of slot i (the unused entries point at the first page of the slot's shard:
        never read past a sequence's positions, never written)."""
        table = np.zeros((len(rows), self.pages_per_seq), np.int32)
        for i, pages in enumerate(rows):
            table[i] = self.slot_shard(i) * self.shard_pages
            table[i, : len(pages)] = pages
        return table

    def _device_table(self, table: np.ndarray, axes: tuple[str | None, ...]) -> jax.Array:
        return jax.device_put(table, self.sharder.sharding(axes, table.shape))

    # ----------------------------------------------------------------------------- prefill

    def prefill_bucket(self, n_tokens: int) -> int:
        i = bisect.bisect_left(self.prefill_buckets, n_tokens)
        if i == len(self.prefill_buckets):
            raise ValueError(f"{n_tokens} tokens exceed a prefill chunk of {self.prefill_chunk}")
        return self.prefill_buckets[i]

    def page_bucket(self, n_pages: int) -> int:
        return self.page_buckets[bisect.bisect_left(self.page_buckets, n_pages)]

    def prefill(
        self,
        params: Weights,
        state: DecodeState,
        pages: Sequence[int],
        start: int,
        tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        generated: int = 0,
    ) -> tuple[DecodeState, Prefix]:
        """Prefills ``tokens`` (at most ``prefill_chunk``) at positions ``start ..`` of the
        sequence whose pages are ``pages`` (they hold positions ``0 .. start - 1`` already and
        cover the new ones), and samples the next token. ``generated``: tokens the request
        sampled before (a preempted request computed again: its RNG stream and budget go on).
        The state's pool is donated."""
        total = start + len(tokens)
        if not tokens or total >= self.max_len or self.pages_for(total) > len(pages):
            raise ValueError(
                f"cannot prefill {len(tokens)} tokens after {start} in {len(pages)} pages"
            )
        bucket = self.prefill_bucket(len(tokens))
        padded = np.zeros((1, bucket), np.int32)
        padded[0, : len(tokens)] = tokens
        slots = self._request_slots(sampling, seed, generated)
        table = self._device_table(self.page_table([pages]), (None, None))
        # the chunk's keys: its padded bucket's, within the sequence's pages (the padding of a
        # chunk that ends near max_len would reach past them; it reads and writes nothing)
        pages_read = self.page_bucket(min(self.pages_for(start + bucket), self.pages_per_seq))
        return self._prefill(
            params,
            state,
            table,
            jnp.array([start, len(tokens)], jnp.int32),
            jnp.asarray(padded),
            slots,
            pages_read=pages_read,
        )

    def _request_slots(self, sampling: SamplingParams, seed: int, generated: int) -> Slots:
        """One request's slot state [1], as prefill takes it."""
        stop = np.full((1, self.max_stop_ids), -1, np.int32)
        stop[0, : len(sampling.stop_token_ids)] = sampling.stop_token_ids
        return Slots(
            token=jnp.zeros((1,), jnp.int32),
            active=jnp.ones((1,), bool),
            generated=jnp.array([generated], jnp.int32),
            max_tokens=jnp.array([sampling.max_tokens], jnp.int32),
            temperature=jnp.array([sampling.temperature], jnp.float32),
            top_k=jnp.array([sampling.top_k], jnp.int32),
            top_p=jnp.array([sampling.top_p], jnp.float32),
            stop_ids=jnp.asarray(stop),
            key=jax.random.key_data(jax.random.key(seed))[None],
        )

    def _prefill_impl(
        self,
        params: Weights,
        state: DecodeState,
        table_1m: jax.Array,
        start_n: jax.Array,
        padded_bt: jax.Array,
        slots: Slots,
        pages_read: int,
    ) -> tuple[DecodeState, Prefix]:
        self.compile_counts["prefill"] += 1  # runs at trace time only
        pos, n = start_n[:1], start_n[1:]
        h, pages, ids = paged_forward(
            self.policy,
            params,
            Paged(padded_bt, state.pages, table_1m, pos, n, pages_read=pages_read),
            self._row_sharder,
        )
        last = jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]
        # exact logprobs: the row sampled as one of EXACT_ROWS copies (a decode step's numbers)
        copies = EXACT_ROWS if self.cfg.exact_pages else 1
        rows = jax.tree.map(lambda x: jnp.repeat(x, copies, 0), (last, slots))
        token, logprob = sample_step(self.policy.logits(params, rows[0][:, None])[:, 0], rows[1])
        token, logprob = token[:1], logprob[:1]
        slots = dataclasses.replace(slots, token=token, generated=slots.generated + 1)
        finish = finish_code(slots, token, pos + n, self.max_len)
        state = self._lay_out(dataclasses.replace(state, pages=pages))
        # the experts of the chunk's last position [S, 1, T, k] -> [1, S, k]
        experts = None if ids is None else jnp.take(ids, n - 1, axis=2)[:, :, 0].swapaxes(0, 1)
        prefix = Prefix(slots=slots, pos=pos + n, logprob=logprob, finish=finish, experts=experts)
        return state, prefix

    # ---------------------------------------------------------------------- insert, copy_page

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """Places a prefilled sequence in decode slot ``slot`` (its slot state and length;
        its pages are named by the page table ``generate`` gets)."""
        return self._insert(prefix, state, jnp.int32(slot))

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
        self.compile_counts["insert"] += 1
        slots = jax.tree.map(lambda all_, one: all_.at[slot].set(one[0]), state.slots, prefix.slots)
        slots = dataclasses.replace(
            slots, active=slots.active.at[slot].set(prefix.finish[0] == RUNNING)
        )
        pos = state.pos.at[slot].set(prefix.pos[0])
        return self._lay_out(DecodeState(pages=state.pages, pos=pos, slots=slots))

    def copy_page(self, state: DecodeState, src: int, dst: int) -> DecodeState:
        """Page ``dst`` becomes a copy of page ``src`` in every layer (a shared page a
        sequence is about to write into gets copied first); both of one shard's pages, so
        the copy stays on that shard's devices."""
        if src // self.shard_pages != dst // self.shard_pages:
            raise ValueError(
                f"pages {src} and {dst} are on different shards ({self.shard_pages} pages each)"
            )
        return self._copy_page(state, jnp.array([src, dst], jnp.int32))

    def _copy_page_impl(self, state: DecodeState, src_dst: jax.Array) -> DecodeState:
        self.compile_counts["copy_page"] += 1
        pages = copy_page(state.pages, src_dst, self.sharder)
        return self._lay_out(dataclasses.replace(state, pages=pages))

    # ---------------------------------------------------------------------------- generate

    def batch_bucket(self, slots_in_use: int) -> int:
        """The decode batch that covers ``slots_in_use`` slots."""
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, slots_in_use)]

    def generate(
        self,
        params: Weights,
        state: DecodeState,
        page_table: np.ndarray,
        active: Collection[int],
        num_steps: int = 1,
        slots_in_use: int | None = None,
    ) -> tuple[DecodeState, StepTokens]:
        """Advances every active slot ``num_steps`` tokens. ``page_table`` [N, M] names each
        slot's pages (its first rows: the slots after them are idle), which must cover its
        positions for the ``num_steps`` tokens; ``active``, the active slots, picks the decode
        batch (`state.decode_rows`), whose rows the tokens come back for, [num_steps, batch],
        ``slot`` [batch] naming each row's slot; ``slots_in_use`` widens it to the first that
        many slots (a caller that reads every slot's row by its index)."""
        order = decode_rows(active, slots_in_use, self.batch_buckets, self.max_concurrent_decodes)
        table_bm = self.page_table([[]] * self.max_concurrent_decodes)  # slots left out: idle
        table_bm[: len(page_table)] = page_table
        table_bm = table_bm[order]
        check_shards(table_bm, self.slots_per_shard, self.shard_pages)
        table = self._device_table(table_bm, ("batch", None))
        slot_b = self._device_table(order, ("batch",))
        return self._generate(params, state, table, slot_b, num_steps=num_steps)

    def _generate_impl(
        self,
        params: Weights,
        state: DecodeState,
        table_bm: jax.Array,
        slot_b: jax.Array,
        num_steps: int,
    ) -> tuple[DecodeState, StepTokens]:
        self.compile_counts["generate"] += 1
        take, put = row_access(slot_b, gather=self.shards == 1)

        def step(state: DecodeState, _: None) -> tuple[DecodeState, StepTokens]:
            every = state.slots
            slots = jax.tree.map(take, every)
            active = slots.active
            pos = take(state.pos)
            h, pages, ids = paged_forward(
                self.policy,
                params,
                Paged(
                    slots.token[:, None],
                    state.pages,
                    table_bm,
                    pos,
                    active.astype(jnp.int32),
                    decode_kernel=self.decode_kernel,
                ),
                self.sharder,
            )
            pos = pos + active.astype(jnp.int32)
            token, logprob = sample_step(self.policy.logits(params, h)[:, 0], slots)
            token = jnp.where(active, token, slots.token)
            slots = dataclasses.replace(
                slots, token=token, generated=slots.generated + active.astype(jnp.int32)
            )
            finish = jnp.where(active, finish_code(slots, token, pos, self.max_len), RUNNING)
            slots = dataclasses.replace(slots, active=active & (finish == RUNNING))
            experts = None if ids is None else ids[:, :, 0].swapaxes(0, 1)  # [rows, S, k]
            out = StepTokens(token, logprob, valid=active, finish=finish, experts=experts)
            slots = jax.tree.map(put, every, slots)
            state = DecodeState(pages=pages, pos=put(state.pos, pos), slots=slots)
            return self._lay_out(state), out

        state, out = jax.lax.scan(step, state, None, length=num_steps)
        return state, dataclasses.replace(out, slot=slot_b)

    # ---------------------------------------------------------------------- the ragged step

    def step_bucket(self, n_tokens: int) -> int:
        """The rows each shard computes in a step whose busiest shard has ``n_tokens``."""
        i = bisect.bisect_left(self.step_buckets, n_tokens)
        if i == len(self.step_buckets):
            raise ValueError(
                f"{n_tokens} tokens exceed a step of max_step_tokens={self.max_step_tokens}"
            )
        return self.step_buckets[i]

    def step(
        self,
        params: Weights,
        state: DecodeState,
        page_table: np.ndarray,
        chunks: Sequence[StepChunk],
    ) -> tuple[DecodeState, StepTokens]:
        """One ragged step: every chunk's tokens in one forward (decoding slots' next tokens
        and prompt chunks of several sequences, each its own query length, positions and
        pages: `StepChunk`), each token a row that writes its key and value into its
        sequence's pages and attends to its positions up to its own (`models.paged.RaggedStep`:
        the decode rows by the decode kernel, the prompt chunks in query blocks); then the
        rows that end a prompt or decode sample their next token (`generate` then decodes
        those still running). ``page_table`` [N, M] names each slot's pages (`page_table`),
        which must cover every position the step writes. The tokens come back [1, rows],
        ``slot`` [rows] naming each row's slot (past the last slot for a padding row). At
        most one chunk per slot, at most ``max_step_tokens`` tokens on each shard. The
        state's pool is donated."""
        args = self.step_arguments(page_table, chunks)

        def put(x: np.ndarray) -> jax.Array:
            return self._device_table(x, slot_axes(x.ndim))

        return self._step(params, state, *jax.tree.map(put, args))

    def step_arguments(
        self, page_table: np.ndarray, chunks: Sequence[StepChunk]
    ) -> tuple[Any, ...]:
        """The host arrays of `step`'s program for ``chunks`` (`_StepLayout`), in order after
        the params and state, each laid out by its leading row axis over the shards."""
        n_slots = self.max_concurrent_decodes
        by_shard: list[list[StepChunk]] = [[] for _ in range(self.shards)]
        seen: set[int] = set()
        for c in chunks:
            if not 0 <= c.slot < n_slots or c.slot in seen:
                raise ValueError(f"chunk of slot {c.slot}: one chunk per slot of 0..{n_slots - 1}")
            if c.start < 0 or c.start + c.size >= self.max_len:
                raise ValueError(
                    f"cannot compute {c.size} tokens after {c.start} within max_len={self.max_len}"
                )
            seen.add(c.slot)
            by_shard[self.slot_shard(c.slot)].append(c)
        n_local = self.step_bucket(max(sum(c.size for c in cs) for cs in by_shard) or 1)
        r_local = min(n_local, self.slots_per_shard)  # rows that sample; chunks
        exact = bool(self.cfg.exact_pages)  # every token a decode row (decode's numbers)
        d_local = n_local if exact else r_local  # the decode part's rows
        lay = _StepLayout(self, n_local, r_local, d_local)
        for s, cs in enumerate(by_shard):
            lay.add_shard(s, sorted(cs, key=lambda c: bool(c.tokens)), page_table, exact)
        check_shards(lay.rows.table_r, d_local, self.shard_pages)
        check_shards(lay.rows.chunks.table, r_local, self.shard_pages)
        fresh = jax.tree.map(lambda *xs: np.stack(xs), *lay.fresh)
        return (
            lay.tokens,
            lay.slot_n,
            lay.rows,
            lay.sample_r,
            lay.slot_r,
            lay.fresh_r,
            fresh,
        )

    def filling_chunks(self, size: int) -> tuple[np.ndarray, list[StepChunk]]:
        """A page table of every slot's whole range of pages, and prompt chunks that fill a
        step of ``size`` rows on shard 0 (each slot up to max_len - 1 tokens, each ending its
        prompt): what compiles the step's program of that bucket."""
        pages = list(range(self.pages_per_seq))
        first = [self.slot_shard(s) * self.shard_pages for s in range(self.max_concurrent_decodes)]
        table = self.page_table([[f + p for p in pages] for f in first])  # each its shard's
        greedy = (SamplingParams(max_tokens=1, temperature=0.0), 0, 0)
        chunks: list[StepChunk] = []
        left = min(size, self.slots_per_shard * (self.max_len - 1))
        while left > 0:
            n = min(left, self.max_len - 1)
            chunks.append(StepChunk(len(chunks), 0, [0] * n, greedy))
            left -= n
        return table, chunks

    def _slot_row(self, first: tuple[SamplingParams, int, int] | None) -> Slots:
        """One request's slot state (host arrays, no slot axis): ``first``'s (sampling
        parameters, seed, tokens sampled before), or an idle slot's."""
        stop = np.full((self.max_stop_ids,), -1, np.int32)
        sampling, seed, generated = first or (SamplingParams(max_tokens=1), 0, 0)
        stop[: len(sampling.stop_token_ids)] = sampling.stop_token_ids
        return Slots(
            token=np.int32(0),
            active=np.bool_(first is not None),
            generated=np.int32(generated),
            max_tokens=np.int32(sampling.max_tokens),
            temperature=np.float32(sampling.temperature),
            top_k=np.int32(sampling.top_k),
            top_p=np.float32(sampling.top_p),
            stop_ids=stop,
            key=_key_data(seed) if first is not None else np.zeros(2, np.uint32),
        )

    def _step_impl(
        self,
        params: Weights,
        state: DecodeState,
        tokens_n: jax.Array,
        slot_n: jax.Array,
        rows: StepRows,
        sample_r: jax.Array,
        slot_r: jax.Array,
        fresh_r: jax.Array,
        fresh: Slots,
    ) -> tuple[DecodeState, StepTokens]:
        self.compile_counts["step"] += 1  # runs at trace time only
        every = state.slots

        def take(x: jax.Array, idle: Any = 0) -> jax.Array:  # a padding row (a slot past
            # the last) reads an idle slot's values
            return x.at[slot_r].get(mode="fill", fill_value=idle)

        def put(all_: jax.Array, part: jax.Array) -> jax.Array:  # and writes nothing
            return all_.at[slot_r].set(part, mode="drop")

        # a decode row's input is its slot's last sampled token, on the device already
        last = every.token.at[slot_n].get(mode="fill", fill_value=0)
        tokens = jnp.where(tokens_n >= 0, tokens_n, last)[:, None]
        h, pages, ids = paged_forward(
            self.policy,
            params,
            Paged(tokens, state.pages, rows=rows, decode_kernel=self.decode_kernel),
            self.sharder,
        )
        held = jax.tree.map(take, every, IDLE)
        slots = jax.tree.map(
            lambda new, old: jnp.where(fresh_r.reshape(-1, *(1,) * (old.ndim - 1)), new, old),
            fresh,
            held,
        )
        valid = slot_r < self.max_concurrent_decodes
        token, logprob = sample_step(self.policy.logits(params, h[sample_r])[:, 0], slots)
        pos = rows.pos[sample_r] + 1
        slots = dataclasses.replace(slots, token=token, generated=slots.generated + 1)
        finish = finish_code(slots, token, pos, self.max_len)
        slots = dataclasses.replace(slots, active=valid & (finish == RUNNING))
        state = DecodeState(
            pages=pages, pos=put(state.pos, pos), slots=jax.tree.map(put, every, slots)
        )
        state = self._lay_out(state)
        # the experts of each sampled row's position [S, N, 1, k] -> [R, S, k]
        experts = None if ids is None else ids[:, sample_r, 0].swapaxes(0, 1)
        out = StepTokens(token, logprob, valid=valid, finish=finish, experts=experts)
        return state, dataclasses.replace(jax.tree.map(lambda x: x[None], out), slot=slot_r)

    def warmup(
        self,
        params: Weights,
        num_steps: int,
        on_program: Callable[[int, int], None] | None = None,
    ) -> None:
        """Compiles every program serving calls of ``num_steps`` steps by ragged steps can
        need (``step`` at each row bucket a step can fill; ``generate`` of ``num_steps - 1``
        steps, after a step, and of ``num_steps``, a call that only decodes, at each batch
        bucket; and copy_page), so that no request stalls on a
        compilation later: a trace holds the GIL and stalls the whole process. It writes into
        the pool: call it before serving. ``on_program(done, total)`` hears of each program
        as it is ready."""
        report = on_program or (lambda done, total: None)  # noqa: ARG005
        state = self.init_decode_state()
        # a shard's slots hold at most max_len - 1 tokens each: the buckets a step can fill
        fits = self.slots_per_shard * (self.max_len - 1)
        sizes = [
            b for i, b in enumerate(self.step_buckets) if i == 0 or self.step_buckets[i - 1] < fits
        ]
        decodes = self.batch_buckets if num_steps > 1 else ()
        total = len(sizes) + len(decodes) + len(self.batch_buckets) + 1  # + copy_page
        for done, size in enumerate(sizes, 1):
            table, chunks = self.filling_chunks(size)
            state, out = self.step(params, state, table, chunks)
            jax.block_until_ready(out)
            report(done, total)
        state = self._warmup_generate(
            params, state, decodes, num_steps - 1, report, (len(sizes), total)
        )
        state = self._warmup_generate(
            params,
            state,
            self.batch_buckets,
            num_steps,
            report,
            (total - 1 - len(self.batch_buckets), total),
        )
        jax.block_until_ready(self.copy_page(state, 0, 1))
        report(total, total)

    def _warmup_generate(
        self,
        params: Weights,
        state: DecodeState,
        batches: Sequence[int],
        num_steps: int,
        report: Callable[[int, int], None],
        done_total: tuple[int, int],
    ) -> DecodeState:
        """Compiles ``generate`` of ``num_steps`` steps at each of ``batches``, reported as
        the programs after the first ``done`` of ``total`` (``done_total``)."""
        pages = list(range(self.pages_per_seq))
        first = [self.slot_shard(s) * self.shard_pages for s in range(self.max_concurrent_decodes)]
        table = self.page_table([[f + p for p in pages] for f in first])  # each its shard's
        done, total = done_total
        for i, rows in enumerate(batches, done + 1):
            device_table = self._device_table(table[:rows], ("batch", None))
            order = self._device_table(np.arange(rows, dtype=np.int32), ("batch",))
            state, out = self._generate(params, state, device_table, order, num_steps=num_steps)
            jax.block_until_ready(out)
            report(i, total)
        return state

    def warmup_slots(
        self,
        params: Weights,
        num_steps: int,
        on_program: Callable[[int, int], None] | None = None,
    ) -> None:
        """Compiles every program serving by JetStream's calls can need (each prefill bucket
        at each number of pages it can read, ``generate`` at each batch bucket, insert and
        copy_page), as `warmup` does for ragged steps. ``on_program(done, total)`` hears of
        each program (or program pair) as it is ready."""
        report = on_program or (lambda done, total: None)  # noqa: ARG005
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        state = self.init_decode_state()
        pages = list(range(self.pages_per_seq))
        chunks = self._warmup_chunks()
        if not chunks:
            raise AssertionError("no prefill bucket was compiled")
        total = len(chunks) + len(self.batch_buckets) + 1  # + insert/copy_page
        prefix = None
        for done, (start, n) in enumerate(chunks, 1):
            state, prefix = self.prefill(params, state, pages, start, [0] * n, greedy, 0)
            report(done, total)
        assert prefix is not None
        state = self.copy_page(self.insert(prefix, state, 0), 0, 1)
        report(len(chunks) + 1, total)
        after = (len(chunks) + 1, total)
        self._warmup_generate(params, state, self.batch_buckets, num_steps, report, after)

    def _warmup_chunks(self) -> list[tuple[int, int]]:
        """(start, length) of one prefill chunk per compiled prefill program: each bucket at
        each number of pages it can read, its padded end on the last of those pages."""
        chunks = []
        for bucket in self.prefill_buckets:
            for n_pages in self.page_buckets:
                start = max(n_pages * self.page_size - bucket, 0)
                n = min(bucket, self.max_len - 1 - start)
                if (
                    n >= 1
                    and self.prefill_bucket(n) == bucket
                    and self.page_bucket(self.pages_for(start + bucket)) == n_pages
                ):
                    chunks.append((start, n))
        return chunks


class _StepLayout:
    """A ragged step's host arrays (`Engine.step`), shard by shard: ``n`` rows a shard (its
    decode rows first, then its prompt chunks' tokens in order), ``d`` of them the decode
    part's, ``r`` sampled rows and chunk entries."""

    def __init__(self, engine: Engine, n: int, r: int, d: int) -> None:
        shards, M = engine.shards, engine.pages_per_seq
        self.engine, self.n, self.r, self.d = engine, n, r, d
        self.tokens = np.full(shards * n, -1, np.int32)
        self.slot_n = np.full(shards * n, engine.max_concurrent_decodes, np.int32)

        def tables(rows: int) -> np.ndarray:  # each row's shard's first page: never read
            first = np.arange(shards * rows, dtype=np.int32) // rows * engine.shard_pages
            return np.repeat(first[:, None], M, axis=1)

        self.rows = StepRows(
            pos=np.zeros(shards * n, np.int32),
            page=np.full(shards * n, engine.num_pages, np.int32),
            table_r=tables(d),
            pos_r=np.zeros(shards * d, np.int32),
            decode_r=np.zeros(shards * d, bool),
            chunks=StepChunks(
                row=np.zeros(shards * r, np.int32),
                size=np.zeros(shards * r, np.int32),
                start=np.zeros(shards * r, np.int32),
                table=tables(r),
                count=np.zeros(shards, np.int32),
            ),
        )
        self.sample_r = np.arange(shards * r, dtype=np.int32) // r * n  # a shard's own row
        self.slot_r = np.full(shards * r, engine.max_concurrent_decodes, np.int32)
        self.fresh_r = np.zeros(shards * r, bool)
        self.fresh = [engine._slot_row(None)] * (shards * r)

    def add_shard(
        self, s: int, chunks: Sequence[StepChunk], page_table: np.ndarray, exact: bool
    ) -> None:
        """Shard ``s``'s chunks, its decode rows first."""
        rows, ps = self.rows, self.engine.page_size
        row, sampled = 0, 0
        for c in chunks:
            g, n, table = s * self.n + row, c.size, page_table[c.slot]
            positions = c.start + np.arange(n, dtype=np.int32)
            rows.pos[g : g + n] = positions
            rows.page[g : g + n] = table[positions // ps]
            if c.tokens:
                self.tokens[g : g + n] = c.tokens
            else:
                self.slot_n[g] = c.slot
            if exact or not c.tokens:  # decode rows
                d = s * self.d + row
                rows.table_r[d : d + n] = table
                rows.pos_r[d : d + n] = positions
                rows.decode_r[d : d + n] = True
            else:
                k = s * self.r + int(rows.chunks.count[s])
                rows.chunks.row[k], rows.chunks.size[k] = row, n
                rows.chunks.start[k], rows.chunks.table[k] = c.start, table
                rows.chunks.count[s] += 1
            if c.samples:
                k = s * self.r + sampled
                self.sample_r[k], self.slot_r[k] = g + n - 1, c.slot
                if c.first is not None:
                    self.fresh_r[k], self.fresh[k] = True, self.engine._slot_row(c.first)
                sampled += 1
            row += n


def _key_data(seed: int) -> np.ndarray:
    """The raw key data [2] (uint32) of ``seed``'s RNG key, as `jax.random.key` makes it."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
