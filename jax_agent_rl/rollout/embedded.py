"""The in-process rollout backend: the JAX engine behind the asyncio `RolloutBackend` protocol.

One engine thread owns the device state and runs continuous batching by ragged steps
(`Engine.step`): each engine call computes every decoding slot's next token and chunks of
the prompts being computed, oldest first, waiting requests admitted into free slots while the
step's token budget (``engine.max_step_tokens``) lasts, in one forward; then the slots it
sampled decode ``steps_per_call - 1`` more steps (`Engine.generate`, their own batch). A
finished, aborted or failed request frees its slot for the next call.
The event loop never blocks: coroutines hand commands to the thread and await futures it
resolves.

Memory is a pool of KV pages (`Engine`), handed out by real length: a request holds the
pages of its sequence so far plus its next decode call's, all on its slot's shard
(`SessionPages.best_slot`). Prefixes are shared by reference within a shard: a finished
request's pages are kept for its ``session_id`` (LRU, evicted when the pool runs short),
whose next request prefills only what follows the longest common prefix; every full page of
a known prefix stays cached, so a group's episodes (one prompt) prefill it once per shard and
a tree's branches share their parent's pages (``prefix_session``). When the pool runs out,
admissions wait, and a decoding request that needs a page preempts the one admitted last on
its shard, computed again later. A long prompt is computed in chunks of at most
``prefill_chunk`` over several calls beside the decoding rows; episodes whose first page is
that of a prompt being computed wait for its pages rather than compute them again. Given
``decode`` (the run's tokenizer), a request ends at the
decode call that completes one of its stop strings, cut at the token that does (`stops`).

Weight updates drain (the `WeightGate` every backend shares): new requests wait, requests in
flight finish under the weights they started with, then the new weights (same shapes: no
recompilation) take the old ones' place, kept sessions are dropped (cached prefixes are
salted with the version, `PagePool.keys`), and admission resumes. Whole new weights are
staged (``staged_push``): placed on the devices (cast, laid out) in the engine's next round,
beside the decode call of the requests the gate drains, so the drain ends in a swap;
unstaged, the old weights are dropped first and the new placed once drained (one copy). With
``keep_kv_on_update`` nothing drains or is dropped: the push lands between two engine calls,
and running requests and kept sessions go on under the new weights over the old ones' keys
and values (shared prefixes never cross versions). A LoRA push is its adapters alone
(`LayerAdapters`, run unmerged on the kept base). A delta push (`delta.WeightDelta`, on the
version it serves) sets the changed elements of its weights in place (`delta.apply_delta`).
Each sampled token carries the version that
sampled it and the oldest that computed its KV (`GenerateResult.token_versions`,
``kv_versions``; `PagePool.oldest`), and a MoE's its experts (`GenerateResult.expert_ids`).

`pause` / `is_paused` / `resume` hold the engine for tests (aborting a request known to run,
or to wait): paused, it admits and decodes nothing, and serves aborts.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jax_agent_rl.cluster import device_turns
from jax_agent_rl.engine.engine import Engine
from jax_agent_rl.engine.pages import PagePool
from jax_agent_rl.engine.state import RUNNING, STOPPED, StepChunk, StepTokens
from jax_agent_rl.models import Weights
from jax_agent_rl.models.lora import LayerAdapters
from jax_agent_rl.protocol import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PushStats,
    logprob_tolerance,
    resolve_from_thread,
    validate_request,
)
from jax_agent_rl.rollout.delta import WeightDelta, apply_delta, push_bytes
from jax_agent_rl.rollout.gate import WeightGate
from jax_agent_rl.rollout.jobs import Job, Stage, Update
from jax_agent_rl.rollout.session_pages import BackendStats, SessionPages
from jax_agent_rl.rollout.stops import Decode


class EmbeddedBackend:
    """`RolloutBackend` over an in-process `Engine` (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        params: Weights,
        *,
        weight_version: int = 0,
        steps_per_call: int = 4,
        session_cache_size: int = 128,
        seed: int = 0,
        warmup: bool = False,
        on_program: Callable[[int, int], None] | None = None,
        decode: Decode | None = None,
        keep_kv_on_update: bool = False,
        staged_push: bool = True,
    ) -> None:
        self.engine = engine
        self._detokenize = decode  # for stop strings; None: the agent loop cuts at them
        self.capabilities = Capabilities(
            logprobs=True,
            logprob_tolerance=logprob_tolerance(engine.cfg.dtype),
            per_request_sampling=True,
            stop_token_ids=True,
            abort=True,
            prefix_cache=True,
            weight_update="in_place",
            max_model_len=engine.max_len,
            expert_ids=engine.policy.experts is not None,
            lora=engine.policy.adapted,
            delta_push=True,
        )
        self.stats = BackendStats()
        # the last weight push: its bytes (a LoRA policy's adapters only), the engine's seconds
        self.last_push: PushStats | None = None
        self._params = engine.load_params(params)
        if warmup:  # compile every program now rather than stall a rollout later
            engine.warmup(self._params, steps_per_call, on_program)
        self._gate = WeightGate(weight_version, drain=not keep_kv_on_update)
        self._state = engine.init_decode_state()
        self._steps_per_call = steps_per_call
        # the engine thread's ledger, and the weight version it serves (`PagePool.version`)
        self._pool = PagePool(engine.num_pages, engine.shards, weight_version)
        self._sessions = SessionPages(self._pool, engine.page_size, session_cache_size, self.stats)
        self._table = engine.page_table([[]] * engine.max_concurrent_decodes)
        self._prefilling: dict[int, Job] = {}  # by slot: prompts not computed whole yet
        self._admissions, self._rng = itertools.count(), random.Random(seed)
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._waiting: collections.deque[Job] = collections.deque()
        self._slots: dict[int, Job] = {}
        self._update: Update | None = None
        self._staged_push = staged_push
        self._stage: Stage | None = None  # whole weights to place, placing, or placed
        self._closed = False
        self._failure: BaseException | None = None
        self._pause_at: tuple[str, int] | None = None  # pause once this request has n tokens
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jarl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio-facing API

    @property
    def weight_version(self) -> int:
        return self._gate.version

    def counters(self) -> dict[str, float]:
        return {}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        engine = self.engine
        validate_request(request, engine.cfg.vocab_size, engine.max_len, engine.max_stop_ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        seed = request.sampling.seed
        job = Job(request, future, loop, self._rng.getrandbits(31) if seed is None else seed)
        ticket = self._gate.enter(request.request_id)
        try:
            if not await self._gate.admit(ticket):  # aborted while an update ran
                return GenerateResult((), None, "abort", self._gate.version)
            self._send("generate", job)
            try:
                return await future
            except asyncio.CancelledError:
                self._send("abort", request.request_id)
                raise
        finally:
            self._gate.done(ticket)

    async def abort(self, request_id: str) -> None:
        if self._gate.abort(request_id) is not None:  # (one not sent yet will not be)
            self._send("abort", request_id)

    def pause(self, request_id: str | None = None, tokens: int = 1) -> None:
        """Test hook: stops admitting and decoding at once, or (with ``request_id``) once that
        request has produced ``tokens`` tokens; aborts are still served. `resume` undoes it.
        A pause for a request replaces one in effect at once: `is_paused` is false from
        this call until that request has its tokens."""
        if request_id is not None:
            self._paused.clear()
        self._send("pause", (request_id, tokens))

    def is_paused(self) -> bool:
        """Whether a `pause` has taken effect (and no `resume` followed)."""
        return self._paused.is_set()

    def resume(self) -> None:
        self._send("resume", None)

    async def update_weights(self, params: Any, version: int) -> None:
        loop = asyncio.get_running_loop()

        async def place() -> None:  # beside the decoding of the requests the gate drains
            stage = Stage(params, loop.create_future(), loop)
            self._send("stage", stage)
            await stage.future

        async def push() -> None:  # (a staged push: the swap)
            future: asyncio.Future[None] = loop.create_future()
            self._send("update", Update(params, version, future, loop))
            await future

        whole = not isinstance(params, (LayerAdapters, WeightDelta))
        staged = self._staged_push and whole
        held = await self._gate.update(push, version, prepare=place if staged else None)
        if self._gate.drain:  # else it stalled decoding for its swap alone (`_apply_update`)
            self.last_push = self.last_push and self.last_push.held(held)

    async def close(self) -> None:
        self._gate.close()
        self._send("close", None)
        await asyncio.to_thread(self._thread.join)

    def _send(self, kind: str, payload: Any) -> None:
        with self._cond:
            if self._failure is not None:
                raise RuntimeError(f"the engine thread failed: {self._failure!r}")
            if self._closed and kind != "close":
                raise RuntimeError("the backend is closed")
            self._inbox.append((kind, payload))
            self._cond.notify()

    # ------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or (self._has_work() and not self._paused.is_set())):
                        self._cond.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                with device_turns.TURN:  # the devices may be shared with a learner's thread
                    for kind, payload in commands:
                        self._handle(kind, payload)
                    if self._closed:
                        self._shutdown()
                        return
                    placing = self._place_staged()
                    self._engine_work()
                    # done on the devices before the turn passes (see `device_turns`)
                    jax.block_until_ready((self._state, self._params))
                    if placing is not None:  # placed beside this round's decode call
                        self._staged_ready(placing)
        except BaseException as e:  # the engine is broken: fail everything, refuse new work
            with self._cond:
                self._failure = e
            for job in [*self._slots.values(), *self._waiting, *self._prefilling.values()]:
                resolve_from_thread(job.future, job.loop, RuntimeError(f"engine failed: {e!r}"))
            for pending in (self._update, self._stage):
                if pending is not None:
                    resolve_from_thread(pending.future, pending.loop, RuntimeError(repr(e)))
            raise

    def _has_work(self) -> bool:
        return bool(
            self._slots
            or self._waiting
            or self._update
            or self._prefilling
            or (self._stage is not None and self._stage.placed is None)
        )

    def _engine_work(self) -> None:
        """A pending weight update (it comes once the gate has drained every request), then
        one engine call: a ragged step of every decoding slot's next token and the prompt
        chunks that fit the step's token budget (admitting waiting requests into free
        slots), then its decode steps (none of them while paused)."""
        if self._update is not None and not self._paused.is_set():
            self._apply_update(self._update)
            self._update = None
        if self._paused_now():
            return
        self._step()
        self._paused_now()

    def _paused_now(self) -> bool:
        """Whether generation is paused, pausing it first if the awaited request has produced
        its tokens."""
        if self._pause_at is not None:
            rid, tokens = self._pause_at
            if any(
                j.request.request_id == rid and len(j.tokens) >= tokens
                for j in self._slots.values()
            ):
                self._pause_at = None
                self._paused.set()
        return self._paused.is_set()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "generate":
            self._waiting.append(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "update":
            self._update = payload
        elif kind == "stage":
            self._stage = payload
        elif kind == "pause":
            rid, tokens = payload
            if rid is None:
                self._paused.set()
            else:  # a pause in effect gives way to this one
                self._pause_at = (rid, tokens)
                self._paused.clear()
        elif kind == "resume":
            self._pause_at = None
            self._paused.clear()
        elif kind == "close":
            self._closed = True

    def _place_staged(self) -> Stage | None:
        """Starts placing the staged weights, if any wait (their arrays come ready during
        this round's decode call); the stage being placed, or None."""
        stage = self._stage
        if stage is None or stage.placed is not None:
            return None
        t0 = time.perf_counter()
        try:
            self.engine.policy.checked(stage.params)
            stage.placed = self.engine.load_params(stage.params)
        except ValueError as e:
            self._stage = None
            resolve_from_thread(stage.future, stage.loop, e)
            return None
        stage.seconds = -t0
        return stage

    def _staged_ready(self, stage: Stage) -> None:
        stage.seconds += time.perf_counter()
        resolve_from_thread(stage.future, stage.loop, None)

    def _apply_update(self, update: Update) -> None:
        t0 = time.perf_counter()
        new, stage, load_s = update.params, self._stage, 0.0
        try:
            if isinstance(new, LayerAdapters):  # LoRA: new adapters on the base it holds
                self._params = self.engine.load_adapters(self._params, new)
            elif isinstance(new, WeightDelta):  # the changed elements, in place
                self._params = apply_delta(self._params, new, self._pool.version)
            elif stage is not None and stage.params is new and stage.placed is not None:
                self._params, self._stage, load_s = stage.placed, None, stage.seconds  # a swap
            else:
                self.engine.policy.checked(new)
                del self._params  # first: the new weights take the old ones' place (one copy)
                self._params = self.engine.load_params(new)
        except ValueError as e:
            resolve_from_thread(update.future, update.loop, e)
            return
        jax.block_until_ready(self._params)
        self._pool.version = update.version  # the stamp of the pages taken from now on
        if self._gate.drain:
            self._sessions.drop()  # their pages hold keys and values of the old weights
        seconds = time.perf_counter() - t0  # decoding stopped for them
        self.last_push = PushStats(
            push_bytes(new), 0.0, load_s + seconds, seconds, seconds, isinstance(new, WeightDelta)
        )
        resolve_from_thread(update.future, update.loop, None)

    def _abort(self, request_id: str) -> None:
        for job in list(self._waiting):
            if job.request.request_id == request_id:
                self._waiting.remove(job)
                self._finish(job, "abort")
                return
        for held in (self._prefilling, self._slots):  # its slot is simply left out of steps
            for slot, job in list(held.items()):
                if job.request.request_id == request_id:
                    del held[slot]
                    self._pool.release(job.pages)
                    self._finish(job, "abort")
                    return

    # --------------------------------------------------------------------- pages, prefixes

    def _sequence(self, job: Job) -> tuple[int, ...]:
        """What the job's next prefill computes: its prompt, and after a preemption the
        tokens it sampled before (the last of them not cached yet)."""
        return (*job.request.prompt_ids, *job.tokens)

    def _admit(self, job: Job) -> bool:
        """Starts the waiting request ``job`` in a free slot: its cached prefix, pages for
        the rest of its sequence and its first decode steps; its prompt is then computed in
        chunks, one per step (`_step`). False (and nothing held) if the pool has too few
        pages for now."""
        seq, engine = self._sequence(job), self.engine
        total = engine.pages_for(min(len(seq) + self._steps_per_call, engine.max_len))
        held = self._slots.keys() | self._prefilling.keys()
        free = (s for s in range(engine.max_concurrent_decodes) if s not in held)
        job.slot = self._sessions.best_slot(job.request, seq, free, engine.slot_shard, total)
        shard = engine.slot_shard(job.slot)
        pages, common = self._sessions.cached_prefix(job.request, seq, shard)
        more = self._sessions.take(total - len(pages), shard) if total > len(pages) else []
        if more is None or not self._sessions.private_tail(pages, common, self._copy_page):
            self._pool.release(pages + (more or []))
            if not self._slots and not self._prefilling and not self._sessions:
                raise RuntimeError(  # the shard's pages are held by no one and still too few
                    f"{total} pages needed; {self._pool.available(shard)} free on shard {shard}"
                )
            return False
        job.pages, job.done = pages + more, common
        job.kv_version = self._pool.oldest(job.pages)
        if job.admitted < 0:
            job.admitted = next(self._admissions)
        self.stats.requests += not job.tokens
        self.stats.prefix_hit_tokens += common
        self._prefilling[job.slot] = job
        self._table[job.slot, : len(job.pages)] = job.pages
        return True

    def _step(self) -> None:
        """One engine call: every decoding slot's next token and, in the token budget left
        on each shard (``engine.max_step_tokens``), the next chunk of each prompt being
        computed (the oldest first), admitting waiting requests into free slots while budget
        is left, as one ragged step; then the call's decode steps. A call with no prompt
        chunk is the decode program's alone (`Engine.generate` of every step: a ragged step
        of decode rows only costs more than a decode step). A prompt's last chunk samples
        its first token: the request decodes from the next call on. A finished row's slot
        takes the next waiting request at the next call."""
        engine = self.engine
        self._grow()
        budget = [engine.max_step_tokens] * engine.shards
        chunks = []
        for slot, job in self._slots.items():
            chunks.append(StepChunk(slot, job.pos))
            budget[engine.slot_shard(slot)] -= 1
        computed = self._prompt_chunks(budget, chunks)
        if not chunks:
            return
        called = time.perf_counter()
        if computed:  # prompt chunks beside the decode rows: one ragged step first
            self._state, first = engine.step(self._params, self._state, self._table, chunks)
            steps, sampled = self._steps_per_call - 1, [c.slot for c in chunks if c.samples]
        else:  # every row decodes
            first, steps, sampled = None, self._steps_per_call, list(self._slots)
        rest = None
        if steps:  # every sampled row's slot: decoding, or starting now
            self._state, rest = engine.generate(
                self._params, self._state, self._table, sampled, steps
            )
        first, rest = jax.device_get((first, rest))
        busiest = engine.max_step_tokens - min(budget)  # the rows of the fullest shard
        self._count_call(
            time.perf_counter() - called, chunks if computed else [], busiest, sampled, rest
        )
        for job, n in computed:
            job.done += n
            self.stats.prefilled_tokens += n
            seq = self._sequence(job)
            if job.done == len(seq):  # its first token is sampled: it decodes from now on
                del self._prefilling[job.slot]
                self._pool.register(
                    job.pages, self._pool.keys(seq, engine.page_size, job.kv_version)
                )
                job.pos = len(seq) - 1  # (its first token adds none: its input is cached)
                self._slots[job.slot] = job
        for out in (first, rest):
            if out is not None:
                self._take_tokens(out)

    def _prompt_chunks(self, budget: list[int], chunks: list[StepChunk]) -> list[tuple[Job, int]]:
        """Adds to ``chunks`` the next chunk of each prompt being computed (the oldest
        first) and of waiting requests admitted while ``budget`` (tokens left on each shard)
        and the slots allow; the jobs and their chunks' sizes."""
        engine = self.engine
        prompts = sorted(self._prefilling.values(), key=lambda j: j.admitted)
        while (
            self._waiting
            and any(budget)
            and len(self._slots) + len(self._prefilling) < engine.max_concurrent_decodes
        ):
            if self._shares_a_prompt_in_flight(self._waiting[0]):
                break  # it takes that prompt's pages once they are computed
            if not self._admit(self._waiting[0]):
                break  # too few pages: it waits for running requests to free some
            prompts.append(self._waiting.popleft())
        computed: list[tuple[Job, int]] = []
        for job in prompts:
            shard, seq = engine.slot_shard(job.slot), self._sequence(job)
            n = min(len(seq) - job.done, budget[shard], engine.prefill_chunk)
            if n <= 0:
                continue
            budget[shard] -= n
            last = job.done + n == len(seq)
            starts = (job.request.sampling, job.seed, len(job.tokens)) if last else None
            chunks.append(StepChunk(job.slot, job.done, seq[job.done : job.done + n], starts))
            computed.append((job, n))
        return computed

    def _count_call(
        self,
        seconds: float,
        chunks: list[StepChunk],
        busiest: int,
        sampled: list[int],
        rest: StepTokens | None,
    ) -> None:
        """A call's profile in ``stats``: its seconds, and the rows its ragged step (its
        ``chunks``, none in a call that only decodes; ``busiest``: the fullest shard's rows)
        and its decode steps asked for and computed."""
        stats, engine = self.stats, self.engine
        stats.call_s += seconds
        stats.decode_calls += 1
        if chunks:
            stats.step_calls += 1
            stats.step_rows += sum(c.size for c in chunks)
            stats.step_rows_computed += engine.step_bucket(busiest) * engine.shards
        if rest is not None:
            stats.decode_steps += len(rest.token)
            stats.decode_rows += len(sampled) * len(rest.token)
            stats.decode_rows_computed += rest.token.size

    def _shares_a_prompt_in_flight(self, job: Job) -> bool:
        """Whether ``job``'s first full page is that of a prompt being computed (a group's
        episodes, arriving together): it waits for those pages to be cached rather than
        compute them again beside it."""
        size = self.engine.page_size
        seq = self._sequence(job)
        if len(seq) <= size:
            return False
        return any(
            self._sequence(other)[:size] == seq[:size] for other in self._prefilling.values()
        )

    def _take_tokens(self, out: StepTokens) -> None:
        """Each running row's tokens of the call, up to its finish; the finished retire."""
        finished: list[tuple[int, FinishReason]] = []
        for row, slot in enumerate(out.slot.tolist()):
            if (job := self._slots.get(slot)) is None:
                continue  # a padding row
            before, code = len(job.tokens), RUNNING
            for t in range(len(out.token)):  # up to its finish: the rest are not valid
                if not out.valid[t, row] or code != RUNNING:
                    break
                experts = None if out.experts is None else out.experts[t, row]
                token, logprob = int(out.token[t, row]), float(out.logprob[t, row])
                job.add(token, logprob, experts, self._pool.version)
                job.pos += 1
                code = int(out.finish[t, row])
            if job.cut_at_stop_string(self._detokenize, len(job.tokens) - before):
                finished.append((slot, "stop"))  # its slot is left out of the next steps
            elif code != RUNNING:
                finished.append((slot, "stop" if code == STOPPED else "length"))
        for slot, reason in finished:
            self._retire(self._slots.pop(slot), reason)

    def _grow(self) -> None:
        """Gives every decoding slot the pages its next decode call writes into; when the
        slot's shard runs out, the request admitted last there is preempted (its pages freed,
        its full pages kept as a cached prefix) and waits to be computed again."""
        shard = self.engine.slot_shard
        for slot in sorted(self._slots, key=lambda s: self._slots[s].admitted):
            job = self._slots.get(slot)
            if job is None:
                continue
            need = self.engine.pages_for(min(job.pos + self._steps_per_call, self.engine.max_len))
            while len(job.pages) < need:
                more = self._sessions.take(need - len(job.pages), shard(slot))
                if more is not None:
                    self._table[slot, len(job.pages) : need] = more
                    job.pages += more
                    break
                mates = [s for s in self._slots if shard(s) == shard(slot)]
                self._preempt(max(mates, key=lambda s: self._slots[s].admitted))
                if slot not in self._slots:
                    break

    def _preempt(self, slot: int) -> None:
        job = self._slots.pop(slot)
        seq = self._sequence(job)[: job.pos]
        self._pool.register(job.pages, self._pool.keys(seq, self.engine.page_size, job.kv_version))
        self._pool.release(job.pages)
        job.pages = []
        self._waiting.appendleft(job)
        self.stats.preempted += 1

    def _copy_page(self, page: int, fresh: int) -> None:
        self._state = self.engine.copy_page(self._state, page, fresh)
        self.stats.page_copies += 1

    def _retire(self, job: Job, reason: FinishReason) -> None:
        """A finished job's pages: its full ones registered as a cached prefix; kept for its
        session (by reference: the session holds them now) or released."""
        covered = self._sequence(job)[: job.pos]
        self._pool.register(
            job.pages, self._pool.keys(covered, self.engine.page_size, job.kv_version)
        )
        session = job.request.session_id
        if session is not None and self._sessions.size > 0:
            keep = self.engine.pages_for(job.pos)
            self._pool.release(job.pages[keep:])
            self._sessions.keep(session, covered, job.pages[:keep])
        else:
            self._pool.release(job.pages)
        job.pages = []
        self._finish(job, reason)

    def _finish(self, job: Job, reason: FinishReason) -> None:
        self.stats.generated_tokens += len(job.tokens)
        self.stats.aborted += reason == "abort"
        result = job.result(reason, self._gate.version)
        resolve_from_thread(job.future, job.loop, result)

    def _shutdown(self) -> None:
        for slot in list(self._slots):
            self._finish(self._slots.pop(slot), "abort")
        while self._waiting:
            self._finish(self._waiting.popleft(), "abort")
        for slot in list(self._prefilling):
            self._finish(self._prefilling.pop(slot), "abort")
        for pending in (self._update, self._stage):
            if pending is not None:
                resolve_from_thread(pending.future, pending.loop, RuntimeError("backend closed"))
