"""One vLLM engine process: vLLM's v1 ``AsyncLLM`` behind a pipe. Runs under ``.venv-vllm``,
with the repository root on its path (the backend sets ``PYTHONPATH``):

    .venv-vllm/bin/python -m jarl_gpu_backend.worker '{"model": ..., ...}'

Its ``main`` is `jax_agent_rl.backends.worker`'s. Messages (`wire` framing) come in on stdin
and go out on the process's original stdout; everything vLLM prints goes to stderr. In:

- ``generate`` {id, prompt, temperature, top_k, top_p, seed, max_tokens, stop, logprobs}
- ``abort`` {id}
- ``load`` {path, index}: new weights from a `wire.write_tensors` file; the prefix cache is
  reset after them (its keys and values belong to the old weights)
- ``adapter`` {name, id, path}: (an engine started with ``max_lora_rank``) new LoRA adapters,
  a PEFT folder, loaded by vLLM's own LoRA support; every later ``generate`` runs under them
  (a ``LoRARequest``), the previous adapters are dropped and the prefix cache reset
- ``pause`` {id, tokens} and ``resume``: a test hook, served when the engine runs with
  ``pausable`` (`PausingScheduler`): the engine stops scheduling anything once request ``id``
  (whose ``generate`` comes after this message) has produced ``tokens`` tokens, and goes on at
  ``resume``; aborts are served meanwhile
- ``shutdown``

Out: the handshake, ``ready`` {max_model_len, vocab_size, tensor_parallel_size} (as the engine
took them) or {error} and exit; ``result`` {id, tokens, logprobs, finish}; ``loaded``
{seconds}; ``failed`` {id, message} for a load that raised; ``paused`` once a ``pause`` has
taken effect. End of stdin means the backend is gone: the engine shuts down.

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``, so a sampled token's
logprob is taken after temperature, top-k and top-p, as the rollout protocol defines it.
vLLM does not filter greedy rows of a batch that holds only greedy rows, so greedy requests go
to it without filters (they never change the argmax) and, when the request had filters, with
the whole distribution; the filtered logprob is computed here (`_filtered_logprob`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import sys
import time
import traceback
from typing import Any, BinaryIO

from jax_agent_rl.backends.vllm import cuda_ipc, wire
from jax_agent_rl.backends.worker import Channel, engine_main

_MODULE = "jarl_gpu_backend.worker"  # this module's name (``-m`` runs it as __main__)
PAUSE_KEY = "jarl_pause_at"  # SamplingParams.extra_args: pause once the request has n tokens


@functools.cache
def _pausing_scheduler() -> type:
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    class PausingScheduler(Scheduler):
        """vLLM's scheduler, which also pauses itself, as ``pause_generation(mode="keep")``
        does, in the step where a request with ``extra_args[PAUSE_KEY] = n`` produces its n-th
        token: the engine then holds that state (nothing is scheduled, aborts are served)
        until ``resume_generation``. A test hook (``pause``), used only with ``pausable``, which
        also turns asynchronous scheduling off (it is off on CPU anyway): this is vLLM's
        synchronous scheduler."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.jarl_pause_at: dict[str, int] = {}

        def add_request(self, request: Any) -> None:
            super().add_request(request)
            extra = request.sampling_params and request.sampling_params.extra_args
            if extra and PAUSE_KEY in extra:
                self.jarl_pause_at[request.request_id] = extra[PAUSE_KEY]

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            outputs = super().update_from_output(*args, **kwargs)
            for rid, tokens in list(self.jarl_pause_at.items()):
                request = self.requests.get(rid)
                if request is None:  # ended before its tokens
                    del self.jarl_pause_at[rid]
                elif request.num_output_tokens >= tokens:
                    del self.jarl_pause_at[rid]
                    self.set_pause_state(PauseState.PAUSED_ALL)
            return outputs

    return PausingScheduler


