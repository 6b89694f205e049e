"""`VLLMBackend`: vLLM engine processes behind the `RolloutBackend` protocol.

The backend starts ``replicas`` engine processes (`gpu_backend.vllm_worker`, under the vLLM
venv's interpreter: vLLM never loads into this process, so never beside JAX or TensorFlow),
each in its own process group, and talks to each over a pipe (`gpu_backend.wire`). One reader
thread per engine resolves the asyncio futures of the calls waiting on it, so the event loop
never blocks and any event loop may call in.

Routing: a request with a ``session_id`` goes to the engine that served the session's earlier
turns (vLLM's prefix cache then holds them), a session's first to the engine of the session it
continues (``prefix_session``, a tree rollout's branch); any other request goes to the engine
with the fewest requests in flight.

Weight updates drain, as the embedded backend does: new requests wait, requests in flight
finish under the weights they started with, then every engine loads the new weights and resets
its prefix cache, and the waiting requests go out stamped with the new version. The weights
travel through one file in ``/dev/shm``, written once from `hf_tensors` (the HF export's
name/transpose table) and read in place by every engine. The CUDA path (IPC handles or NCCL
through the same ``load`` message) is described in docs/vllm.md and not written yet.

An engine that dies ends its requests in flight with finish reason ``abort`` (the agent loop
marks those trajectories ``aborted``); new requests go to the engines still alive, and with
none left they raise. `close` stops every engine and its children.

With ``pausable``, `pause` / `is_paused` / `resume` hold an engine at a state for tests (the
conformance suite aborts a request it knows to be running, and one it knows to be queued):
the engine pauses itself in the step where a given request produces its n-th token, so the
state cannot run past while the test looks at it; aborts are served meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_backend import wire
from jax_agent_rl.models import ModelConfig, Weights, hf_tensors
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SETUP_HINT = "build it with `scripts/setup.sh vllm`"
# fp32 on CPU, against the learner's recomputation (tests/conformance): both sides compute the
# same fp32 forward in a different summation order; differences seen are ~1e-5 (see docs/vllm.md)
FP32_LOGPROB_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 5e-2


class EngineStartError(RuntimeError):
    """A vLLM engine that could not start; the message says why and how to fix it."""


@dataclasses.dataclass(frozen=True)
class PushStats:
    """The last weight push: bytes moved, seconds to convert and write them (this process),
    and the slowest engine's seconds to load them and reset its prefix cache."""

    bytes: int
    write_s: float
    load_s: float
    total_s: float


@dataclasses.dataclass
class _Call:
    """A caller awaiting an engine: its future, its loop, and (generate) what it asked."""

    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    request: GenerateRequest | None = None
    version: int = 0


class _Engine:
    """One engine process: its pipe, what is in flight on it, and its reader thread."""

    def __init__(
        self, index: int, command: list[str], env: dict[str, str], log: Path, on_message: Any
    ) -> None:
        self.index = index
        self.log = log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                # spawn, not fork: vLLM's children must not inherit this pipe's write end, or
                # the engine's death would not end the stream
                env={
                    **os.environ,
                    **env,
                    "PYTHONPATH": str(ROOT),
                    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                },
                start_new_session=True,  # its own process group: close() reaps its children too
            )
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.calls: dict[str, _Call] = {}
        self.load: _Call | None = None
        self.dead: str | None = None
        self.paused = False
        self._write_lock = threading.Lock()
        self._on_message = on_message
        self.reader = threading.Thread(target=self._read, name=f"vllm-{index}", daemon=True)
        self.reader.start()

    def send(self, message: dict[str, Any]) -> bool:
        """Whether the message went out (False: the engine is gone)."""
        assert self.proc.stdin is not None
        try:
            with self._write_lock:
                wire.write_message(self.proc.stdin, message)  # type: ignore[arg-type]
        except (BrokenPipeError, ValueError):
            return False
        return True

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while (message := wire.read_message(self.proc.stdout)) is not None:  # type: ignore[arg-type]
            self._on_message(self, message)
        self._on_message(self, {"op": "exit"})

    def log_errors(self) -> str:
        """The exception lines of its log, where vLLM's root cause of a failure is."""
        return log_exceptions(self.log)

    def kill(self) -> None:
        """SIGKILL to the whole process group (the engine's own children included)."""
        kill_group(self.proc)


