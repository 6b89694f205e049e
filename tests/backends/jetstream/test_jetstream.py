"""The JetStream backend beyond the conformance suite: JetStream's own orchestrator serving our
engine samples exactly what the in-process backend does, a killed server aborts what was in
flight, and the ways the backend must refuse to start. No test leaves a server behind."""

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.backends.jetstream.client import (
    JetStreamBackend,
    ServerSampling,
    ServerStartError,
)
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import FinishReason
from jax_agent_rl.rollout import (
    EmbeddedBackend,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    SamplingParams,
)
from jax_agent_rl.rollout.gate import Ticket
from tests.processes import group_gone

MAX_LEN = 128
SLOTS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("jetstream") / "tiny", TINY_QWEN2)


def _server(checkpoint: Path, stops: tuple[int, ...] = (), **kw: object) -> JetStreamBackend:
    """A greedy server of ``checkpoint``; its programs compile when first needed (no warmup:
    tests/backends/jetstream/test_jetstream_training.py runs one that warms up)."""
    return JetStreamBackend(
        checkpoint,
        ModelConfig.from_pretrained(checkpoint),
        sampling=ServerSampling(temperature=0.0, stop_token_ids=stops),
        max_model_len=MAX_LEN,
        slots=SLOTS,
        warmup=False,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def closing() -> Iterator[list[JetStreamBackend]]:
    """Backends a test started: closed after it, and none of their processes left."""
    started: list[JetStreamBackend] = []
    yield started
    for backend in started:
        asyncio.run(backend.close())
        assert group_gone(backend.proc.pid)


def _text(ids: Sequence[int]) -> str:
    """A stand-in for a tokenizer's decode (the checkpoint has none): each id as ``<id>``."""
    return "".join(f"<{t}>" for t in ids)


def _prompts() -> list[tuple[int, ...]]:
    rng = np.random.default_rng(0)
    return [tuple(int(t) for t in rng.integers(1, 500, n)) for n in (3, 9, 17, 31, 64, 110)]


async def _all(backend: object, requests: list[GenerateRequest]) -> list[GenerateResult]:
    return list(await asyncio.gather(*(backend.generate(r) for r in requests)))  # type: ignore[attr-defined]


def test_jetstream_serves_the_greedy_tokens_of_the_in_process_backend(
    checkpoint: Path, closing: list[JetStreamBackend]
) -> None:
    """The peer check: more prompts than slots, so JetStream's orchestrator queues, inserts
    and frees slots; its server stops at its own stop id, the client at the request's other,
    and at a stop string over three tokens (the embedded backend in its decode call, the
    client at the response that completes it: both keep the tokens up to that one)."""
    cfg, weights = load_hf(checkpoint, sharder=one_device_sharder())
    # every step over all slots, as JetStream's generate runs it: the same programs, so the
    # same rounding whichever slots the two put the requests in
    engine = Engine(
        cfg,
        max_concurrent_decodes=SLOTS,
        max_len=MAX_LEN,
        batch_buckets=False,
        sharder=one_device_sharder(),
    )
    embedded = EmbeddedBackend(engine, weights, decode=_text)
    prompts = _prompts()
    free = SamplingParams(max_tokens=24, temperature=0.0)
    replies = asyncio.run(
        _all(embedded, [GenerateRequest(f"f{i}", p, free) for i, p in enumerate(prompts)])
    )
    # stop ids that end some replies early: the server's (from one reply) and another one
    server_stop, client_stop = replies[0].token_ids[5], replies[2].token_ids[7]
    samplings = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(server_stop,)),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(client_stop, server_stop)),
    ]
    requests = [
        GenerateRequest(f"r{k}-{i}", p, sampling)
        for k, sampling in enumerate(samplings)
        for i, p in enumerate(prompts)
    ]
    reference = asyncio.run(_all(embedded, requests))
    # a stop string made by tokens 3, 4 and 5 of a long reply: the prefill samples token 0
    # and each decode call 4 more, so it starts in one call and ends in the next
    long = next(r.token_ids for r in reference if len(r.token_ids) >= 10)
    stop = "".join(f"<{t}>" for t in long[3:6])[1:-1]
    assert next(k for k in range(1, 11) if stop in _text(long[:k])) == 6
    stopping = dataclasses.replace(samplings[0], stop=(stop,))
    requests += [GenerateRequest(f"s-{i}", p, stopping) for i, p in enumerate(prompts)]
    reference += asyncio.run(_all(embedded, requests[len(reference) :]))
    assert any(r.token_ids == long[:6] and r.finish_reason == "stop" for r in reference[-6:])
    asyncio.run(embedded.close())

    jetstream = _server(checkpoint, stops=(server_stop,), decode=_text)
    closing.append(jetstream)
    served = asyncio.run(_all(jetstream, requests))
    for ours, theirs in zip(reference, served, strict=True):
        assert theirs.token_ids == ours.token_ids
        assert theirs.finish_reason == ours.finish_reason
        assert theirs.logprobs is None  # declared absent, not made up
    finishes = [r.finish_reason for r in served]
    assert "stop" in finishes[: len(prompts)] and "length" in finishes[: len(prompts)]
    assert finishes[2] == "length" and finishes[len(prompts) + 2] == "stop"  # the client's stop
    # the last prompt (110 tokens) meets the model length before its budget
    assert len(served[5].token_ids) == MAX_LEN - 110 and served[5].finish_reason == "length"
    # a request that does not stop where the server stops is refused, naming the id
    with pytest.raises(InvalidRequestError, match=f"does not stop at \\[{server_stop}\\]"):
        asyncio.run(jetstream.generate(GenerateRequest("free", prompts[0], free)))


