"""`JetStreamBackend`: this project's engine served by JetStream's orchestrator and gRPC server
(`jax_agent_rl.backends.jetstream.server`, in its own process under ``.venv-jetstream``: JetStream
imports TensorFlow, which stays out of this process), spoken to over JetStream's gRPC API.

What JetStream's API carries decides the `Capabilities`, and the backend refuses, with
`InvalidRequestError`, a request asking for what it cannot honour:

- No logprobs: results carry ``logprobs=None`` and the trainer recomputes them with the learner.
- Sampling is the server's, set when it starts (``temperature``, ``top_k``, ``top_p``): a
  request sampling otherwise is refused, and so is one with a ``seed`` (the server draws each
  request's seed from its own seeded generator).
- Stop ids: the server stops by itself at its own stop ids (the run's end-of-turn tokens);
  this client ends a request at any other of the request's stop ids, or (given ``decode``) at
  the response that completes one of its stop strings, cancelling the rest of its stream. A
  request must stop at every one of the server's ids.
- ``max_tokens`` and abort (cancelling the RPC) are per request. Sessions bring nothing: the
  server keeps no prefix between requests.
- Weights are pushed by reload, through the `WeightGate` every backend shares: new requests
  wait, the ones in flight finish, the new weights (a LoRA model's adapters alone: `push`) go
  through a folder in ``/dev/shm`` that the server's control RPC swaps in without compiling
  again; then the waiting requests go out stamped with the new version.

A server that dies (killed, out of memory) is started again, up to ``max_restarts`` times
(``engine.max_restarts``): it loads the newest weights pushed (the backend keeps the last
push's folder) and every request in flight is sent to it again from its prompt, its partial
tokens dropped (the server draws seeds itself, so the request is sampled afresh, under the
same weights), so no trajectory is trained half-finished; requests sent meanwhile wait for it.
Deaths, restarts and requests sent again are counted (`counters`, as Ray replicas and vLLM
engines count theirs). Past its restarts the server stays down: the requests in flight end
with finish reason ``abort`` (`exited` says why) and later ones raise. `close` stops it (it
also exits with this process).

`pause` / `is_paused` / `resume` hold the backend at a state for tests (the conformance suite
aborts a request it knows to be running, and one waiting), on this client's side (JetStream's
server cannot pause), where aborts act too: a held stream takes no further token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_agent_rl.backends.jetstream.chips import (
    chip_problems,
    free_port,
    host_layout,
    split_chips,
    trainer_env,
)
from jax_agent_rl.backends.jetstream.push import write_push
from jax_agent_rl.backends.jetstream.server import TOKEN_ENV, TOKEN_KEY
from jax_agent_rl.backends.jetstream.start import (
    SERVER_DEFAULTS,
    ServerSampling,
    ServerStartError,
    handshake,
)
from jax_agent_rl.models import ModelConfig, Weights
from jax_agent_rl.models.adapters import LayerAdapters, adapters_of
from jax_agent_rl.protocol import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    PushStats,
    logprob_tolerance,
    validate_request,
)
from jax_agent_rl.rollout.delta import refuse_delta
from jax_agent_rl.rollout.gate import Ticket, WeightGate
from jax_agent_rl.rollout.processes import EngineProcess, interpreter_problems
from jax_agent_rl.rollout.registry import BackendBuild, BackendFactory
from jax_agent_rl.rollout.stops import Decode, stop_string_end

if TYPE_CHECKING:
    from jax_agent_rl.config import EngineSection

ROOT = Path(__file__).resolve().parents[3]
# how long a stream or a load whose server connection failed waits to hear the server died
# before taking it as alive (it then ended the stream itself): a killed process's sockets
# close a moment before its exit is seen
LOSS_GRACE_S = 10.0
DEFAULT_PYTHON = ROOT / ".venv-jetstream" / "bin" / "python"
SETUP_HINT = "build it with `scripts/setup.sh jetstream`"


class JetStreamBackend:
    """`RolloutBackend` over a JetStream server process (see the module docstring).

    The server loads ``checkpoint`` (an HF folder), then ``params`` when given (the learner's
    weights; a LoRA ``model``'s adapters alone) as ``weight_version``; it decodes ``slots``
    sequences together, ``steps`` tokens per engine call, on ``devices`` of its local devices,
    its pool the embedded engine's (``page_size``, ``kv_cache_gib``, ``prefill_chunk``;
    `engine`: what it built). ``chips`` (``engine.jetstream.chips``, "4,5,6,7"): the host's
    TPU chips it opens instead, all its devices (on CPU, as many CPU devices); `placement`:
    what the server reports of them. ``warmup``: it compiles every program before serving.
    A server that dies is started again up to ``max_restarts`` times (module docstring)."""

    def __init__(
        self,
        checkpoint: str | Path,
        model: ModelConfig,
        *,
        params: Weights | None = None,
        python: str | Path = DEFAULT_PYTHON,
        sampling: ServerSampling = SERVER_DEFAULTS,
        max_model_len: int,
        slots: int,
        steps: int = 4,
        page_size: int = 32,
        kv_cache_gib: float = 0.0,
        prefill_chunk: int = 512,
        devices: int = 1,
        chips: str = "",
        dtype: str = "float32",
        weight_version: int = 0,
        seed: int = 0,
        startup_timeout_s: float = 900.0,
        max_in_flight: int = 256,
        decode: Decode | None = None,
        warmup: bool = True,
        max_restarts: int = 3,
    ) -> None:
        python = Path(python)
        if not python.is_file():
            raise ServerStartError(f"no JetStream interpreter at {python}; {SETUP_HINT}")
        placement: dict[str, str] = {}
        if chips:  # (a split that cannot be raises here, before anything starts)
            split = split_chips(chips, host_layout())
            placement = split.server_env(free_port())
            devices = len(split.server_chips)
        self.model = model
        self.sampling = sampling
        self._detokenize = decode  # for stop strings; None: the agent loop cuts at them
        self.capabilities = Capabilities(
            logprobs=False,
            # the server's engine is this project's: were its logprobs returned, they would
            # match the learner's as the embedded backend's do
            logprob_tolerance=logprob_tolerance(dtype),
            per_request_sampling=False,
            stop_token_ids=True,
            abort=True,
            prefix_cache=False,
            weight_update="reload",
            max_model_len=max_model_len,
            lora=model.lora is not None,
        )
        self.last_push: PushStats | None = None
        self.exited: str | None = None  # why the server is gone for good, once it is
        self._dtype = dtype
        self._lock = threading.Lock()
        # each ticket's handle: its gRPC call once sent
        self._gate = WeightGate(weight_version, self._lock)
        # the test hook `pause`: a request and its token count to hold every stream at
        self._pause_at: tuple[str, int] | None = None
        self._paused = False
        self._unheld = threading.Condition(self._lock)  # notified at an abort or a resume
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, "jetstream")
        self._logs = Path(tempfile.mkdtemp(prefix="jarl-jetstream-"))
        token = secrets.token_hex(16)  # the server admits only calls that carry it
        self._metadata = ((TOKEN_KEY, token),)
        self._env = {TOKEN_ENV: token, **placement}
        self._python = python
        self._startup_timeout_s = startup_timeout_s
        self._init_restarts(max_restarts)
        self._config = dict(
            checkpoint=str(checkpoint),
            dtype=dtype,
            max_len=max_model_len,
            slots=slots,
            steps=steps,
            page_size=page_size,
            kv_cache_gib=kv_cache_gib,
            prefill_chunk=prefill_chunk,
            devices=devices,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            stop_ids=list(sampling.stop_token_ids),
            seed=seed,
            lora=None if model.lora is None else dataclasses.asdict(model.lora),
            warmup=warmup,
        )
        self.server = self._spawn()
        try:
            self._connect(self.server.wait_ready(startup_timeout_s, ServerStartError))
            if params is not None:  # on a fresh loop and thread: the caller may be in a loop
                push = self.update_weights(
                    params if model.lora is None else adapters_of(params), weight_version
                )
                self._pool.submit(asyncio.run, push).result()
        except BaseException as e:
            self.server.kill()
            self.server.watcher.join()
            self._pool.shutdown(wait=True)
            if not isinstance(e, ServerStartError):  # (its message names the log: kept)
                shutil.rmtree(self._logs, ignore_errors=True)
            raise
        self._serving = True

    def _init_restarts(self, max_restarts: int) -> None:
        self._max_restarts = max_restarts
        self._counts = {"replica_deaths": 0, "replica_restarts": 0, "requests_requeued": 0}
        # the server's generation (how many started before it), bumped when one starts again;
        # `_changed` is notified then, and when the server is down for good
        self._generation = 0
        self._changed = threading.Condition(self._lock)
        self._serving = False  # restarts begin once the first server has started
        self._dead = -1  # the newest generation whose server has exited
        self._starting: EngineProcess | None = None  # a server starting again
        # the last push's `Load` request (its folder kept) for a server that starts again;
        # held from a push's load to its keeping, and by a restart's load
        self._newest: dict[str, Any] | None = None
        self._newest_lock = threading.Lock()

    def _spawn(self, n: int = 0) -> EngineProcess:
        """The ``n``-th server process to start (its log: ``server.log``, then
        ``server.1.log``, ...)."""
        self.log = self._logs / ("server.log" if n == 0 else f"server.{n}.log")
        return EngineProcess(
            "JetStream server",
            self._python,
            "jax_agent_rl.backends.jetstream.server",
            self._config,
            root=ROOT,
            log=self.log,
            env=self._env,
            messages=handshake,
            on_exit=functools.partial(self._on_exit, n),
        )

    def _connect(self, ready: dict[str, Any]) -> None:
        """Checks a started server's ready message and opens a channel to it (this backend's
        from then on)."""
        if ready["vocab_size"] != self.model.vocab_size:
            raise ServerStartError(
                f"the JetStream server sees vocab_size={ready['vocab_size']}, "
                f"the model config {self.model.vocab_size}"
            )
        import grpc
        from jetstream.core.proto import jetstream_pb2_grpc

        self.port: int = ready["port"]  # on 127.0.0.1
        self.devices: int = ready["devices"]  # the server's
        self.placement: dict[str, str] = ready["placement"]  # as its own process sees it
        self.engine: dict[str, int] = ready["engine"]  # page_size, num_pages, ...
        self._channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self._stub = jetstream_pb2_grpc.OrchestratorStub(self._channel)
        self._load = self._channel.unary_unary("/jarl.Control/Load")

    @property
    def weight_version(self) -> int:
        return self._gate.version

    @property
    def proc(self) -> Any:
        """The server process (it leads a process group)."""
        return self.server.proc

    @property
    def pids(self) -> list[int]:
        return [self.server.pid]

    def counters(self) -> dict[str, float]:
        """Totals so far: server deaths, restarts, requests sent again to a restarted one."""
        with self._lock:
            return {f"rollout/{k}": float(v) for k, v in self._counts.items()}

    def in_flight(self) -> list[str]:
        """The requests sent to the server and not finished yet."""
        return [t.request_id for t in self._gate.tickets() if t.handle is not None]

    def log_errors(self) -> str:
        """The exception lines of the server's log."""
        return self.server.log_errors()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        validate_request(request, self.model.vocab_size, self.capabilities.max_model_len)
        self._refuse_unservable(request)
        loop = asyncio.get_running_loop()
        rid = request.request_id
        if self.exited is not None and not self._gate.closed:
            raise RuntimeError(f"the JetStream server has exited ({self.exited})")
        ticket = self._gate.enter(rid)
        try:
            if not await self._gate.admit(ticket):
                return self._result([], "abort", self._gate.version)  # aborted meanwhile
            try:
                tokens, finish, resent = await loop.run_in_executor(
                    self._pool, self._stream, request, ticket
                )
            except RuntimeError:  # the pool was shut down: the backend closed meanwhile
                if not self._gate.closed:
                    raise
                tokens, finish, resent = [], "abort", 0
            return self._result(tokens, finish, ticket.version, resent)
        except asyncio.CancelledError:
            await self.abort(rid)  # while the call is still known: its stream is cancelled
            raise
        finally:
            self._gate.done(ticket)

    async def abort(self, request_id: str) -> None:
        ticket = self._gate.abort(request_id)  # one not sent yet will not be
        if ticket is None:
            return
        with self._lock:
            rpc = ticket.handle
            self._unheld.notify_all()
        if rpc is not None:
            rpc.cancel()

    def pause(self, request_id: str, tokens: int = 1) -> None:
        """Test hook: from now on every stream but ``request_id``'s takes no token, and that
        one takes ``tokens``; then the pause has taken effect. Aborts are still served.
        `resume` lets every stream go on."""
        with self._lock:
            self._pause_at = (request_id, tokens)

    def is_paused(self) -> bool:
        """Whether a `pause` has taken effect (and no `resume` followed)."""
        with self._lock:
            return self._paused

    def resume(self) -> None:
        with self._lock:
            self._pause_at, self._paused = None, False
            self._unheld.notify_all()

    async def update_weights(self, params: Weights | LayerAdapters, version: int) -> None:
        refuse_delta(params, "a JetStream server")

        async def push() -> None:
            if self.exited is not None:
                raise RuntimeError(f"the JetStream server has exited ({self.exited})")
            await self._push(params)

        held = await self._gate.update(push, version)
        self.last_push = self.last_push and self.last_push.held(held)

    async def close(self) -> None:
        tickets = self._gate.close()
        with self._lock:
            starting = self._starting
            self._changed.notify_all()  # streams waiting on a restart end
        if starting is not None:  # its restart sees the gate closed and ends
            starting.kill()
        self._cancel(tickets)
        await asyncio.to_thread(self._stop)
        if self._newest is not None:
            shutil.rmtree(self._newest["path"], ignore_errors=True)
            self._newest = None
        shutil.rmtree(self._logs, ignore_errors=True)

    def _refuse_unservable(self, request: GenerateRequest) -> None:
        s, server, rid = request.sampling, self.sampling, request.request_id
        for key in ("temperature", "top_k", "top_p"):  # fields of both
            value, served = getattr(s, key), getattr(server, key)
            if value != served:
                raise InvalidRequestError(
                    f"request {rid!r}: {key}={value}, but the JetStream server samples every "
                    f"request with {key}={served} (set when it starts: sampling.{key})"
                )
        if s.seed is not None:
            raise InvalidRequestError(
                f"request {rid!r}: seed={s.seed}, but the JetStream server draws each "
                "request's seed itself (send seed=None)"
            )
        missing = sorted(set(server.stop_token_ids) - set(s.stop_token_ids))
        if missing:
            raise InvalidRequestError(
                f"request {rid!r}: the JetStream server stops every request at "
                f"{list(server.stop_token_ids)}; this request does not stop at {missing}"
            )

    def _cancel(self, tickets: list[Ticket]) -> None:
        """Ends the streams of ``tickets`` (aborted already): held ones and sent ones."""
        with self._lock:
            rpcs = [t.handle for t in tickets if t.handle is not None]
            self._unheld.notify_all()
        for rpc in rpcs:
            rpc.cancel()

    def _stream(
        self, request: GenerateRequest, ticket: Ticket
    ) -> tuple[list[int], FinishReason, int]:
        """Runs on a pool thread: the request's stream, until its stop id, its budget, its
        end, an abort or the server's death; sent again whole to a server started again (how
        many times: the third of what it returns)."""
        resent = 0
        while True:
            generation = self._generation
            tokens, finish = self._attempt(request, ticket)
            if finish is not None:
                return tokens, finish, resent
            if not self._came_back(generation):
                return tokens, "abort", resent
            resent += 1
            with self._lock:
                self._counts["requests_requeued"] += 1

    def _attempt(
        self, request: GenerateRequest, ticket: Ticket
    ) -> tuple[list[int], FinishReason | None]:
        """One stream of ``request`` on the server of now; finish None: the connection failed
        (the server may have died) and the request was not aborted."""
        import grpc
        from jetstream.core.proto import jetstream_pb2

        room = self.capabilities.max_model_len - len(request.prompt_ids)
        budget = min(request.sampling.max_tokens, room)
        decode = jetstream_pb2.DecodeRequest(
            session_cache="token-ids",  # non-empty: JetStream puts no BOS before the prompt
            max_tokens=budget,
            token_content=jetstream_pb2.DecodeRequest.TokenContent(
                token_ids=list(request.prompt_ids)
            ),
        )
        with self._lock:
            if ticket.aborted or self._gate.closed:
                return [], "abort"
            try:
                rpc = ticket.handle = self._stub.Decode(decode, metadata=self._metadata)
            except ValueError:  # the channel closed: the backend is closing, or a restart
                return [], None
        tokens: list[int] = []
        try:
            end = self._read(rpc, request, ticket, budget, tokens)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(f"request {request.request_id!r}: {e.details()}") from e
            end = None  # cancelled (aborted), or the server is gone or going
        else:
            if end is None and len(tokens) == room:  # the server ended it at the model length
                end = (len(tokens), "length")
        if end is not None:
            return tokens[: end[0]], end[1]
        return tokens, "abort" if ticket.aborted or self._gate.closed else None

    def _read(
        self,
        rpc: Any,
        request: GenerateRequest,
        ticket: Ticket,
        budget: int,
        tokens: list[int],
    ) -> tuple[int, FinishReason] | None:
        """Reads ``rpc``'s stream into ``tokens`` until the request ends (the tokens it keeps,
        why) or the stream does (None)."""
        for response in rpc:
            new = 0
            for token in response.stream_content.samples[0].token_ids:
                if not self._take(ticket, len(tokens)):
                    return len(tokens), "abort"
                tokens.append(token)
                new += 1
                if token in request.sampling.stop_token_ids or len(tokens) == budget:
                    break
            end = self._end(request, tokens, new, budget)
            if end is not None:
                rpc.cancel()  # the rest of the stream is not wanted
                return end
        return None

    def _came_back(self, generation: int) -> bool:
        """After a failed connection to the ``generation``-th server: whether a new server
        took its place (False: it is down for good, the backend closed, or it never died)."""
        deadline = time.monotonic() + LOSS_GRACE_S
        with self._changed:
            while self._generation == generation:
                if self.exited is not None or self._gate.closed:
                    return False
                if self._dead == generation:
                    self._changed.wait()  # its restart (or its end) notifies
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False  # alive: it ended the stream itself
                self._changed.wait(left)
            return not self._gate.closed

    def _end(
        self, request: GenerateRequest, tokens: list[int], new: int, budget: int
    ) -> tuple[int, FinishReason] | None:
        """Where a stream ends once ``new`` more tokens came, (tokens kept, why): at a stop
        string (the tokens after the one completing it dropped: `stop_string_end`), a stop
        id or the budget; None while it goes on."""
        if self._detokenize is not None:
            end = stop_string_end(self._detokenize, tokens, request.sampling.stop, new)
            if end is not None:
                return end, "stop"
        if new and tokens[-1] in request.sampling.stop_token_ids:
            return len(tokens), "stop"
        return (len(tokens), "length") if len(tokens) == budget else None

    def _take(self, ticket: Ticket, taken: int) -> bool:
        """Runs on a stream's thread before it takes a token: waits while a `pause` holds the
        stream; False when it was aborted meanwhile."""
        if self._pause_at is None and not self._paused:  # no pause: no lock taken per token
            return True
        with self._lock:
            while not ticket.aborted and self._held(ticket.request_id, taken):
                self._unheld.wait()
            return not ticket.aborted

    def _held(self, request_id: str, taken: int) -> bool:
        """Whether a stream that has taken ``taken`` tokens is held (the lock is held)."""
        if self._pause_at is not None:
            rid, tokens = self._pause_at
            if request_id == rid and taken < tokens:
                return False
            if request_id == rid:  # its tokens are in: the pause takes effect
                self._paused = True  # before `_pause_at` clears, for `_take`'s unlocked look
                self._pause_at = None
            return True
        return self._paused

    async def _push(self, params: Weights | LayerAdapters) -> None:
        t0 = time.perf_counter()
        load, size = await asyncio.to_thread(write_push, self.model, self._dtype, params)
        try:
            t1 = time.perf_counter()
            reply = await asyncio.to_thread(self._load_newest, load)
        except BaseException:
            shutil.rmtree(load["path"], ignore_errors=True)
            raise
        self.last_push = PushStats(size, t1 - t0, reply["seconds"], time.perf_counter() - t0)

    def _load_newest(self, load: dict[str, Any]) -> dict[str, Any]:
        """Loads ``load`` on the server, on the one started again if it died meanwhile, and
        keeps it as the newest weights (the last push's folder goes)."""
        while True:
            generation = self._generation
            with self._newest_lock:
                try:
                    reply = self._load_on_server(load, self._load)
                except _ServerLostError as lost:
                    error = lost
                else:
                    if self._newest is not None:
                        shutil.rmtree(self._newest["path"], ignore_errors=True)
                    self._newest = load
                    return reply
            if not self._came_back(generation):
                raise RuntimeError(
                    f"the JetStream server could not load the weights: {error}"
                ) from error

    def _load_on_server(self, load: dict[str, Any], call: Any) -> dict[str, Any]:
        import grpc

        try:
            reply = call(json.dumps(load).encode(), metadata=self._metadata)
        except grpc.RpcError as e:
            details = e.details()
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise _ServerLostError(details) from e
            raise RuntimeError(f"the JetStream server could not load the weights: {details}") from e
        except ValueError as e:  # the channel closed under it
            if self._gate.closed:
                raise RuntimeError("the backend closed during a weight update") from e
            raise _ServerLostError("its channel closed") from e
        return json.loads(reply)

    def _on_exit(self, generation: int, code: int) -> None:
        """Runs on the ``generation``-th server's watcher thread once it has exited: a
        restart (`_restart`) or, past them, the end of what is in flight."""
        with self._lock:
            self._dead = max(self._dead, generation)
            restart = self._serving and not self._gate.closed and generation == self._generation
            if restart:
                self._counts["replica_deaths"] += 1
                restart = generation < self._max_restarts
            if not restart and generation == self._generation:
                self.exited = f"exit code {code}"
            self._changed.notify_all()
        if restart:
            threading.Thread(target=self._restart, name="jetstream-restart", daemon=True).start()
        elif generation == self._generation:
            self._end_in_flight()

    def _end_in_flight(self) -> None:
        tickets = self._gate.tickets()
        for ticket in tickets:
            self._gate.abort(ticket.request_id)
        self._cancel(tickets)

    def _restart(self) -> None:
        """Starts the server again (in a thread of its own) with the newest weights; the
        streams waiting on it then go out again. One that fails to start counts as another
        death, within the restarts."""
        import grpc

        n = self._generation
        while True:
            n += 1
            server: EngineProcess | None = None
            try:
                with self._lock:
                    if self._gate.closed:
                        return
                    server = self._starting = self._spawn(n)
                ready = server.wait_ready(self._startup_timeout_s, ServerStartError)
                channel = grpc.insecure_channel(f"127.0.0.1:{ready['port']}")
                with self._newest_lock:
                    if self._newest is not None:
                        load = channel.unary_unary("/jarl.Control/Load")
                        self._load_on_server(self._newest, load)
                    with self._lock:
                        if self._gate.closed:
                            raise RuntimeError("the backend closed during a restart")
                        old = self._channel
                        self.server, self._starting = server, None
                        self._connect(ready)
                        channel.close()  # (`_connect` opened the backend's own)
                        self._generation = n
                        self._counts["replica_restarts"] += 1
                        self._changed.notify_all()
                old.close()
                return
            except Exception as e:
                if server is not None:
                    server.kill()
                with self._lock:
                    self._starting = None
                    down = self._gate.closed or n >= self._max_restarts
                    if down:
                        self.exited = f"could not start again: {type(e).__name__}: {e}"
                    else:
                        self._counts["replica_deaths"] += 1
                    self._changed.notify_all()
                if down:
                    self._end_in_flight()
                    return

    def _stop(self, timeout_s: float = 30.0) -> None:
        stdin = self.server.proc.stdin
        assert stdin is not None
        if hasattr(self, "_channel"):
            self._channel.close()
        with contextlib.suppress(OSError):
            stdin.close()  # the server's signal to stop
        self.server.stop(timeout_s)
        self._pool.shutdown(wait=True)

    def _result(
        self, tokens: list[int], finish: FinishReason, version: int, resent: int = 0
    ) -> GenerateResult:
        return GenerateResult(
            token_ids=tuple(tokens),
            logprobs=None,
            finish_reason=finish,
            weight_version=version if tokens else self._gate.version,
            resent=resent,
        )