class VLLMBackend:
    """`RolloutBackend` over vLLM engine processes (see the module docstring).

    The engines load ``checkpoint`` (an HF folder), then ``params`` when given (the learner's
    weights, which may have moved on from the checkpoint) as ``weight_version``. Engine ``i``
    sees only ``devices[i]`` (``CUDA_VISIBLE_DEVICES``). Its KV cache is ``kv_cache_bytes``
    when given, else vLLM sizes it from ``gpu_memory_utilization`` (on CPU: the share of the
    machine's RAM, so it fails when other processes hold that memory; tests give a size).
    ``pausable`` serves the test hook `pause` (it turns vLLM's asynchronous scheduling off).
    """

    def __init__(
        self,
        checkpoint: str | Path,
        model: ModelConfig,
        *,
        params: Weights | None = None,
        python: str | Path = DEFAULT_PYTHON,
        replicas: int = 1,
        devices: Sequence[str] = (),
        max_model_len: int,
        max_num_seqs: int,
        dtype: str = "float32",
        weight_version: int = 0,
        seed: int = 0,
        gpu_memory_utilization: float = 0.1,
        kv_cache_bytes: int | None = None,
        startup_timeout_s: float = 900.0,
        session_cache_size: int = 4096,
        pausable: bool = False,
    ) -> None:
        python = Path(python)
        if not python.is_file():
            raise EngineStartError(f"no vLLM interpreter at {python}; {SETUP_HINT}")
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: must be at least 1")
        if devices and len(devices) != replicas:
            raise ValueError(f"{len(devices)} devices for {replicas} replicas: give one each")
        self.model = model
        self.capabilities = Capabilities(
            logprobs=True,
            logprob_tolerance=FP32_LOGPROB_TOLERANCE
            if dtype == "float32"
            else BF16_LOGPROB_TOLERANCE,
            per_request_sampling=True,
            stop_token_ids=True,
            abort=True,
            prefix_cache=True,
            weight_update="in_place",
            max_model_len=max_model_len,
        )
        self.last_push: PushStats | None = None
        self._version = weight_version
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight = 0
        self._drained: _Call | None = None
        self._updating = False
        self._gated: dict[str, _Call] = {}
        self._ids: set[str] = set()
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._session_cache_size = session_cache_size
        self._pausable = pausable
        self._logs = Path(tempfile.mkdtemp(prefix="jarl-vllm-"))
        config = dict(
            model=str(checkpoint),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            pausable=pausable,
        )
        self._engines: list[_Engine] = []
        try:
            for i in range(replicas):
                command = [str(python), "-m", "gpu_backend.vllm_worker"]
                command.append(json.dumps({**config, "seed": seed + i}))
                env = {"CUDA_VISIBLE_DEVICES": devices[i]} if devices else {}
                self._engines.append(
                    _Engine(i, command, env, self._logs / f"engine{i}.log", self._on_message)
                )
            deadline = time.monotonic() + startup_timeout_s
            for engine in self._engines:
                self._await_ready(engine, deadline)
            if params is not None:  # on a fresh loop and thread: the caller may be in a loop
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    push = self.update_weights(params, weight_version)
                    pool.submit(asyncio.run, push).result()
        except BaseException:
            for engine in self._engines:
                engine.kill()
            raise

    def _await_ready(self, engine: _Engine, deadline: float) -> None:
        try:
            ready = engine.ready.result(timeout=max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            engine.kill()
            message = f"vLLM engine {engine.index} did not start in time"
        except EngineStartError as e:
            message = str(e)
        else:
            message = ""
        if message:
            engine.reader.join()  # the log is complete once the engine's pipe has closed
            raise EngineStartError(
                f"{message}\nits log, {engine.log}, says:\n{engine.log_errors()}"
            )
        if ready["vocab_size"] != self.model.vocab_size:
            raise EngineStartError(
                f"vLLM engine {engine.index} sees vocab_size={ready['vocab_size']}, "
                f"the model config {self.model.vocab_size}"
            )

    # ------------------------------------------------------------------ asyncio-facing API

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def pids(self) -> list[int]:
        """The engine processes (each leads a process group holding vLLM's own children)."""
        return [engine.proc.pid for engine in self._engines]

    def in_flight(self) -> dict[str, int]:
        """Request id -> index of the engine serving it, for every request in flight."""
        with self._lock:
            return {rid: e.index for e in self._engines for rid in e.calls}

    def session_engine(self, session_id: str) -> int | None:
        """The engine a session's next turn goes to (None: it has no turn yet)."""
        with self._lock:
            return self._sessions.get(session_id)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        validate_request(request, self.model.vocab_size, self.capabilities.max_model_len)
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), loop, request)
        rid = request.request_id
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if rid in self._ids:
                raise InvalidRequestError(f"request_id {rid!r} is already in flight")
            self._ids.add(rid)
            if self._updating:
                self._gated[rid] = _Call(loop.create_future(), loop)
        try:
            if rid in self._gated and not await self._gated[rid].future:
                return self._result(call, [], [], "abort")  # aborted while waiting
            engine = self._dispatch(call)
            if not engine.send(self._message(request)):
                self._finish(engine, rid, [], [], "abort")
            return await call.future
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            with self._lock:
                self._ids.discard(rid)
                self._gated.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            gated = self._gated.get(request_id)
            engine = next((e for e in self._engines if request_id in e.calls), None)
        if gated is not None:
            resolve_from_thread(gated.future, gated.loop, False)
        elif engine is not None:
            engine.send({"op": "abort", "id": request_id})

    def pause(self, request_id: str, tokens: int = 1) -> None:
        """Test hook (a backend built with ``pausable``): the engine that serves
        ``request_id``, sent after this call, stops scheduling anything once that request has
        produced ``tokens`` tokens; aborts are still served. `resume` undoes it."""
        if not self._pausable:
            raise RuntimeError("pause() needs a backend built with pausable=True")
        for engine in self._engines:
            engine.send({"op": "pause", "id": request_id, "tokens": tokens})

    def is_paused(self) -> bool:
        """Whether a `pause` has taken effect (and no `resume` followed)."""
        return any(engine.paused for engine in self._engines)

    def resume(self) -> None:
        for engine in self._engines:
            engine.paused = False
            engine.send({"op": "resume"})

    async def update_weights(self, params: Weights, version: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if self._updating:
                raise RuntimeError("a weight update is already under way")
            self._updating = True
            if self._in_flight:
                self._drained = _Call(loop.create_future(), loop)
        try:
            if self._drained is not None:
                await self._drained.future
            await self._push(params, loop)
            self._version = version
        finally:
            with self._lock:
                self._updating, self._drained = False, None
                gated = list(self._gated.values())
            for call in gated:
                resolve_from_thread(call.future, call.loop, True)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
        for engine in self._engines:
            engine.send({"op": "shutdown"})
        await asyncio.gather(*(asyncio.to_thread(self._stop, e) for e in self._engines))
        shutil.rmtree(self._logs, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _stop(engine: _Engine, timeout_s: float = 60.0) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.proc.wait(timeout_s)
        engine.kill()  # vLLM's own processes too, whatever state they are in
        engine.reader.join()

    def _message(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        room = self.capabilities.max_model_len - len(request.prompt_ids)
        return {
            "op": "generate",
            "id": request.request_id,
            "prompt": list(request.prompt_ids),
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "seed": s.seed,
            "max_tokens": min(s.max_tokens, room),
            "stop": list(s.stop_token_ids),
            "logprobs": s.logprobs,
        }

    def _dispatch(self, call: _Call) -> _Engine:
        """Registers ``call`` on its engine: the session's own if it has one alive (for a new
        session, that of the session it continues, ``prefix_session``, whose prefix vLLM
        caches), else the engine with the fewest requests in flight."""
        assert call.request is not None
        session = call.request.session_id
        with self._lock:
            alive = [e for e in self._engines if e.dead is None]
            if not alive:
                reasons = "; ".join(f"engine {e.index}: {e.dead}" for e in self._engines)
                raise RuntimeError(f"every vLLM engine has exited ({reasons})")
            ids = (session, call.request.prefix_session)
            index = next(
                (self._sessions[s] for s in ids if s is not None and s in self._sessions), None
            )
            if index is None or self._engines[index].dead is not None:
                engine = min(alive, key=lambda e: len(e.calls))
            else:
                engine = self._engines[index]
            if session is not None:
                self._sessions[session] = engine.index
                self._sessions.move_to_end(session)
                while len(self._sessions) > self._session_cache_size:
                    self._sessions.popitem(last=False)
            call.version = self._version
            engine.calls[call.request.request_id] = call
            self._in_flight += 1
        return engine

    async def _push(self, params: Weights, loop: asyncio.AbstractEventLoop) -> None:
        t0 = time.perf_counter()
        fd, name = tempfile.mkstemp(prefix="jarl-weights-", suffix=".bin", dir=wire.SHM_DIR)
        os.close(fd)
        path = Path(name)
        try:
            index = await asyncio.to_thread(
                wire.write_tensors, path, hf_tensors(self.model, params)
            )
            t1 = time.perf_counter()
            engines = [e for e in self._engines if e.dead is None]
            calls = []
            for engine in engines:
                call = _Call(loop.create_future(), loop)
                engine.load = call
                calls.append(call.future)
                if not engine.send({"op": "load", "path": name, "index": index}):
                    resolve_from_thread(
                        call.future, loop, RuntimeError(f"vLLM engine {engine.index} exited")
                    )
            load_s = max(await asyncio.gather(*calls))
            size = path.stat().st_size
        finally:
            path.unlink(missing_ok=True)
        self.last_push = PushStats(size, t1 - t0, load_s, time.perf_counter() - t0)

    def _on_message(self, engine: _Engine, m: dict[str, Any]) -> None:
        """Runs on ``engine``'s reader thread."""
        op = m["op"]
        if op == "result":
            self._finish(engine, m["id"], m["tokens"], m["logprobs"], m["finish"])
        elif op == "paused":
            engine.paused = True
        elif op == "ready":
            engine.ready.set_result(m)
        elif op == "error":
            engine.ready.set_exception(EngineStartError(f"vLLM engine failed: {m['message']}"))
        elif op in ("loaded", "failed") and engine.load is not None:
            load, engine.load = engine.load, None
            value = m["seconds"] if op == "loaded" else RuntimeError(m["message"])
            resolve_from_thread(load.future, load.loop, value)
        elif op == "exit":
            self._on_exit(engine)

    def _on_exit(self, engine: _Engine) -> None:
        code = engine.proc.wait()
        reason = f"exit code {code}"
        if not engine.ready.done():
            engine.ready.set_exception(EngineStartError(f"vLLM engine exited ({reason})"))
        with self._lock:
            engine.dead = reason
            orphans = list(engine.calls)
        for rid in orphans:
            self._finish(engine, rid, [], [], "abort")
        if engine.load is not None:
            load, engine.load = engine.load, None
            error = RuntimeError(f"vLLM engine {engine.index} exited ({reason}) during a load")
            resolve_from_thread(load.future, load.loop, error)
        if not self._closed:  # died on its own: reap vLLM's children it leaves behind
            engine.kill()

    def _finish(
        self,
        engine: _Engine,
        rid: str,
        tokens: list[int],
        logprobs: list[float] | None,
        finish: FinishReason,
    ) -> None:
        with self._lock:
            call = engine.calls.pop(rid, None)
            if call is None:
                return
            self._in_flight -= 1
            drained = self._drained if self._in_flight == 0 else None
        resolve_from_thread(call.future, call.loop, self._result(call, tokens, logprobs, finish))
        if drained is not None:
            resolve_from_thread(drained.future, drained.loop, None)

    def _result(
        self,
        call: _Call,
        tokens: list[int],
        logprobs: list[float] | None,
        finish: FinishReason,
    ) -> GenerateResult:
        assert call.request is not None
        want = call.request.sampling.logprobs
        return GenerateResult(
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs or ()) if want else None,
            finish_reason=finish,
            weight_version=call.version if tokens else self._version,
        )


def _build(spec: BackendBuild) -> VLLMBackend:
    r = spec.rollout
    return VLLMBackend(
        spec.checkpoint,
        spec.model,
        params=spec.params,
        python=r.vllm_python or DEFAULT_PYTHON,
        replicas=r.replicas,
        devices=[d for d in r.vllm_devices.split(",") if d],
        kv_cache_bytes=r.vllm_kv_cache_mb * 2**20 or None,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_concurrent,
        dtype=spec.dtype,
        weight_version=spec.version,
        seed=spec.seed,
    )


def _check(rollout: RolloutSection) -> list[str]:
    return interpreter_problems("vllm_python", rollout.vllm_python, DEFAULT_PYTHON, "vLLM", "vllm")


# `rollout.backend=vllm`, found through the entry point in pyproject.toml
FACTORY = BackendFactory(build=_build, check=_check)
