"""The JetStream server process: this project's engine under JetStream's own orchestrator
(``Driver``) and gRPC servicer, on loopback. Runs under ``.venv-jetstream``, started by
`jax_agent_rl.backends.jetstream.client.JetStreamBackend`:

    .venv-jetstream/bin/python -m jax_agent_rl.backends.jetstream.server '{"checkpoint": ...}'

Every call must carry the metadata ``jarl-token`` equal to the ``JARL_JETSTREAM_TOKEN`` the
server was started with (in its environment, which only its own user can read): loopback is
open to every local user, and a stranger's ``Load`` would swap the policy being trained.

Its ``main`` is `jax_agent_rl.backends.worker`'s. Its handshake is one JSON line on its stdout
once serving, ``{"port", "vocab_size", "max_len", "devices", "placement", "engine"}``
(``devices``: how many its JAX backend opened; ``placement``: the TPU chip variables of its
own environment, see `jax_agent_rl.backends.jetstream.chips`; ``engine``: its engine's
``page_size``, ``num_pages``, ``prefill_chunk`` and ``steps_per_call``, as built from the
rollout settings), or ``{"error"}`` and it exits, and it
serves until its stdin closes: the client is gone, so is the server. Everything else it prints
(JetStream logs to stdout) goes to stderr.

Services on the port:

- ``jetstream_proto.Orchestrator``: JetStream's ``Decode`` and ``HealthCheck``. A guard in
  front of ``Decode`` refuses (``INVALID_ARGUMENT``) what would raise inside JetStream's
  threads, since JetStream then kills the whole process: text prompts (this server takes token
  ids), ids outside the vocabulary, prompts leaving no room to generate, and requests without
  a ``session_cache`` (JetStream 0.2.2 prepends a BOS token to those; any non-empty string
  turns that off).
- ``jarl.Control/Load``: the request is JSON ``{"path", "adapters"}``, an HF checkpoint folder
  (config.json and safetensors, as `models.save_hf` writes it) whose weights replace the
  served ones, or (``adapters``: a LoRA model, started with the config's ``lora``) a PEFT
  adapter folder (`models.adapters.write_peft`) whose adapters replace the served ones on the
  same base, applied unmerged as the embedded engine does; the reply is JSON ``{"seconds"}``.
  The weights keep their shapes, so nothing compiles again. The client drains its requests
  first, so no request sees two versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from jax_agent_rl.backends.worker import Channel, engine_main

HOST = "127.0.0.1"
TOKEN_ENV = "JARL_JETSTREAM_TOKEN"
TOKEN_KEY = "jarl-token"


def _send(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _problem(request: Any, vocab_size: int, max_len: int) -> str | None:  # noqa: PLR0911 - one return per check
    """Why JetStream must not see ``request`` (a ``DecodeRequest``), or None."""
    if request.WhichOneof("content") != "token_content":
        return "this server takes token ids (token_content), not text"
    if not request.session_cache:
        return (
            "session_cache is empty: JetStream would put a BOS token before the prompt; "
            "set it to any non-empty string"
        )
    ids = list(request.token_content.token_ids)
    if not ids:
        return "token_ids is empty"
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    if len(ids) >= max_len:
        return f"a prompt of {len(ids)} tokens leaves no room within max_len={max_len}"
    if request.max_tokens < 1:
        return f"max_tokens={request.max_tokens}: must be at least 1"
    return None


def _adapter(config: dict[str, Any]) -> Any:
    """Our engine over the checkpoint (with LoRA adapters of the config's ``lora``: fresh ones,
    which change nothing until the client pushes its own), compiled, in JetStream's
    interface."""
    import jax

    from jax_agent_rl.backends.jetstream.engine import (
        JetStreamEngine,
        LiveParams,
        max_prefill_length,
    )
    from jax_agent_rl.engine import Engine, cache_dtype, compile_platform, pool_pages
    from jax_agent_rl.models import Lora, Sharder, load_hf, make_mesh
    from jax_agent_rl.models.adapters import init_adapters, with_adapters
    from jax_agent_rl.protocol import SamplingParams

    devices = jax.local_devices()[: config.get("devices", 1)]
    tensor = config.get("tensor", 1)
    sharder = Sharder(make_mesh(len(devices) // tensor, 1, tensor, devices=devices))
    model, weights = load_hf(config["checkpoint"], config["dtype"], sharder=sharder)
    if config["lora"] is not None:
        lora = config["lora"]
        model = dataclasses.replace(
            model, lora=Lora(lora["rank"], lora["alpha"], tuple(lora["targets"]))
        )
        weights = with_adapters(weights, init_adapters(jax.random.key(0), model))
    max_len, slots, page_size = config["max_len"], config["slots"], config["page_size"]
    max_prefill_length(max_len)  # raises now, not in JetStream's thread (which kills us)
    # the pool as the embedded engine sizes it, in the dtype it holds on this platform
    width = jax.numpy.dtype(cache_dtype(model, compile_platform(sharder))).itemsize
    engine = Engine(
        model,
        max_concurrent_decodes=slots,
        max_len=max_len,
        page_size=page_size,
        num_pages=pool_pages(model, page_size, width, config["kv_cache_gib"], slots, max_len),
        prefill_chunk=config["prefill_chunk"],
        sharder=sharder,
    )
    if len(config["stop_ids"]) > engine.max_stop_ids:
        raise ValueError(
            f"{len(config['stop_ids'])} stop ids; the engine's slots hold {engine.max_stop_ids}"
        )
    params = LiveParams(engine.load_params(weights))
    if config["warmup"]:
        engine.warmup_slots(params.current, config["steps"])
    sampling = SamplingParams(
        max_tokens=1,
        temperature=config["temperature"],
        top_k=config["top_k"],
        top_p=config["top_p"],
        stop_token_ids=tuple(config["stop_ids"]),
    )
    adapter = JetStreamEngine(engine, params, sampling, config["steps"], config["seed"])
    if config["warmup"]:
        adapter.warmup()
    return adapter


async def _serve(config: dict[str, Any], channel: Channel) -> None:
    import grpc
    import jax

    from jax_agent_rl.backends.jetstream import compat
    from jax_agent_rl.backends.jetstream.chips import TPU_ENV_KEYS
    from jax_agent_rl.backends.jetstream.push import read_push
    from jax_agent_rl.models import request_cpu_devices

    request_cpu_devices(config.get("devices", 1))  # on CPU; on TPU its chips are its devices

    compat.install()
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2_grpc

    logging.getLogger().setLevel(logging.WARNING)  # JetStream logs every decode step at DEBUG
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"{TOKEN_ENV} is not set: the server would serve any local user")

    def admitted(context: Any) -> bool:
        given = dict(context.invocation_metadata() or ()).get(TOKEN_KEY, "")
        return hmac.compare_digest(str(given), token)

    adapter = _adapter(config)
    engine, params, vocab_size, max_len = (
        adapter.engine,
        adapter.params,
        adapter.engine.cfg.vocab_size,
        adapter.engine.max_len,
    )
    driver = orchestrator.Driver(
        prefill_engines=[adapter],
        generate_engines=[adapter],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=True,
    )

    class Guarded(orchestrator.LLMOrchestrator):
        async def Decode(self, request: Any, context: Any = None) -> AsyncIterator[Any]:  # noqa: N802 - gRPC's name
            if not admitted(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"no valid {TOKEN_KEY}")
            problem = _problem(request, vocab_size, max_len)
            if problem is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            async for response in super().Decode(request, context):
                yield response

    def load(asked: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        new = read_push(engine, params.current, config["dtype"], asked)
        params.swap(jax.block_until_ready(new))
        return time.perf_counter() - t0

    async def control_load(request: bytes, context: Any) -> bytes:
        if not admitted(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"no valid {TOKEN_KEY}")
        try:
            seconds = await asyncio.to_thread(load, json.loads(request))
        except Exception as e:  # the old weights keep serving; the client reports it
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return json.dumps({"seconds": seconds}).encode()

    server = grpc.aio.server()
    jetstream_pb2_grpc.add_OrchestratorServicer_to_server(Guarded(driver), server)
    control = grpc.method_handlers_generic_handler(
        "jarl.Control", {"Load": grpc.unary_unary_rpc_method_handler(control_load)}
    )
    server.add_generic_rpc_handlers((control,))
    port = server.add_insecure_port(f"{HOST}:0")
    await server.start()
    placement = {k: os.environ[k] for k in TPU_ENV_KEYS if k in os.environ}
    ready = {"port": port, "vocab_size": vocab_size, "max_len": max_len}
    layout = {
        "page_size": engine.page_size,
        "num_pages": engine.num_pages,
        "prefill_chunk": engine.prefill_chunk,
        "steps_per_call": adapter.steps,
    }
    channel.ready(
        ready | {"devices": jax.local_device_count(), "placement": placement, "engine": layout}
    )
    try:  # serve until the client closes our stdin (or dies)
        await asyncio.to_thread(sys.stdin.buffer.read)
    finally:
        await server.stop(grace=None)
        driver.stop()


def main() -> None:
    # the client reads the original stdout; JetStream's own logging goes to stderr
    engine_main(
        _serve,
        _send,
        stack="jetstream.core.orchestrator",  # JetStream's stack, TensorFlow included
        name="JetStream",
        setup="jetstream",
    )


if __name__ == "__main__":
    main()