def test_a_killed_server_comes_back_with_the_newest_weights_and_serves_what_was_in_flight(
    checkpoint: Path, closing: list[JetStreamBackend]
) -> None:
    backend = _server(checkpoint)
    closing.append(backend)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    requests = [GenerateRequest(f"r{i}", (5, 6, 7 + i), long) for i in range(6)]
    _, weights = load_hf(checkpoint, sharder=one_device_sharder())
    new = jax.tree.map(lambda x: x * 1.5, weights)  # the restarted server must load these

    async def scenario() -> tuple[list[GenerateResult], list[GenerateResult]]:
        await backend.update_weights(new, 1)
        before = list(await asyncio.gather(*(backend.generate(r) for r in requests)))
        pid = backend.proc.pid
        # the server is stopped, so no request can finish before the kill
        os.killpg(pid, signal.SIGSTOP)
        again = [dataclasses.replace(r, request_id=f"again{i}") for i, r in enumerate(requests)]
        tasks = [asyncio.create_task(backend.generate(r)) for r in again]  # more than the slots
        while len(backend.in_flight()) < 6:
            await asyncio.sleep(0)
        os.killpg(pid, signal.SIGKILL)
        return before, list(await asyncio.gather(*tasks))

    before, after = asyncio.run(scenario())
    # greedy: the server started again serves the pushed weights' tokens, whole
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.finish_reason for r in after] == ["length"] * 6
    assert {r.weight_version for r in after} == {1}
    assert [r.resent for r in after] == [1] * 6  # (marked in a trajectory's trace)
    counted = backend.counters()
    assert counted["rollout/replica_deaths"] == counted["rollout/replica_restarts"] == 1
    assert counted["rollout/requests_requeued"] == 6
    assert backend.exited is None