class _ServerLostError(RuntimeError):
    """The server's connection failed under a call: it died, or is dying."""


def _build(spec: BackendBuild) -> JetStreamBackend:
    r, s = spec.engine, spec.sampling
    return JetStreamBackend(
        spec.checkpoint,
        spec.model,
        params=spec.params,
        python=r.jetstream.python or DEFAULT_PYTHON,
        sampling=ServerSampling(s.temperature, s.top_k, s.top_p, tuple(spec.stop_token_ids)),
        max_model_len=r.max_model_len,
        slots=r.max_concurrent,
        steps=r.steps_per_call,
        page_size=r.page_size,
        kv_cache_gib=r.kv_cache_gib,
        prefill_chunk=r.prefill_chunk,
        chips=r.jetstream.chips,
        dtype=spec.dtype,
        weight_version=spec.version,
        seed=spec.seed,
        decode=spec.decode,
        warmup=r.warmup,
        max_restarts=r.max_restarts,
    )


def _check(engine: EngineSection, processes: int) -> list[str]:
    return interpreter_problems(
        "jetstream.python", engine.jetstream.python, DEFAULT_PYTHON, "JetStream", "jetstream"
    ) + chip_problems(engine.jetstream.chips, processes, engine.max_concurrent)


# `engine.backend=jetstream`, found through the entry point in pyproject.toml
FACTORY = BackendFactory(
    build=_build, check=_check, trainer_env=lambda r: trainer_env(r.jetstream.chips)
)
