"""The in-process rollout backend: the JAX engine behind the asyncio `RolloutBackend` protocol.

One engine thread owns the device state and runs continuous batching: waiting requests are
prefilled into free slots, all active slots decode together ``steps_per_call`` tokens per
device call, and a finished, aborted or failed request frees its slot at once for the next.
The event loop never blocks: coroutines hand commands to the thread and await futures it
resolves.

Sessions: when a request with a ``session_id`` finishes, its slot's cache row is kept (LRU);
the session's next request prefills only the tokens after the longest common prefix.

Weight updates drain: admission pauses, requests in flight finish under the weights they
started with, then the new weights (same shapes: no recompilation) replace the old, the
session cache is dropped (its keys/values belong to the old weights), and admission resumes.
Every result is stamped with the single weight version it was sampled under.

`pause` / `is_paused` / `resume` hold the engine at a state for tests (the conformance suite
aborts a request it knows to be running, and one it knows to be queued): paused, the engine
admits and decodes nothing, and still serves aborts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
from typing import Any

import jax

from jax_agent_rl import device_turns
from jax_agent_rl.engine.engine import RUNNING, STOPPED, Engine, Prefix
from jax_agent_rl.models import KVCache, Weights
from jax_agent_rl.rollout.protocol import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    resolve_from_thread,
    validate_request,
)


@dataclasses.dataclass
class _Job:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pos: int = 0  # cached positions of its slot (host mirror of cache.pos)
    version: int = 0


@dataclasses.dataclass
class _Update:
    params: Weights
    version: int
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass
class BackendStats:
    requests: int = 0
    prefilled_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from a session's cached prefix
    generated_tokens: int = 0
    decode_calls: int = 0
    aborted: int = 0


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
    ) -> None:
        self.engine = engine
        self.capabilities = Capabilities(
            logprobs=True,
            logprob_tolerance=1e-4 if engine.cfg.dtype == "float32" else 5e-2,
            per_request_sampling=True,
            stop_token_ids=True,
            abort=True,
            prefix_cache=True,
            weight_update="in_place",
            max_model_len=engine.max_len,
        )
        self.stats = BackendStats()
        self._params = engine.load_params(params)
        if warmup:  # compile every program now rather than stall a rollout later
            engine.warmup(self._params, steps_per_call)
        self._version = weight_version
        self._state = engine.init_decode_state()
        self._steps_per_call = steps_per_call
        self._session_cache_size = session_cache_size
        self._sessions: collections.OrderedDict[str, tuple[tuple[int, ...], KVCache]] = (
            collections.OrderedDict()
        )
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._slots: dict[int, _Job] = {}
        self._ids: set[str] = set()
        self._update: _Update | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._pause_at: tuple[str, int] | None = None  # pause once this request has n tokens
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jarl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio-facing API

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._validate(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        seed = request.sampling.seed
        job = _Job(request, future, loop, self._rng.getrandbits(31) if seed is None else seed)
        with self._cond:
            if request.request_id in self._ids:
                raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
            self._ids.add(request.request_id)
        try:
            self._send("generate", job)
        except RuntimeError:
            with self._cond:
                self._ids.discard(request.request_id)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            self._send("abort", request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def pause(self, request_id: str | None = None, tokens: int = 1) -> None:
        """Test hook: stops admitting and decoding at once, or (with ``request_id``) once that
        request has produced ``tokens`` tokens; aborts are still served. `resume` undoes it."""
        self._send("pause", (request_id, tokens))

    def is_paused(self) -> bool:
        """Whether a `pause` has taken effect (and no `resume` followed)."""
        return self._paused.is_set()

    def resume(self) -> None:
        self._send("resume", None)

    async def update_weights(self, params: Any, version: int) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._send("update", _Update(params, version, future, loop))
        await future

    async def close(self) -> None:
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

    def _validate(self, request: GenerateRequest) -> None:
        validate_request(request, self.engine.cfg.vocab_size, self.engine.max_len)
        stops = request.sampling.stop_token_ids
        if len(stops) > self.engine.max_stop_ids:
            raise InvalidRequestError(
                f"{len(stops)} stop_token_ids; this engine takes at most {self.engine.max_stop_ids}"
            )

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
                    self._engine_work()
                    # done on the devices before the turn passes (see `device_turns`)
                    jax.block_until_ready((self._state, self._params))
        except BaseException as e:  # the engine is broken: fail everything, refuse new work
            with self._cond:
                self._failure = e
            for job in [*self._slots.values(), *self._waiting]:
                resolve_from_thread(job.future, job.loop, RuntimeError(f"engine failed: {e!r}"))
            if self._update is not None:
                resolve_from_thread(self._update.future, self._update.loop, RuntimeError(repr(e)))
            raise

    def _has_work(self) -> bool:
        return bool(self._slots or self._waiting or self._update)

    def _engine_work(self) -> None:
        """A pending weight update once nothing decodes, then admissions, then a decode call
        (none of them while paused)."""
        if self._update is not None and not self._slots and not self._paused.is_set():
            self._apply_update(self._update)
            self._update = None
        while (
            not self._paused_now()
            and self._admissible()
            and len(self._slots) < self.engine.max_concurrent_decodes
        ):
            self._admit(self._waiting.popleft())
        if self._slots and not self._paused_now():
            self._decode()
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

    def _admissible(self) -> bool:
        return bool(self._waiting) and self._update is None

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "generate":
            self._waiting.append(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "update":
            if self._update is not None:  # a newer update supersedes one still draining
                resolve_from_thread(self._update.future, self._update.loop, None)
            self._update = payload
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

    def _apply_update(self, update: _Update) -> None:
        try:
            params = self.engine.load_params(update.params)
        except ValueError as e:
            resolve_from_thread(update.future, update.loop, e)
            return
        self._params, self._version = params, update.version
        self._sessions.clear()
        resolve_from_thread(update.future, update.loop, None)

    def _abort(self, request_id: str) -> None:
        for job in list(self._waiting):
            if job.request.request_id == request_id:
                self._waiting.remove(job)
                self._finish(job, "abort")
                return
        for slot, job in list(self._slots.items()):
            if job.request.request_id == request_id:
                self._state = self.engine.release(self._state, slot)
                del self._slots[slot]
                self._finish(job, "abort")
                return

    def _admit(self, job: _Job) -> None:
        request = job.request
        prompt = request.prompt_ids
        cached, start = self._cached_prefix(request, prompt)
        job.version = self._version
        prefix: Prefix = self.engine.prefill(
            self._params, cached, prompt[start:], request.sampling, job.seed
        )
        self.stats.requests += 1
        self.stats.prefilled_tokens += len(prompt) - start
        self.stats.prefix_hit_tokens += start
        # whole [1] arrays to the host, indexed there (indexing on the device runs a program)
        token, logprob, finish = (
            x[0] for x in jax.device_get((prefix.slots.token, prefix.logprob, prefix.finish))
        )
        job.tokens.append(int(token))
        job.logprobs.append(float(logprob))
        job.pos = len(prompt)
        if int(finish) != RUNNING:
            self._remember(job, prefix.cache)
            self._finish(job, "stop" if int(finish) == STOPPED else "length")
            return
        slot = next(i for i in range(self.engine.max_concurrent_decodes) if i not in self._slots)
        self._state = self.engine.insert(prefix, self._state, slot)
        self._slots[slot] = job

    def _decode(self) -> None:
        max_pos = max(job.pos for job in self._slots.values())
        self._state, out = self.engine.generate(
            self._params,
            self._state,
            self._steps_per_call,
            max_pos=max_pos,
            slots_in_use=max(self._slots) + 1,
        )
        out = jax.device_get(out)
        self.stats.decode_calls += 1
        finished: list[tuple[int, FinishReason]] = []
        for slot, job in self._slots.items():
            for t in range(self._steps_per_call):
                if not out.valid[t, slot]:
                    break
                job.tokens.append(int(out.token[t, slot]))
                job.logprobs.append(float(out.logprob[t, slot]))
                job.pos += 1
                code = int(out.finish[t, slot])
                if code != RUNNING:
                    finished.append((slot, "stop" if code == STOPPED else "length"))
                    break
        for slot, reason in finished:
            job = self._slots.pop(slot)
            if job.request.session_id is not None:
                self._remember(job, self.engine.extract(self._state, slot))
            self._finish(job, reason)

    def _cached_prefix(
        self, request: GenerateRequest, prompt: tuple[int, ...]
    ) -> tuple[KVCache | None, int]:
        """The session's cached row (or, for a session not cached, that of the session it
        continues: ``prefix_session``) and how many leading prompt tokens it already holds."""
        if request.session_id is None:
            return None, 0
        ids = (request.session_id, request.prefix_session)
        session_id = next((s for s in ids if s is not None and s in self._sessions), None)
        if session_id is None:
            return None, 0
        self._sessions.move_to_end(session_id)
        tokens, row = self._sessions[session_id]
        limit = min(len(tokens), len(prompt) - 1)  # at least one token must be prefilled
        common = 0
        while common < limit and tokens[common] == prompt[common]:
            common += 1
        if common == 0:
            return None, 0
        return self.engine.keep_prefix(row, common), common

    def _remember(self, job: _Job, row: KVCache) -> None:
        session = job.request.session_id
        if session is None or self._session_cache_size == 0:
            return
        covered = (*job.request.prompt_ids, *job.tokens)[: job.pos]
        self._sessions[session] = (covered, jax.block_until_ready(row))
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._session_cache_size:
            self._sessions.popitem(last=False)

    def _finish(self, job: _Job, reason: FinishReason) -> None:
        with self._cond:
            self._ids.discard(job.request.request_id)
        self.stats.generated_tokens += len(job.tokens)
        self.stats.aborted += reason == "abort"
        want_logprobs = job.request.sampling.logprobs
        result = GenerateResult(
            token_ids=tuple(job.tokens),
            logprobs=tuple(job.logprobs) if want_logprobs else None,
            finish_reason=reason,
            weight_version=job.version if job.tokens else self._version,
        )
        resolve_from_thread(job.future, job.loop, result)

    def _shutdown(self) -> None:
        for slot in list(self._slots):
            self._finish(self._slots.pop(slot), "abort")
        while self._waiting:
            self._finish(self._waiting.popleft(), "abort")
        if self._update is not None:
            resolve_from_thread(
                self._update.future, self._update.loop, RuntimeError("backend closed")
            )
