"""`VLLMBackend`: vLLM engine processes behind the `RolloutBackend` protocol.

The backend starts ``replicas`` engine processes (``jarl_gpu_backend.worker``, of the
jarl-gpu-backend distribution in ``gpu_backend/``, under the vLLM venv's interpreter: vLLM
never loads into this process, so never beside JAX or TensorFlow), each in its own process
group, and talks to each over a pipe (`wire`). One reader thread per engine resolves the
asyncio futures of the calls waiting on it, so the event loop never blocks and any event loop
may call in.

Routing is `jax_agent_rl.rollout.router`'s: a session's turns stay on one engine (vLLM's
prefix cache then holds them), anything else goes to the engine with the fewest requests in
flight.

Weight updates go through the `WeightGate` every backend shares: new requests wait, requests
in flight finish under the weights they started with, then every engine loads the new weights
and resets its prefix cache, and the waiting requests go out stamped with the new version. The
weights travel through one file in ``/dev/shm``, written once from `hf_tensors` (the HF export's
name/transpose table) and read in place by every engine, or, when the learner's weights sit on
one GPU every engine sees, as one CUDA IPC handle to a buffer on that GPU, never through the
host (`cuda_ipc`; the choice, `cuda_ipc.push_transport`, is made at each push: `transport`).
A LoRA model's engines run vLLM's own LoRA support on the checkpoint's base: a push (the
adapters alone, `LayerAdapters`) is written as a PEFT folder (`write_peft`), one per push
under the backend's temporary folder (the one before it deleted once the engines hold the new
one), which every engine loads under a new adapter id; every later request runs under the
latest.

An engine that dies (killed, out of memory) is started again in its place, up to
``max_restarts`` times (``engine.max_restarts``): it loads the newest weights pushed (the
backend keeps them: the last push's ``/dev/shm`` file, CUDA IPC buffer or adapter folder), and
its requests in flight are sent to it again from their prompts with their own seeds, so a
trajectory goes on as if nothing happened (none is trained half-finished); meanwhile new
requests go to the engines still alive, or wait for the restart when none is. Deaths, restarts
and requests sent again are counted (`counters`: ``rollout/replica_deaths``,
``rollout/replica_restarts``, ``rollout/requests_requeued``, as Ray replicas count theirs). An
engine past its restarts stays down and its requests end with finish reason ``abort`` (the
agent loop marks those trajectories ``aborted``); with no engine left, requests raise. `close`
stops every engine and its children, a starting one too.

With ``pausable``, `pause` / `is_paused` / `resume` hold an engine at a state for tests (the
conformance suite aborts a request it knows to be running, and one it knows to be queued):
the engine pauses itself in the step where a given request produces its n-th token, so the
state cannot run past while the test looks at it; aborts are served meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from jax_agent_rl.backends.vllm import cuda_ipc, wire
from jax_agent_rl.backends.vllm.engines import Call, Engine, interpreter_problem
from jax_agent_rl.backends.vllm.sizes import (
    BLOCK_SIZES,
    device_groups,
    kv_cache_bytes,
    max_lora_rank,
)
from jax_agent_rl.models import ModelConfig, Weights, hf_tensors
from jax_agent_rl.models.adapters import adapters_of, check_adapters, write_peft
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
from jax_agent_rl.rollout.delta import refuse_delta
from jax_agent_rl.rollout.gate import Ticket, WeightGate
from jax_agent_rl.rollout.processes import interpreter_problems
from jax_agent_rl.rollout.registry import BackendBuild, BackendFactory
from jax_agent_rl.rollout.router import SESSION_MEMORY, Router

if TYPE_CHECKING:
    from jax_agent_rl.config import EngineSection

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SETUP_HINT = (
    "build it with `scripts/setup.sh vllm` (a venv of your own, e.g. with vLLM's CUDA build: "
    "`pip install --no-deps -e gpu_backend` into it)"
)


class EngineStartError(RuntimeError):
    """A vLLM engine that could not start; the message says why and how to fix it."""


class VLLMBackend:
    """`RolloutBackend` over vLLM engine processes (see the module docstring).

    The engines load ``checkpoint`` (an HF folder), then ``params`` when given (the learner's
    weights, which may have moved on from the checkpoint; a LoRA ``model``'s adapters on the
    checkpoint's base) as ``weight_version``. Engine ``i``
    sees only ``devices[i]`` (``CUDA_VISIBLE_DEVICES``, e.g. ``"4,5"``) and shards the model
    over ``tensor_parallel_size`` of them (vLLM's tensor parallelism). Its KV cache is
    ``kv_cache_bytes`` in blocks of ``block_size`` positions (None: vLLM's default) when given,
    else vLLM sizes it from ``gpu_memory_utilization`` (on CPU: the share of the machine's RAM,
    so it fails when other processes hold that memory; tests give a size).
    ``pausable`` serves the test hook `pause` (it turns vLLM's asynchronous scheduling off).
    Each engine that dies is started again up to ``max_restarts`` times (module docstring).
    ``full_every`` > 1: pushes through /dev/shm write only the changed elements into the kept
    weights file, whole every this many pushes (module docstring).
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
        tensor_parallel_size: int = 1,
        max_model_len: int,
        max_num_seqs: int,
        dtype: str = "float32",
        weight_version: int = 0,
        seed: int = 0,
        gpu_memory_utilization: float = 0.1,
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        startup_timeout_s: float = 900.0,
        session_cache_size: int = SESSION_MEMORY,
        pausable: bool = False,
        max_restarts: int = 3,
        full_every: int = 1,
    ) -> None:
        python = Path(python)
        if (problem := interpreter_problem(python)) is not None:
            raise EngineStartError(f"{problem}; {SETUP_HINT}")
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: must be at least 1")
        if devices and len(devices) != replicas:
            raise ValueError(f"{len(devices)} device groups for {replicas} replicas: one each")
        self._devices = list(devices) or [""] * replicas  # each engine's CUDA_VISIBLE_DEVICES
        # the last push's path (`cuda_ipc.push_transport`: CUDA IPC or /dev/shm) and why
        self.transport: tuple[cuda_ipc.Transport, str] | None = None
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: must be at least 1")
        self.model = model
        self.capabilities = Capabilities(
            logprobs=True,
            logprob_tolerance=logprob_tolerance(dtype),
            per_request_sampling=True,
            stop_token_ids=True,
            abort=True,
            prefix_cache=True,
            weight_update="in_place",
            max_model_len=max_model_len,
            lora=model.lora is not None,
        )
        self.last_push: PushStats | None = None
        self._lock = threading.Lock()
        self._gate = WeightGate(weight_version, self._lock)
        self._sessions = Router(session_cache_size)
        self._pausable = pausable
        self._dir = Path(tempfile.mkdtemp(prefix="jarl-vllm-"))  # logs, pushed adapters
        self._adapter: tuple[int, Path] | None = None  # the engines' adapters: id, folder
        self._max_restarts = max_restarts
        if full_every < 1:
            raise ValueError(f"full_every={full_every}: a whole push every N >= 1 pushes")
        self._full_every, self._since_full = full_every, 0
        self._counts = {"replica_deaths": 0, "replica_restarts": 0, "requests_requeued": 0}
        self._serving = False  # restarts begin once every engine has started
        # the newest weights for an engine that starts again: the load message of the last
        # push (and what keeps its buffer alive); held from a push's write to its engines' load
        self._newest: tuple[dict[str, Any], Any] | None = None
        self._newest_lock = threading.Lock()
        self._python, self._startup_timeout_s = python, startup_timeout_s
        self._starting: dict[int, Engine] = {}  # engines starting again, by index
        self._down: set[int] = set()  # engines past their restarts
        config = dict(
            model=str(checkpoint),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
            pausable=pausable,
            max_lora_rank=max_lora_rank(model),
        )
        self._config = config
        self._seed = seed
        self._engines: list[Engine] = []
        try:
            for i in range(replicas):
                self._engines.append(self._spawn(i, 0))
            deadline = time.monotonic() + startup_timeout_s
            for engine in self._engines:
                self._wait_ready(engine, max(deadline - time.monotonic(), 0.0))
            if params is not None:  # on a fresh loop and thread: the caller may be in a loop
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    pushed = params if model.lora is None else adapters_of(params)
                    push = self.update_weights(pushed, weight_version)
                    pool.submit(asyncio.run, push).result()
        except BaseException:
            for engine in self._engines:
                engine.process.kill()
            raise
        self._serving = True

    def _spawn(self, index: int, generation: int) -> Engine:
        """Engine ``index``'s process (``generation``: how many started before it)."""
        device = self._devices[index]
        env = {"CUDA_VISIBLE_DEVICES": device} if device else {}
        return Engine(
            index,
            self._python,
            {**self._config, "seed": self._seed + index},
            env,
            self._dir / f"engine{index}.{generation}.log",
            ROOT,
            self._on_message,
            self._on_exit,
        )

    def _wait_ready(self, engine: Engine, timeout_s: float) -> None:
        """Waits for ``engine``'s handshake and checks it took the settings asked for."""
        ready = engine.settings = engine.process.wait_ready(timeout_s, EngineStartError)
        if ready["vocab_size"] != self.model.vocab_size:
            raise EngineStartError(
                f"vLLM engine {engine.index} sees vocab_size={ready['vocab_size']}, "
                f"the model config {self.model.vocab_size}"
            )
        tp = self._config["tensor_parallel_size"]
        if ready["tensor_parallel_size"] != tp:  # as vLLM took it
            raise EngineStartError(
                f"vLLM engine {engine.index} runs tensor_parallel_size="
                f"{ready['tensor_parallel_size']}, not {tp}"
            )

    # ------------------------------------------------------------------ asyncio-facing API

    @property
    def weight_version(self) -> int:
        return self._gate.version

    @property
    def pids(self) -> list[int]:
        """The engine processes (each leads a process group holding vLLM's own children)."""
        return [engine.process.pid for engine in self._engines]

    def engine_settings(self) -> list[dict[str, Any]]:
        """Each engine's settings as its vLLM engine took them (max_model_len, vocab_size,
        tensor_parallel_size), read back from the engine process."""
        return [dict(engine.settings) for engine in self._engines]

    def counters(self) -> dict[str, float]:
        """Totals so far: engine deaths, restarts, requests sent again to a restarted engine."""
        with self._lock:
            return {f"rollout/{k}": float(v) for k, v in self._counts.items()}

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
        call = Call(loop.create_future(), loop, request)
        rid = request.request_id
        ticket = self._gate.enter(rid)
        try:
            admitted = await self._gate.admit(ticket)
            if not admitted or (engine := self._dispatch(call, ticket)) is None:
                return self._result(call, [], [], "abort")  # aborted before it went out
            if engine.dead is None:  # (else its restart sends it)
                engine.send(self._message(request))  # one that died meanwhile: `_on_exit`
            return await call.future
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            self._gate.done(ticket)

    async def abort(self, request_id: str) -> None:
        self._gate.abort(request_id)  # not sent yet: it will not be
        with self._lock:
            engine = next((e for e in self._engines if request_id in e.calls), None)
        if engine is None:
            return
        if engine.dead is not None:  # waiting on a restart: it will not be sent again
            self._finish(engine, request_id, [], [], "abort")
        else:
            engine.send({"op": "abort", "id": request_id})

    def pause(self, request_id: str, tokens: int = 1) -> None:
        """Test hook (a backend built with ``pausable``): the engine that serves
        ``request_id``, sent after this call, stops scheduling anything once that request has
        produced ``tokens`` tokens; aborts are still served. `resume` undoes it."""
        if not self._pausable:
            raise RuntimeError("pause() needs a backend built with pausable=True")
        for engine in self._engines:
            engine.send({"op": "pause", "id": request_id, "tokens": tokens})

    async def weights_digest(self) -> list[list[str]]:
        """Test hook: per live engine, a digest of each of its workers' model state (the bits
        of every tensor): engines serving the same weights give the same."""
        loop = asyncio.get_running_loop()
        calls = []
        for engine in [e for e in self._engines if e.dead is None]:
            engine.digest = Call(loop.create_future(), loop)
            calls.append(engine.digest.future)
            engine.send({"op": "digest"})
        return list(await asyncio.gather(*calls))

    def is_paused(self) -> bool:
        """Whether a `pause` has taken effect (and no `resume` followed)."""
        return any(engine.paused for engine in self._engines)

    def resume(self) -> None:
        for engine in self._engines:
            engine.paused = False
            engine.send({"op": "resume"})

    async def update_weights(self, params: Weights | LayerAdapters, version: int) -> None:
        refuse_delta(params, "vLLM engines")
        held = await self._gate.update(lambda: self._push(params), version)
        self.last_push = self.last_push and self.last_push.held(held)

    async def close(self) -> None:
        self._gate.close()
        with self._lock:
            starting = list(self._starting.values())
        for engine in starting:  # its restart sees the gate closed and ends
            engine.process.kill()
        for engine in self._engines:
            engine.send({"op": "shutdown"})
        # then vLLM's own processes too, whatever state they are in
        await asyncio.gather(*(asyncio.to_thread(e.process.stop, 60.0) for e in self._engines))
        if self._newest is not None:
            _release(self._newest[1])
            self._newest = None
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals

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

    def _dispatch(self, call: Call, ticket: Ticket) -> Engine | None:
        """Registers ``call`` on the engine the router picks (None: it was aborted)."""
        assert call.request is not None
        with self._lock:
            if ticket.aborted:
                return None
            live = [e.index for e in self._engines if e.dead is None]
            if not live:  # wait on an engine that is starting again
                live = [e.index for e in self._engines if e.index not in self._down]
            index = self._sessions.pick(call.request, live, lambda i: len(self._engines[i].calls))
            if index is None:
                reasons = "; ".join(f"engine {e.index}: {e.dead}" for e in self._engines)
                raise RuntimeError(f"every vLLM engine has exited ({reasons})")
            self._sessions.remember(call.request.session_id, index)
            engine = self._engines[index]
            call.version = ticket.version
            engine.calls[call.request.request_id] = call
        return engine

    async def _push(self, params: Weights | LayerAdapters) -> None:
        await asyncio.to_thread(self._newest_lock.acquire)  # a restart loads these or the last
        try:
            if self.model.lora is not None or isinstance(params, LayerAdapters):
                return await self._push_adapters(params)
            await self._push_weights(params)
        finally:
            self._newest_lock.release()

    async def _push_weights(self, params: Weights) -> None:
        t0 = time.perf_counter()
        parts = (self.model, params)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = cuda_ipc.learner_gpus(jax.tree.leaves(params), visible)
        self.transport = cuda_ipc.push_transport(gpus, self._devices)
        if self.transport[0] == "cuda_ipc":
            export = await asyncio.to_thread(
                cuda_ipc.export_tensors, hf_tensors(self.model, params, on_device=True)
            )
            t1 = time.perf_counter()
            message: dict[str, Any] = {"op": "load", "payload": export.payload}
            load_s = await self._load(message)
            # (the buffer lives while an engine may load from it: until the next push)
            self._keep_newest(message, export)
            self.last_push = PushStats(export.nbytes, t1 - t0, load_s, time.perf_counter() - t0)
            return
        kept = None if self._newest is None else self._newest[0]
        if self._since_full + 1 < self._full_every and kept is not None and "path" in kept:
            try:
                changed, size = await asyncio.to_thread(
                    wire.update_tensors, Path(kept["path"]), kept["index"], hf_tensors(*parts)
                )
            except ValueError:  # (another layout: a whole push below)
                pass
            else:
                t1 = time.perf_counter()
                since, self._since_full = self._since_full, self._full_every  # (failed: whole)
                load_s = await self._load_changed(kept, changed)
                self._since_full = since + 1
                self.last_push = PushStats(
                    size, t1 - t0, load_s, time.perf_counter() - t0, delta=True
                )
                return
        fd, name = tempfile.mkstemp(prefix="jarl-weights-", suffix=".bin", dir=wire.SHM_DIR)
        os.close(fd)
        path = Path(name)
        try:
            index = await asyncio.to_thread(wire.write_tensors, path, hf_tensors(*parts))
            t1 = time.perf_counter()
            message = {"op": "load", "path": name, "index": index}
            load_s = await self._load(message)
            size = path.stat().st_size
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self._keep_newest(message, path)  # a restarted engine loads this file
        self._since_full = 0
        self.last_push = PushStats(size, t1 - t0, load_s, time.perf_counter() - t0)

    async def _load_changed(self, kept: dict[str, Any], changed: list[str]) -> float:
        """The engines reload, from the kept file, every tensor of each vLLM layer that holds a
        changed one (`_layer_of`: a layer given part of its tensors would be processed with
        the rest unloaded); none changed: nothing to load."""
        layers = {_layer_of(name) for name in changed}
        index = [e for e in kept["index"] if _layer_of(e["name"]) in layers]
        if not index:
            return 0.0
        return await self._load({"op": "load", "path": kept["path"], "index": index})

    def _keep_newest(self, message: dict[str, Any], held: Any) -> None:
        """Keeps the load ``message`` of the weights just pushed (and ``held``: its file,
        buffer or folder) for engines that start again; the last push's is let go."""
        if self._newest is not None:
            _release(self._newest[1])
        self._newest = (message, held)

    async def _push_adapters(self, adapters: Weights | LayerAdapters) -> None:
        """A new PEFT folder and adapter id for ``adapters``; the previous folder goes once
        every engine has loaded the new one (a failed load keeps it: the engines still serve
        it). The push's bytes are the adapter tensors' (fp32)."""
        if not isinstance(adapters, LayerAdapters):
            raise ValueError(
                f"a LoRA model's vLLM engines take its adapters alone (LayerAdapters), not "
                f"{type(adapters).__name__}"
            )
        check_adapters(self.model, adapters)
        t0 = time.perf_counter()
        n = self._adapter[0] + 1 if self._adapter else 1  # vLLM caches adapters by id
        path = self._dir / f"adapter-{n}"
        try:
            size = await asyncio.to_thread(write_peft, path, self.model, adapters)
            t1 = time.perf_counter()
            message = {"op": "adapter", "name": path.name, "id": n, "path": str(path)}
            load_s = await self._load(message)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._adapter = (n, path)
        self._keep_newest(message, path)  # (the folder before it goes)
        self.last_push = PushStats(size, t1 - t0, load_s, time.perf_counter() - t0)

    async def _load(self, message: dict[str, Any], engines: list[Engine] | None = None) -> float:
        """Sends a ``load`` or ``adapter`` message to ``engines`` (None: every live engine); the
        slowest's seconds."""
        loop = asyncio.get_running_loop()
        calls = []
        if engines is None:
            engines = [e for e in self._engines if e.dead is None]
        for engine in engines:
            call = Call(loop.create_future(), loop)
            engine.load = call
            calls.append(call.future)
            if not engine.send(message):
                resolve_from_thread(
                    call.future, loop, RuntimeError(f"vLLM engine {engine.index} exited")
                )
        return max(await asyncio.gather(*calls), default=0.0)

    def _on_message(self, engine: Engine, m: dict[str, Any]) -> None:
        """Runs on ``engine``'s reader thread."""
        op = m["op"]
        if op == "result":
            self._finish(engine, m["id"], m["tokens"], m["logprobs"], m["finish"])
        elif op == "paused":
            engine.paused = True
        elif op == "digest" and engine.digest is not None:
            digest, engine.digest = engine.digest, None
            resolve_from_thread(digest.future, digest.loop, m["digests"])
        elif op in ("loaded", "failed") and engine.load is not None:
            load, engine.load = engine.load, None
            value = m["seconds"] if op == "loaded" else RuntimeError(m["message"])
            resolve_from_thread(load.future, load.loop, value)

    def _on_exit(self, engine: Engine, code: int) -> None:
        """Runs on ``engine``'s reader thread once its process has exited: it starts again
        (`_restart`), or past its restarts its requests end as aborted."""
        reason = f"exit code {code}"
        with self._lock:
            engine.dead = reason
            index = engine.index  # (one dying as the backend starts may not be listed yet)
            listed = index < len(self._engines) and self._engines[index] is engine
            serving = listed and not self._gate.closed
            restart = serving and self._serving
            if restart:
                self._counts["replica_deaths"] += 1
                if engine.restarts >= self._max_restarts:
                    restart = False
                    self._down.add(engine.index)
            orphans = [] if restart else list(engine.calls)
        for rid in orphans:
            self._finish(engine, rid, [], [], "abort")
        if engine.load is not None:
            load, engine.load = engine.load, None
            error = RuntimeError(f"vLLM engine {engine.index} exited ({reason}) during a load")
            resolve_from_thread(load.future, load.loop, error)
        if not self._gate.closed:  # died on its own: reap vLLM's children it leaves behind
            engine.process.kill()
        if restart:
            name = f"vllm-restart-{engine.index}"
            threading.Thread(target=self._restart, args=(engine,), name=name, daemon=True).start()

    def _restart(self, dead: Engine) -> None:
        """Starts engine ``dead.index`` again in a thread of its own: the new process loads the
        newest weights, takes over the dead one's requests and sends them again. One that
        fails to start counts as another death (`_on_exit` of the new process does not
        restart it: it never served)."""
        index, restarts = dead.index, dead.restarts
        while True:
            restarts += 1
            engine: Engine | None = None
            try:
                engine = self._spawn(index, restarts)
                engine.restarts = restarts
                with self._lock:
                    self._starting[index] = engine
                    closed = self._gate.closed
                if closed:
                    engine.process.kill()
                self._wait_ready(engine, self._startup_timeout_s)
                with self._newest_lock:
                    if self._newest is not None:
                        asyncio.run(self._load(self._newest[0], [engine]))
                    with self._lock:
                        del self._starting[index]
                        if self._gate.closed:
                            raise RuntimeError("the backend closed during a restart")
                        engine.calls = dead.calls  # (those registered meanwhile too)
                        self._engines[index] = engine
                        again = list(engine.calls.values())
                        self._counts["replica_restarts"] += 1
                        self._counts["requests_requeued"] += len(again)
            except Exception:
                if engine is not None:
                    engine.process.kill()
                with self._lock:
                    self._starting.pop(index, None)
                    if self._gate.closed or restarts >= self._max_restarts:
                        self._down.add(index)
                        orphans = list(dead.calls)
                    else:
                        self._counts["replica_deaths"] += 1
                        continue
                for rid in orphans:
                    self._finish(dead, rid, [], [], "abort")
                return
            for call in again:
                assert call.request is not None
                call.resent += 1
                engine.send(self._message(call.request))  # one that died meanwhile: `_on_exit`
            return

    def _finish(
        self,
        engine: Engine,
        rid: str,
        tokens: list[int],
        logprobs: list[float] | None,
        finish: FinishReason,
    ) -> None:
        with self._lock:
            call = engine.calls.pop(rid, None)
        if call is not None:
            result = self._result(call, tokens, logprobs, finish)
            resolve_from_thread(call.future, call.loop, result)

    def _result(
        self,
        call: Call,
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
            weight_version=call.version if tokens else self._gate.version,
            resent=call.resent,
        )


def _layer_of(name: str) -> str:
    """The vLLM layer an HF tensor name loads into: q/k/v into one attention projection,
    gate/up into one MLP projection, every expert's into the layer's fused experts, any other
    into the module it names."""
    module = name.rsplit(".", 1)[0]
    if ".mlp.experts." in module:
        return module.split(".mlp.experts.")[0] + ".mlp.experts"
    head, _, leaf = module.rpartition(".")
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up"}
    return f"{head}.{fused.get(leaf, 'gate_up' if leaf == 'up_proj' else leaf)}"


def _release(held: Any) -> None:
    """Lets go of what kept a push's weights: its /dev/shm file or adapter folder (a CUDA IPC
    export is freed with its last reference)."""
    if isinstance(held, Path):
        if held.is_dir():
            shutil.rmtree(held, ignore_errors=True)
        else:
            held.unlink(missing_ok=True)


def _build(spec: BackendBuild) -> VLLMBackend:
    r = spec.engine
    return VLLMBackend(
        spec.checkpoint,
        spec.model,
        params=spec.params,
        python=r.vllm.python or DEFAULT_PYTHON,
        replicas=r.vllm.replicas,
        devices=device_groups(r.vllm.devices, r.vllm.tensor_parallel_size),
        tensor_parallel_size=r.vllm.tensor_parallel_size,
        kv_cache_bytes=kv_cache_bytes(r, spec.model, spec.dtype),
        block_size=r.page_size,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_concurrent,
        dtype=spec.dtype,
        weight_version=spec.version,
        seed=spec.seed,
        max_restarts=r.max_restarts,
        full_every=r.push.full_every,
    )


def _notes(engine: EngineSection) -> list[str]:
    """How pushes will reach the engines, said before the run: the learner's weights sit on
    this process's devices (its mesh takes them all), so `cuda_ipc.push_transport` decides now
    as it will at each push."""
    devices = device_groups(engine.vllm.devices, engine.vllm.tensor_parallel_size)
    gpus = cuda_ipc.device_gpus(jax.devices(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    _, why = cuda_ipc.push_transport(gpus, devices or [""] * engine.vllm.replicas)
    return [f"vllm weight push: {why} (a LoRA run's adapters go as PEFT folders)"]


def _check(engine: EngineSection, processes: int) -> list[str]:
    del processes  # every process starts its own engines
    python = engine.vllm.python
    problems = interpreter_problems("vllm.python", python, DEFAULT_PYTHON, "vLLM", "vllm")
    if not problems and (problem := interpreter_problem(Path(python or DEFAULT_PYTHON))):
        problems.append(f"engine.vllm.python: {problem}; {SETUP_HINT}")
    if engine.page_size not in BLOCK_SIZES:
        problems.append(
            f"engine.page_size={engine.page_size}: the vllm backend's KV cache blocks (vLLM's "
            f"block_size) take {', '.join(map(str, BLOCK_SIZES))}"
        )
    return problems


# `engine.backend=vllm`, found through the entry point in pyproject.toml
FACTORY = BackendFactory(
    build=_build,
    check=_check,
    notes=_notes,
    unread={
        "batch_buckets": "vLLM batches whatever requests are running; no setting makes its "
        "numbers independent of that",
    },
    self_tuned={
        "steps_per_call": "vLLM's scheduler decides the decode steps between its calls",
        "prefill_chunk": "vLLM's scheduler sizes its prefill chunks (on CPU it prefills "
        "whole prompts)",
        "warmup": "vLLM compiles and profiles its programs when it starts",
    },
)
