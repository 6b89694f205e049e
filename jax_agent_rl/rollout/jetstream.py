"""`JetStreamBackend`: this project's engine served by JetStream's orchestrator and gRPC server
(`jax_agent_rl.rollout.jetstream_server`, in its own process under ``.venv-jetstream``: JetStream
imports TensorFlow, which stays out of this process), spoken to over JetStream's gRPC API.

What JetStream's API carries decides the `Capabilities`, and the backend refuses, with
`InvalidRequestError`, a request asking for what it cannot honour:

- No logprobs: results carry ``logprobs=None`` and the trainer recomputes them with the learner.
- Sampling is the server's, set when it starts (``temperature``, ``top_k``, ``top_p``): a
  request sampling otherwise is refused, and so is one with a ``seed`` (the server draws each
  request's seed from its own seeded generator).
- Stop ids: the server stops by itself at its own stop ids (the run's end-of-turn tokens);
  this client ends a request at any other of the request's stop ids, cancelling the rest of
  its stream. A request must stop at every one of the server's ids.
- ``max_tokens`` and abort (cancelling the RPC) are per request. Sessions bring nothing: the
  server keeps no prefix between requests.
- Weights are pushed by reload: new requests wait, the ones in flight finish, the new weights
  go through a folder in ``/dev/shm`` (an HF checkpoint) and the server's control RPC swaps
  them in without compiling again; then the waiting requests go out stamped with the new
  version.

A server that dies ends the requests in flight with finish reason ``abort`` (the agent loop
marks those trajectories aborted; `JetStreamBackend.exited` says why), and later requests
raise. `close` stops the server (it also exits when this process goes: it serves until its
stdin closes).

`pause` / `is_paused` / `resume` hold the backend at a state for tests (the conformance suite
aborts a request it knows to be running, and one it knows to be waiting). JetStream's server
cannot be paused, so the hold is on this client's side, which is where an abort takes effect
here too: a held stream takes no further token (the server's go on waiting in its buffer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_agent_rl.models import ModelConfig, Weights, save_hf
from jax_agent_rl.rollout.jetstream_server import TOKEN_ENV, TOKEN_KEY
from jax_agent_rl.rollout.processes import interpreter_problems, kill_group, log_exceptions
from jax_agent_rl.rollout.protocol import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    resolve_from_thread,
    validate_request,
)
from jax_agent_rl.rollout.registry import BackendBuild, BackendFactory

if TYPE_CHECKING:
    from jax_agent_rl.config import RolloutSection

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ROOT / ".venv-jetstream" / "bin" / "python"
SETUP_HINT = "build it with `scripts/setup.sh jetstream`"
SHM_DIR = Path("/dev/shm")


class ServerStartError(RuntimeError):
    """A JetStream server that could not start; the message says why."""


@dataclasses.dataclass(frozen=True)
class ServerSampling:
    """How the server samples every request (the rollout section's settings)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PushStats:
    """The last weight push: bytes written, seconds to write them here and to load them there."""

    bytes: int
    write_s: float
    load_s: float
    total_s: float


@dataclasses.dataclass
class _Call:
    """A request on its way: the gate it waits at while a weight update runs, its gRPC call
    once sent, and whether it was aborted (it then sends nothing more)."""

    request: GenerateRequest
    version: int = 0
    gate: tuple[asyncio.Future[bool], asyncio.AbstractEventLoop] | None = None
    rpc: Any = None
    aborted: bool = False


class JetStreamBackend:
    """`RolloutBackend` over a JetStream server process (see the module docstring).

    The server loads ``checkpoint`` (an HF folder), then ``params`` when given (the learner's
    weights) as ``weight_version``; it decodes ``slots`` sequences together, ``steps`` tokens
    per engine call, on ``devices`` of its local devices.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        model: ModelConfig,
        *,
        params: Weights | None = None,
        python: str | Path = DEFAULT_PYTHON,
        sampling: ServerSampling = ServerSampling(),
        max_model_len: int,
        slots: int,
        steps: int = 4,
        devices: int = 1,
        dtype: str = "float32",
        weight_version: int = 0,
        seed: int = 0,
        startup_timeout_s: float = 900.0,
        max_in_flight: int = 256,
    ) -> None:
        python = Path(python)
        if not python.is_file():
            raise ServerStartError(f"no JetStream interpreter at {python}; {SETUP_HINT}")
        self.model = model
        self.sampling = sampling
        self.capabilities = Capabilities(
            logprobs=False,
            # the server's engine is this project's: were its logprobs returned, they would
            # match the learner's as the embedded backend's do
            logprob_tolerance=1e-4 if dtype == "float32" else 5e-2,
            per_request_sampling=False,
            stop_token_ids=True,
            abort=True,
            prefix_cache=False,
            weight_update="reload",
            max_model_len=max_model_len,
        )
        self.last_push: PushStats | None = None
        self.exited: str | None = None  # why the server is gone, once it is
        self._dtype = dtype
        self._version = weight_version
        self._lock = threading.Lock()
        self._closed = False
        self._calls: dict[str, _Call] = {}  # every request not finished, gated or sent
        self._sending: set[str] = set()  # those past the gate (an update drains them)
        self._drained: tuple[asyncio.Future[None], asyncio.AbstractEventLoop] | None = None
        self._updating = False
        # the test hook `pause`: a request and its token count to hold every stream at
        self._pause_at: tuple[str, int] | None = None
        self._paused = False
        self._unheld = threading.Condition(self._lock)  # notified at an abort or a resume
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, "jetstream")
        self._logs = Path(tempfile.mkdtemp(prefix="jarl-jetstream-"))
        token = secrets.token_hex(16)  # the server admits only calls that carry it
        self._metadata = ((TOKEN_KEY, token),)
        self.log = self._logs / "server.log"
        config = dict(
            checkpoint=str(checkpoint),
            dtype=dtype,
            max_len=max_model_len,
            slots=slots,
            steps=steps,
            devices=devices,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            stop_ids=list(sampling.stop_token_ids),
            seed=seed,
        )
        with self.log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [str(python), "-m", "jax_agent_rl.rollout.jetstream_server", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, "PYTHONPATH": str(ROOT), TOKEN_ENV: token},
                start_new_session=True,  # its own process group: close() reaps all of it
            )
        self._ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._watcher = threading.Thread(target=self._watch, name="jetstream-watch", daemon=True)
        self._watcher.start()
        try:
            ready = self._await_ready(startup_timeout_s)
            import grpc
            from jetstream.core.proto import jetstream_pb2_grpc

            self.port: int = ready["port"]  # on 127.0.0.1
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
            self._stub = jetstream_pb2_grpc.OrchestratorStub(self._channel)
            self._load = self._channel.unary_unary("/jarl.Control/Load")
            if params is not None:  # on a fresh loop and thread: the caller may be in a loop
                push = self.update_weights(params, weight_version)
                self._pool.submit(asyncio.run, push).result()
        except BaseException as e:
            self._kill()
            self._watcher.join()
            self._pool.shutdown(wait=True)
            if not isinstance(e, ServerStartError):  # (its message names the log: kept)
                shutil.rmtree(self._logs, ignore_errors=True)
            raise

    def _await_ready(self, timeout_s: float) -> dict[str, Any]:
        try:
            ready = self._ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self._kill()
            message = f"the JetStream server did not start within {timeout_s:.0f} s"
        else:
            message = ready.get("error", "")
        if message:
            self._kill()
            self._watcher.join()
            raise ServerStartError(f"{message}\nits log, {self.log}, says:\n{self.log_errors()}")
        if ready["vocab_size"] != self.model.vocab_size:
            raise ServerStartError(
                f"the JetStream server sees vocab_size={ready['vocab_size']}, "
                f"the model config {self.model.vocab_size}"
            )
        return ready

    # ------------------------------------------------------------------ asyncio-facing API

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def pids(self) -> list[int]:
        """The server process (it leads a process group)."""
        return [self.proc.pid]

    def in_flight(self) -> list[str]:
        """The requests sent to the server and not finished yet."""
        with self._lock:
            return [rid for rid, call in self._calls.items() if call.rpc is not None]

    def log_errors(self) -> str:
        """The exception lines of the server's log."""
        return log_exceptions(self.log)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        validate_request(request, self.model.vocab_size, self.capabilities.max_model_len)
        self._refuse_unservable(request)
        loop = asyncio.get_running_loop()
        rid = request.request_id
        call = _Call(request)
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if self.exited is not None:
                raise RuntimeError(f"the JetStream server has exited ({self.exited})")
            if rid in self._calls:
                raise InvalidRequestError(f"request_id {rid!r} is already in flight")
            self._calls[rid] = call
            if self._updating:  # it waits for the update's end (`update_weights` lets it go)
                call.gate = (loop.create_future(), loop)
            else:  # stamped with the version it starts under
                self._send(call)
        try:
            if call.gate is not None and not await call.gate[0]:
                return self._result([], "abort", self._version)  # aborted or closed meanwhile
            try:
                tokens, finish = await loop.run_in_executor(self._pool, self._stream, call)
            except RuntimeError:  # the pool was shut down: the backend closed meanwhile
                if not self._closed:
                    raise
                tokens, finish = [], "abort"
            return self._result(tokens, finish, call.version)
        except asyncio.CancelledError:
            await self.abort(rid)  # while the call is still known: its stream is cancelled
            raise
        finally:
            with self._lock:
                del self._calls[rid]
                self._sending.discard(rid)
                drained = self._drained if not self._sending else None
            if drained is not None:
                resolve_from_thread(drained[0], drained[1], None)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            call = self._calls.get(request_id)
            if call is None:
                return
            call.aborted = True  # a call not sent yet will not be
            gate, rpc = call.gate, call.rpc
            self._unheld.notify_all()
        if gate is not None:
            resolve_from_thread(gate[0], gate[1], False)
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

    async def update_weights(self, params: Weights, version: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if self._updating:
                raise RuntimeError("a weight update is already under way")
            self._updating = True
            if self._sending:
                self._drained = (loop.create_future(), loop)
        try:
            if self._drained is not None:
                await self._drained[0]
            if self._closed:
                raise RuntimeError("the backend is closed")
            if self.exited is not None:
                raise RuntimeError(f"the JetStream server has exited ({self.exited})")
            await self._push(params)
            self._version = version
        finally:
            with self._lock:
                self._updating, self._drained = False, None
                waiting = [c for c in self._calls.values() if c.gate and not c.gate[0].done()]
                for call in waiting:  # sent (and counted) before any later update can start
                    self._send(call)
            for call in waiting:
                assert call.gate is not None
                resolve_from_thread(call.gate[0], call.gate[1], not call.aborted)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            calls = list(self._calls.values())
            for call in calls:
                call.aborted = True
            self._unheld.notify_all()
        for call in calls:
            if call.gate is not None:
                resolve_from_thread(call.gate[0], call.gate[1], False)
            if call.rpc is not None:
                call.rpc.cancel()
        await asyncio.to_thread(self._stop)
        shutil.rmtree(self._logs, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _refuse_unservable(self, request: GenerateRequest) -> None:
        s, server, rid = request.sampling, self.sampling, request.request_id
        asked = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        served = {"temperature": server.temperature, "top_k": server.top_k, "top_p": server.top_p}
        for key, value in asked.items():
            if value != served[key]:
                raise InvalidRequestError(
                    f"request {rid!r}: {key}={value}, but the JetStream server samples every "
                    f"request with {key}={served[key]} (set when it starts: rollout.{key})"
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

    def _send(self, call: _Call) -> None:
        """Marks ``call`` as going out now, under the current weights (the lock is held)."""
        call.version = self._version
        self._sending.add(call.request.request_id)

    def _stream(self, call: _Call) -> tuple[list[int], FinishReason]:
        """Runs on a pool thread: the request's stream, until its stop id, its budget, its
        end, an abort or the server's death."""
        import grpc
        from jetstream.core.proto import jetstream_pb2

        request = call.request
        room = self.capabilities.max_model_len - len(request.prompt_ids)
        budget = min(request.sampling.max_tokens, room)
        stops = set(request.sampling.stop_token_ids)
        decode = jetstream_pb2.DecodeRequest(
            session_cache="token-ids",  # non-empty: JetStream puts no BOS before the prompt
            max_tokens=budget,
            token_content=jetstream_pb2.DecodeRequest.TokenContent(
                token_ids=list(request.prompt_ids)
            ),
        )
        with self._lock:
            if call.aborted or self._closed:
                return [], "abort"
            try:
                call.rpc = self._stub.Decode(decode, metadata=self._metadata)
            except ValueError:  # the channel closed: the backend is closing
                return [], "abort"
        tokens: list[int] = []
        try:
            for response in call.rpc:
                for token in response.stream_content.samples[0].token_ids:
                    if not self._take(call, len(tokens)):
                        return tokens, "abort"
                    tokens.append(token)
                    if token in stops or len(tokens) == budget:
                        call.rpc.cancel()  # the rest of the stream is not wanted
                        return tokens, "stop" if token in stops else "length"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(f"request {request.request_id!r}: {e.details()}") from e
            return tokens, "abort"  # cancelled (aborted) or the server is gone
        # the server ended the stream: its model length, or it is going away
        return tokens, "length" if len(tokens) == room else "abort"

    def _take(self, call: _Call, taken: int) -> bool:
        """Runs on a stream's thread before it takes a token: waits while a `pause` holds the
        stream; False when it was aborted meanwhile."""
        if self._pause_at is None and not self._paused:  # no pause: no lock taken per token
            return True
        with self._lock:
            while not call.aborted and self._held(call.request.request_id, taken):
                self._unheld.wait()
            return not call.aborted

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

    async def _push(self, params: Weights) -> None:
        t0 = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix="jarl-weights-", dir=SHM_DIR))
        try:
            cfg = dataclasses.replace(self.model, dtype=self._dtype)  # type: ignore[arg-type]
            await asyncio.to_thread(save_hf, folder, cfg, params)
            t1 = time.perf_counter()
            size = sum(f.stat().st_size for f in folder.iterdir())
            reply = await asyncio.to_thread(self._load_on_server, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.last_push = PushStats(size, t1 - t0, reply["seconds"], time.perf_counter() - t0)

    def _load_on_server(self, folder: Path) -> dict[str, Any]:
        import grpc

        try:
            request = json.dumps({"path": str(folder)}).encode()
            reply = self._load(request, metadata=self._metadata)
        except grpc.RpcError as e:
            details = e.details()
            raise RuntimeError(f"the JetStream server could not load the weights: {details}") from e
        except ValueError as e:  # the channel closed under it
            raise RuntimeError("the backend closed during a weight update") from e
        return json.loads(reply)

    def _watch(self) -> None:
        """Reads the server's ready line, then waits for its exit and ends what is in flight."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        message = json.loads(line) if line else {"error": "the JetStream server exited"}
        self._ready.set_result(message)
        self.proc.stdout.read()  # until the server's end
        code = self.proc.wait()
        with self._lock:
            self.exited = f"exit code {code}"
            rpcs = [c.rpc for c in self._calls.values() if c.rpc is not None]
            for call in self._calls.values():
                call.aborted = True
            self._unheld.notify_all()
        for rpc in rpcs:
            rpc.cancel()

    def _stop(self, timeout_s: float = 30.0) -> None:
        assert self.proc.stdin is not None
        if hasattr(self, "_channel"):
            self._channel.close()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the server's signal to stop
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        self._kill()
        self._watcher.join()
        self._pool.shutdown(wait=True)

    def _kill(self) -> None:
        """SIGKILL to the server's process group."""
        kill_group(self.proc)

    def _result(self, tokens: list[int], finish: FinishReason, version: int) -> GenerateResult:
        return GenerateResult(
            token_ids=tuple(tokens),
            logprobs=None,
            finish_reason=finish,
            weight_version=version if tokens else self._version,
        )


def _build(spec: BackendBuild) -> JetStreamBackend:
    r = spec.rollout
    return JetStreamBackend(
        spec.checkpoint,
        spec.model,
        params=spec.params,
        python=r.jetstream_python or DEFAULT_PYTHON,
        sampling=ServerSampling(r.temperature, r.top_k, r.top_p, tuple(spec.stop_token_ids)),
        max_model_len=r.max_model_len,
        slots=r.max_concurrent,
        steps=r.steps_per_call,
        dtype=spec.dtype,
        weight_version=spec.version,
        seed=spec.seed,
    )


def _check(rollout: RolloutSection) -> list[str]:
    return interpreter_problems(
        "jetstream_python", rollout.jetstream_python, DEFAULT_PYTHON, "JetStream", "jetstream"
    )


# `rollout.backend=jetstream`, found through the entry point in pyproject.toml
FACTORY = BackendFactory(build=_build, check=_check)