def __getattr__(name: str) -> Any:
    if name == "PausingScheduler":  # built on first use: vLLM is imported only in its venv
        return _pausing_scheduler()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WeightLoader:
    """vLLM worker extension (mixed into its GPU/CPU worker class): loads pushed weights."""

    def jarl_load_shm(self, path: str, index: list[dict[str, Any]]) -> None:
        """Reloads every tensor of a `wire.write_tensors` file, under its HF name and layout,
        through vLLM's own checkpoint loading (``reload_weights``), which also repacks weights
        for the CPU kernels (``load_weights`` alone leaves them stale there)."""
        import torch

        def tensors() -> Any:
            for name, data, dtype, shape in wire.map_tensors(path, index):
                yield name, torch.frombuffer(data, dtype=getattr(torch, dtype)).view(shape)

        self._reload(tensors())

    def jarl_load_ipc(self, payload: str) -> None:
        """Reloads every tensor of a `cuda_ipc.export_tensors` payload: views into the
        learner's buffer on the same GPU, never through the host (as `jarl_load_shm`)."""
        self._reload(cuda_ipc.import_tensors(payload))

    def jarl_digest(self) -> str:
        """A digest of the bits of every tensor of the model's state (a test hook: two engines
        serving the same weights give the same)."""
        import hashlib

        import torch

        h = hashlib.sha256()
        state = self.model_runner.get_model().state_dict()  # type: ignore[attr-defined]
        for name in sorted(state):
            h.update(name.encode())
            tensor = state[name].detach().cpu().contiguous().reshape(-1)
            h.update(tensor.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def _reload(self, tensors: Any) -> None:
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        _repack_experts(model)
        if model.config.tie_word_embeddings:
            # the layerwise reload re-processes only the modules that received tensors; a tied
            # head receives none (its tensor is the embedding's), so on CPU it keeps the matmul
            # weights it packed from the old embedding: tie it again and re-pack it
            model.lm_head.weight = model.model.embed_tokens.weight
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _repack_experts(model: Any) -> None:
    """On CPU, packs each mixture-of-experts layer's reloaded weights for the CPU kernels again.

    vLLM's CPU experts keep ``w13_weight`` / ``w2_weight`` in a packed grouped-GEMM layout
    (``cpu_prepack_moe_weight``, done by their ``process_weights_after_loading``). A reload
    processes the layer again, but vLLM 0.32's unquantized MoE method skips that step once
    its kernel exists (a weight update copies the weights in and keeps the kernel), so the
    reloaded weights stay in the checkpoint's layout and the CPU kernel reads them as packed:
    even re-pushing the same weights changed greedy outputs. Other platforms' experts do
    not repack (their step is a no-op) and are left alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def _filtered_logprob(logprobs: dict[int, Any], token: int, top_k: int, top_p: float) -> float:
    """``token``'s logprob under ``logprobs`` (the whole distribution) filtered by top-k, then
    top-p, and renormalised: the learner's definition (`jax_agent_rl.engine.sampling`)."""
    ordered = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    if top_k > 0:
        ordered = ordered[:top_k]
    top = ordered[0]
    probs = [math.exp(lp - top) for lp in ordered]
    total = sum(probs)
    kept, mass = 0, 0.0
    for p in probs:  # the shortest prefix whose renormalised mass reaches top_p
        kept, mass = kept + 1, mass + p
        if mass >= top_p * total:
            break
    log_mass = top + math.log(sum(probs[:kept]))
    return logprobs[token].logprob - log_mass


class Worker:
    def __init__(self, engine: Any, out: BinaryIO, vocab_size: int) -> None:
        self.engine = engine
        self.out = out
        self.vocab_size = vocab_size
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.pause_at: tuple[str, int] | None = None  # (request id, tokens) of a ``pause``
        self.lora: Any = None  # the LoRARequest of the adapters every request runs under

    def send(self, message: dict[str, Any]) -> None:
        wire.write_message(self.out, message)

    def start(self, m: dict[str, Any]) -> None:
        task = asyncio.create_task(self.generate(m))
        self.tasks[m["id"]] = task

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.pop(m["id"], None)
            if task.cancelled():  # aborted before it began: nothing was generated
                self.send(
                    {"op": "result", "id": m["id"], "tokens": [], "logprobs": [], "finish": "abort"}
                )

        task.add_done_callback(done)

    def abort(self, request_id: str) -> None:
        """Cancelling the request's task aborts it in the engine (``AsyncLLM.generate`` does
        that on cancellation); the task then reports what was generated so far."""
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def generate(self, m: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        pause = self.pause_at if self.pause_at and self.pause_at[0] == m["id"] else None
        greedy = m["temperature"] == 0
        filtered = m["top_k"] > 0 or m["top_p"] < 1
        whole = greedy and filtered and m["logprobs"]
        params = SamplingParams(
            max_tokens=m["max_tokens"],
            temperature=m["temperature"],
            top_k=0 if greedy or m["top_k"] < 0 else m["top_k"],
            top_p=1.0 if greedy else m["top_p"],
            seed=m["seed"],
            stop_token_ids=m["stop"],
            ignore_eos=True,  # only the request's stop ids end it
            logprobs=(-1 if whole else 0) if m["logprobs"] else None,
            detokenize=False,
            extra_args={PAUSE_KEY: pause[1]} if pause else None,
        )
        last = None
        try:
            async for output in self.engine.generate(
                TokensPrompt(prompt_token_ids=m["prompt"]),
                params,
                request_id=m["id"],
                lora_request=self.lora,
            ):
                last = output.outputs[0]
                if pause and len(last.token_ids) >= pause[1]:  # the engine has paused
                    self.pause_at = pause = None
                    self.send({"op": "paused"})
        except asyncio.CancelledError:
            pass  # aborted
        except Exception:  # reported as an abort; the reason goes to the engine's log
            traceback.print_exc()
            if self.engine.errored:  # the engine core died: so does this process
                os._exit(1)
        tokens = list(last.token_ids) if last is not None else []
        entries = (last.logprobs or []) if last is not None else []
        if not m["logprobs"]:
            logprobs = None
        elif whole:
            logprobs = [
                _filtered_logprob(e, t, m["top_k"], m["top_p"])
                for e, t in zip(entries, tokens, strict=True)
            ]
        else:
            logprobs = [e[t].logprob for e, t in zip(entries, tokens, strict=True)]
        finish = last.finish_reason if last is not None else None
        self.send(
            {
                "op": "result",
                "id": m["id"],
                "tokens": tokens,
                "logprobs": logprobs,
                "finish": finish if finish in ("stop", "length") else "abort",
            }
        )

    async def load(self, m: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            if "payload" in m:  # the CUDA path (`cuda_ipc`)
                await self.engine.collective_rpc("jarl_load_ipc", args=(m["payload"],))
            else:
                await self.engine.collective_rpc("jarl_load_shm", args=(m["path"], m["index"]))
            await self.engine.reset_prefix_cache()
        except Exception as e:  # the engine keeps serving; the backend reports the failure
            self.send({"op": "failed", "message": f"{type(e).__name__}: {e}"})
            return
        self.send({"op": "loaded", "seconds": time.perf_counter() - t0})

    async def load_adapter(self, m: dict[str, Any]) -> None:
        """Loads the adapters now (an unreadable folder fails the push, not a later request)
        under a new id and name: vLLM caches adapters by id and keys prefix-cache blocks by
        name and path, so nothing of the previous adapters can be served again."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        request = LoRARequest(m["name"], m["id"], m["path"])
        try:
            await self.engine.add_lora(request)
            if self.lora is not None:
                await self.engine.remove_lora(self.lora.lora_int_id)
            await self.engine.reset_prefix_cache()
        except Exception as e:  # the engine keeps serving; the backend reports the failure
            self.send({"op": "failed", "message": f"{type(e).__name__}: {e}"})
            return
        self.lora = request
        self.send({"op": "loaded", "seconds": time.perf_counter() - t0})

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                header = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(header, "big"))
            except asyncio.IncompleteReadError:
                return  # the backend is gone
            m = json.loads(body)
            if m["op"] == "generate":
                self.start(m)
            elif m["op"] == "abort":
                self.abort(m["id"])
            elif m["op"] == "load":
                await self.load(m)
            elif m["op"] == "adapter":
                await self.load_adapter(m)
            elif m["op"] == "digest":
                digests = await self.engine.collective_rpc("jarl_digest")
                self.send({"op": "digest", "digests": digests})
            elif m["op"] == "pause":
                self.pause_at = (m["id"], m["tokens"])
            elif m["op"] == "resume":
                self.pause_at = None  # a pause whose request this engine never served
                await self.engine.resume_generation()
            elif m["op"] == "shutdown":
                return


def _cpu_groups(tp: int) -> str:
    """This process's cores in ``tp`` groups, one per tensor-parallel CPU worker, as vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` takes them ("0,1|2,3"). vLLM's own default binds a worker
    per NUMA node and refuses more workers than nodes (one node: no tensor parallelism)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"tensor_parallel_size={tp} on CPU needs {tp} cores; this has {cores}")
    size = len(cores) // tp
    groups = [cores[i * size : (i + 1) * size] for i in range(tp)]
    return "|".join(",".join(map(str, group)) for group in groups)


def _engine(config: dict[str, Any]) -> Any:
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM's CPU build cannot run a seeded request whose prompt is prefilled in chunks: it
    # rewinds the request's generator after each partial chunk, and a CPU torch.Generator has
    # no offset ("CPU Generator does not use offset"), which kills the engine and every
    # request on it. On CPU every prompt is prefilled whole: chunked prefill off, and a step's
    # token budget that holds the longest prompt (a prompt waits for a step with room for it).
    cpu = current_platform.is_cpu()
    tp = config["tensor_parallel_size"]
    if cpu and tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_groups(tp)
    budget = max(config["max_model_len"], SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    rank = config["max_lora_rank"]  # None: no LoRA; else one adapter at a time, of rank <= it
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=rank) if rank else {}
    args = AsyncEngineArgs(
        model=config["model"],
        skip_tokenizer_init=True,
        dtype=config["dtype"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["max_num_seqs"],
        tensor_parallel_size=tp,
        seed=config["seed"],
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_chunked_prefill=False if cpu else None,  # None: vLLM's default
        max_num_batched_tokens=budget if cpu else None,
        gpu_memory_utilization=config["gpu_memory_utilization"],
        kv_cache_memory_bytes=config["kv_cache_bytes"],  # None: sized from the utilization
        block_size=config["block_size"],  # None: vLLM's default
        logprobs_mode="processed_logprobs",
        max_logprobs=-1,  # greedy requests with filters ask for the whole distribution
        worker_extension_cls=f"{_MODULE}.WeightLoader",
        disable_log_stats=True,
        scheduler_cls=f"{_MODULE}.PausingScheduler" if config["pausable"] else None,
        async_scheduling=False if config["pausable"] else None,  # None: vLLM's choice
        **lora,
    )
    return AsyncLLM.from_engine_args(args)


async def _serve(config: dict[str, Any], channel: Channel) -> None:
    engine = _engine(config)  # a failure here is the handshake's error (`backends.worker`)
    try:
        vocab = engine.model_config.get_vocab_size()
        worker = Worker(engine, channel.out, vocab)
        parallel = engine.vllm_config.parallel_config  # the engine args as vLLM took them
        channel.ready(
            {
                "op": "ready",
                "max_model_len": engine.model_config.max_model_len,
                "vocab_size": vocab,
                "tensor_parallel_size": parallel.tensor_parallel_size,
            }
        )
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await worker.serve(reader)
        for task in list(worker.tasks.values()):
            task.cancel()
    finally:
        engine.shutdown()


def main() -> None:
    # the message channel is the original stdout; vLLM's own output goes to stderr
    engine_main(_serve, wire.write_message, stack="vllm", name="vLLM", setup="vllm")


if __name__ == "__main__":
    main()