def test_a_killed_server_past_its_restarts_aborts_what_was_in_flight(
    checkpoint: Path, closing: list[JetStreamBackend]
) -> None:
    backend = _server(checkpoint, max_restarts=0)
    closing.append(backend)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    pid = backend.proc.pid

    async def scenario() -> list[GenerateResult]:
        # the server is stopped, so no request can finish before the kill
        os.killpg(pid, signal.SIGSTOP)
        tasks = [
            asyncio.create_task(backend.generate(GenerateRequest(f"r{i}", (5, 6, 7 + i), long)))
            for i in range(6)  # more than the slots: some wait in JetStream's queue
        ]
        while len(backend.in_flight()) < 6:
            await asyncio.sleep(0)
        os.killpg(pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    results = asyncio.run(scenario())
    assert [r.finish_reason for r in results] == ["abort"] * 6
    assert all(len(r.token_ids) < 100 for r in results)
    deadline = time.monotonic() + 60
    while backend.exited is None and time.monotonic() < deadline:  # the watcher reaps it
        time.sleep(0.05)
    assert backend.exited == f"exit code {-signal.SIGKILL}"
    assert backend.counters()["rollout/replica_restarts"] == 0
    with pytest.raises(RuntimeError, match="JetStream server has exited"):
        asyncio.run(backend.generate(GenerateRequest("after", (5, 6), long)))
    assert group_gone(pid)


def test_missing_interpreter_names_the_fix(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match=r"scripts/setup.sh jetstream"):
        _server(checkpoint, python=tmp_path / "no-venv" / "bin" / "python")


def test_interpreter_without_jetstream_names_the_fix(checkpoint: Path) -> None:
    # this test process's interpreter has JetStream's client stubs but not its server's stack
    with pytest.raises(ServerStartError, match=r"not importable.*scripts/setup.sh jetstream"):
        _server(checkpoint, python=sys.executable)


def test_a_checkpoint_the_server_cannot_load_fails_with_its_reason(
    checkpoint: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    data = (checkpoint / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # a cut-off download
    with pytest.raises(ServerStartError) as error:
        _server(broken)
    assert "safetensors" in str(error.value).lower() or "header" in str(error.value).lower()


def test_the_server_admits_only_its_client(
    checkpoint: Path, closing: list[JetStreamBackend]
) -> None:
    """Loopback is open to every local user: a call without the client's token is refused,
    Decode and the weight swap alike, and the client is served on."""
    import grpc
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    backend = _server(checkpoint)
    closing.append(backend)
    with grpc.insecure_channel(f"127.0.0.1:{backend.port}") as channel:
        request = jetstream_pb2.DecodeRequest(
            session_cache="s",
            max_tokens=4,
            token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5, 6]),
        )
        for metadata in ((), (("jarl-token", "guess"),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(
                    jetstream_pb2_grpc.OrchestratorStub(channel).Decode(request, metadata=metadata)
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        load = channel.unary_unary("/jarl.Control/Load")
        with pytest.raises(grpc.RpcError) as refused:
            load(b'{"path": "/tmp/elsewhere"}')
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert len(asyncio.run(backend.generate(GenerateRequest("ok", (5, 6), greedy))).token_ids) == 4


def test_a_client_that_dies_leaves_no_server(checkpoint: Path) -> None:
    """The server serves until its stdin closes, so a client killed without `close` takes its
    server with it."""
    script = (
        "import os, sys\n"
        "from jax_agent_rl.models import ModelConfig\n"
        "from jax_agent_rl.backends.jetstream.client import JetStreamBackend\n"
        f"path = {str(checkpoint)!r}\n"
        "b = JetStreamBackend(path, ModelConfig.from_pretrained(path),"
        f" max_model_len={MAX_LEN}, slots={SLOTS})\n"
        "print(b.proc.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=600
    )
    assert group_gone(int(done.stdout.split()[-1]))


# ------------------------------------------------- races and limits (each once a found defect)


# the shared server's engine settings, none of them the default (engine.page_size, ...)
PAGE_SIZE, POOL_PAGES, PREFILL_CHUNK, STEPS = 16, SLOTS * MAX_LEN // 16 + 3, 32, 3


@pytest.fixture(scope="module")
def shared(checkpoint: Path) -> Iterator[JetStreamBackend]:
    cfg = ModelConfig.from_pretrained(checkpoint)
    # a page: keys and values of every layer, 16 positions, float32 (the CPU pool's dtype)
    page = 2 * cfg.num_layers * cfg.num_kv_heads * PAGE_SIZE * cfg.head_dim * 4
    backend = _server(
        checkpoint,
        page_size=PAGE_SIZE,
        kv_cache_gib=POOL_PAGES * page / 2**30,
        prefill_chunk=PREFILL_CHUNK,
        steps=STEPS,
    )
    yield backend
    asyncio.run(backend.close())
    assert group_gone(backend.proc.pid)


def test_the_server_builds_its_engine_from_the_rollout_settings(shared: JetStreamBackend) -> None:
    """engine.page_size, kv_cache_gib, prefill_chunk and steps_per_call reach the server's
    engine, as it reports from its own process; a 110-token prompt (4 chunks of 32) is served."""
    assert shared.engine == {
        "page_size": PAGE_SIZE,
        "num_pages": POOL_PAGES,
        "prefill_chunk": PREFILL_CHUNK,
        "steps_per_call": STEPS,
    }
    prompt = _prompts()[-1]
    done = asyncio.run(shared.generate(GenerateRequest("long", prompt, SamplingParams(8, 0.0))))
    assert len(done.token_ids) == 8 and done.finish_reason == "length"


def test_a_cancelled_generate_cancels_its_stream(shared: JetStreamBackend) -> None:
    ended: dict[str, tuple[list[int], str, int]] = {}
    started, done = threading.Event(), threading.Event()
    stream = shared._stream

    def spy(request: GenerateRequest, ticket: Ticket) -> tuple[list[int], FinishReason, int]:
        started.set()
        out = stream(request, ticket)
        ended[request.request_id] = out
        done.set()
        return out

    shared._stream = spy  # type: ignore[method-assign]
    try:

        async def scenario() -> None:
            long = SamplingParams(max_tokens=120, temperature=0.0)
            task = asyncio.create_task(shared.generate(GenerateRequest("c", (5, 6), long)))
            assert await asyncio.to_thread(started.wait, 120)  # its stream is on a pool thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
        assert done.wait(120)
    finally:
        del shared._stream
    tokens, finish, resent = ended["c"]
    assert finish == "abort" and len(tokens) < 120 and resent == 0


def test_an_empty_request_id_is_served(shared: JetStreamBackend) -> None:
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    assert len(asyncio.run(shared.generate(GenerateRequest("", (5, 6), greedy))).token_ids) == 3


def test_closing_during_an_update_aborts_and_raises_plainly(checkpoint: Path) -> None:
    backend = _server(checkpoint)
    _, weights = load_hf(checkpoint, sharder=one_device_sharder())
    long = SamplingParams(max_tokens=100, temperature=0.0)

    async def scenario() -> tuple[BaseException | None, GenerateResult, GenerateResult]:
        first = asyncio.create_task(backend.generate(GenerateRequest("long", (9, 9), long)))
        while not backend.in_flight():
            await asyncio.sleep(0)
        up = asyncio.create_task(backend.update_weights(weights, 1))
        await asyncio.sleep(0)
        gated = asyncio.create_task(backend.generate(GenerateRequest("g", (5, 6), long)))
        await asyncio.sleep(0)
        await backend.close()
        error = (await asyncio.gather(up, return_exceptions=True))[0]
        return error, await first, await gated

    error, first, gated = asyncio.run(scenario())
    assert isinstance(error, RuntimeError) and "closed" in str(error)
    assert first.finish_reason == gated.finish_reason == "abort"
    assert group_gone(backend.proc.pid)


def test_a_context_beyond_jetstreams_buckets_fails_at_start(tmp_path: Path) -> None:
    long_context = write_hf_checkpoint(
        tmp_path / "long", {**TINY_QWEN2, "max_position_embeddings": 40_000}
    )
    with pytest.raises(ServerStartError, match="beyond JetStream's prompt buckets"):
        JetStreamBackend(
            long_context,
            ModelConfig.from_pretrained(long_context),
            max_model_len=33_000,
            slots=SLOTS,
        )


def test_a_start_that_fails_leaves_no_thread(checkpoint: Path) -> None:
    import jax

    _, weights = load_hf(checkpoint, sharder=one_device_sharder())
    wrong = dataclasses.replace(weights, embed=jax.numpy.zeros((7, 7)))
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="could not load the weights"):
        _server(checkpoint, params=wrong)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("jetstream")]


def test_a_request_sampling_otherwise_names_the_sampling_key(shared: JetStreamBackend) -> None:
    """The refusal names the key that sets the server's sampling: sampling.temperature (it
    named engine.temperature, a key the rollout section's split never made)."""
    hot = SamplingParams(max_tokens=3, temperature=0.5)
    with pytest.raises(InvalidRequestError, match=r"set when it starts: sampling\.temperature"):
        asyncio.run(shared.generate(GenerateRequest("hot", (5, 6), hot)))
