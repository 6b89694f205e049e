"""The vLLM backend beyond the conformance suite: routing over several engines, engines that
die and start again, and the ways it must refuse to start. Every test leaves no engine process
behind."""

import asyncio
import os
import signal
import sysconfig
import venv
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jax_agent_rl.backends.vllm import engines
from jax_agent_rl.backends.vllm.backend import EngineStartError, VLLMBackend
from jax_agent_rl.backends.vllm.sizes import device_groups
from jax_agent_rl.models import ModelConfig, load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import GenerateRequest, GenerateResult, SamplingParams
from tests.backends.vllm import tiny_engines
from tests.processes import group_gone
from tests.weights import sparse_step

ROOT = Path(__file__).resolve().parents[3]
MAX_LEN = 128
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny", TINY_QWEN2)


@pytest.fixture
def two_engines(checkpoint: Path) -> Iterator[VLLMBackend]:
    # engine i sees only devices[i]
    backend = tiny_engines(checkpoint, MAX_LEN, replicas=2, devices=["1", "0"])
    try:
        yield backend
    finally:
        asyncio.run(backend.close())
        assert all(group_gone(pid) for pid in backend.pids)


def _req(rid: str, sampling: SamplingParams, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, (5, 6, 7, 8, 9), sampling, session_id=session)


def test_sessions_stick_to_one_engine_and_a_killed_engine_comes_back_and_serves_its_requests(
    two_engines: VLLMBackend, checkpoint: Path
) -> None:
    backend = two_engines
    # each engine process runs pinned to its own device (engine.vllm.devices)
    for pid, device in zip(backend.pids, ["1", "0"], strict=True):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={device}".encode() in environ
    long = SamplingParams(max_tokens=120, temperature=1.0, seed=1)
    _, weights = load_hf(checkpoint, sharder=one_device_sharder())
    new = jax.tree.map(lambda x: x * 1.5, weights)  # a restarted engine must load these
    killed = backend.pids[0]

    async def scenario() -> tuple[list[GenerateResult], GenerateResult, GenerateResult]:
        await backend.update_weights(new, 1)
        # a session's turns stay on the engine that served its first
        first = await backend.generate(_req("s1", GREEDY, session="traj-a"))
        home = backend.session_engine("traj-a")
        await backend.generate(_req("s2", GREEDY, session="traj-a"))
        assert backend.session_engine("traj-a") == home == 0
        # four sessionless requests spread over the two engines (fewest in flight first).
        # The engines are stopped meanwhile: on a loaded machine r0 could otherwise finish
        # before r1 is even dispatched, and routing would rightly see one request fewer.
        for pid in backend.pids:
            os.killpg(pid, signal.SIGSTOP)
        tasks = [asyncio.create_task(backend.generate(_req(f"r{i}", long))) for i in range(4)]
        while len(backend.in_flight()) < 4:  # nothing can finish: every dispatch is counted
            await asyncio.sleep(0)
        assert backend.in_flight() == {"r0": 0, "r1": 1, "r2": 0, "r3": 1}
        # the engine process serving r0 and r2 is killed (its vLLM children left to the
        # backend); the other carries on, and the dead one starts again and serves them
        os.kill(killed, signal.SIGKILL)
        os.killpg(killed, signal.SIGCONT)
        os.killpg(backend.pids[1], signal.SIGCONT)
        done = list(await asyncio.gather(*tasks))
        after = await backend.generate(_req("after", GREEDY, session="traj-a"))
        return done, first, after

    done, first, after = asyncio.run(scenario())
    # nothing lost: the same prompt and seed give the same 120 tokens on either engine, the
    # restarted one serving the pushed weights (version 1), not the checkpoint's
    assert [r.finish_reason for r in done] == ["length"] * 4
    assert len({r.token_ids for r in done}) == 1 and len(done[0].token_ids) == 120
    assert {r.weight_version for r in done} == {1}
    assert [r.resent for r in done] == [1, 0, 1, 0]  # (marked in a trajectory's trace)
    assert backend.counters() == {
        "rollout/replica_deaths": 1.0,
        "rollout/replica_restarts": 1.0,
        "rollout/requests_requeued": 2.0,
    }
    # the session stays with engine 0, started again, which serves it the same tokens
    assert backend.session_engine("traj-a") == 0 and backend.pids[0] != killed
    assert after.token_ids == first.token_ids and after.finish_reason == "length"
    assert group_gone(killed)  # vLLM's own children of the dead engine are reaped too


def test_delta_pushes_serve_the_bits_of_a_whole_push_and_an_engine_past_its_restarts_aborts(
    checkpoint: Path,
) -> None:
    """``full_every=12``: 12 pushes of sparse steps (about 2% of the elements move), the first
    whole, the 11 others written into the kept /dev/shm file as their changed elements alone
    (under a tenth of a whole push's bytes), each engine reloading the layers that changed;
    then the 12th push since the whole one, of the last step, is whole: the engine's model
    state is bit for bit the same, and it serves the same tokens and logprobs. Then
    (``max_restarts=0``, the same engine for the time a start takes) the engine is killed
    with requests in flight: they end aborted, and later requests raise."""
    _, weights = load_hf(checkpoint, sharder=one_device_sharder())
    backend = tiny_engines(
        checkpoint,
        MAX_LEN,
        full_every=12,
        max_restarts=0,
    )
    pid = backend.pids[0]
    steps = [weights]
    for seed in range(11):
        steps.append(sparse_step(steps[-1], seed))
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=3)

    async def scenario() -> None:
        pushed = []
        for version, step in enumerate(steps, start=1):
            await backend.update_weights(step, version)
            assert backend.last_push is not None
            pushed.append(backend.last_push)
        assert [p.delta for p in pushed] == [i != 0 for i in range(12)]
        whole = pushed[0].bytes
        assert all(0 < p.bytes < whole / 10 for p in pushed if p.delta), [p.bytes for p in pushed]
        by_delta = await backend.generate(_req("by-delta", sampling))
        bits_by_delta = await backend.weights_digest()
        await backend.update_weights(steps[-1], 13)  # (the 12th push since the last whole)
        assert backend.last_push is not None and not backend.last_push.delta
        by_whole = await backend.generate(_req("by-whole", sampling))
        assert await backend.weights_digest() == bits_by_delta
        assert by_delta.token_ids == by_whole.token_ids
        assert by_delta.logprobs == by_whole.logprobs

    async def killed() -> list[GenerateResult]:
        os.killpg(pid, signal.SIGSTOP)  # nothing finishes before the kill
        long = SamplingParams(max_tokens=120, temperature=1.0, seed=1)
        tasks = [asyncio.create_task(backend.generate(_req(f"r{i}", long))) for i in range(2)]
        while len(backend.in_flight()) < 2:
            await asyncio.sleep(0)
        os.killpg(pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    try:
        asyncio.run(scenario())
        results = asyncio.run(killed())
        assert [r.finish_reason for r in results] == ["abort", "abort"]
        assert backend.counters()["rollout/replica_deaths"] == 1.0
        assert backend.counters()["rollout/replica_restarts"] == 0.0
        with pytest.raises(RuntimeError, match="every vLLM engine has exited"):
            asyncio.run(backend.generate(_req("after", GREEDY)))
    finally:
        asyncio.run(backend.close())
    assert group_gone(pid)


def test_missing_interpreter_names_the_fix(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match=r"scripts/setup.sh vllm"):
        tiny_engines(
            checkpoint,
            MAX_LEN,
            python=tmp_path / "no-venv" / "bin" / "python",
        )


def _venv(where: Path, *paths: Path) -> Path:
    """A real venv's python whose path also holds ``paths`` (a .pth file, as an editable
    install writes one)."""
    venv.create(where, with_pip=False)
    (site,) = where.glob("lib/python*/site-packages")
    (site / "paths.pth").write_text("".join(f"{path}\n" for path in paths))
    return where / "bin" / "python"


def test_an_interpreter_that_hangs_is_named_not_waited_on_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The distribution's look-up runs the interpreter (in the pre-run checks and before an
    engine starts): one that never answers (a hung NFS mount, a wrapper script waiting on a
    lock) is named past its bound; before, `jarl train` waited on it for ever."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 3600\n")
    python.chmod(0o755)
    monkeypatch.setattr(engines, "LOOKUP_S", 0.5)
    assert engines.interpreter_problem(python) == (
        f"the vLLM interpreter {python} did not answer within 0.5s (hung)"
    )


def test_interpreter_without_the_engine_distribution_names_the_fix(
    checkpoint: Path, tmp_path: Path
) -> None:
    python = _venv(tmp_path / "bare")
    with pytest.raises(EngineStartError, match=r"has no jarl-gpu-backend.*scripts/setup.sh vllm"):
        tiny_engines(
            checkpoint,
            MAX_LEN,
            python=python,
        )


def test_interpreter_without_vllm_names_the_fix(checkpoint: Path, tmp_path: Path) -> None:
    # the engine's distribution and this process's packages (numpy, for the wire), no vLLM
    python = _venv(tmp_path / "no-vllm", ROOT / "gpu_backend", Path(sysconfig.get_path("purelib")))
    with pytest.raises(EngineStartError, match=r"vLLM is not importable.*scripts/setup.sh vllm"):
        tiny_engines(
            checkpoint,
            MAX_LEN,
            python=python,
        )


def test_checkpoint_vllm_cannot_load_fails_with_its_reason(
    checkpoint: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    data = (checkpoint / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # a cut-off download
    with pytest.raises(EngineStartError, match="vLLM engine failed") as error:
        tiny_engines(broken, MAX_LEN, startup_timeout_s=600)
    assert "safetensors" in str(error.value).lower()


def test_the_rollout_settings_map_to_vllms_cache() -> None:
    """engine.kv_cache_gib sizes each replica's KV cache (vLLM's kv_cache_memory_bytes) in
    blocks of engine.page_size (its block_size), as the embedded engine sizes its pool: 0 is
    enough for max_concurrent sequences of max_model_len."""
    from jax_agent_rl.backends.vllm.sizes import kv_cache_bytes
    from jax_agent_rl.config import EngineSection

    cfg = ModelConfig.from_hf(TINY_QWEN2)
    # a block: keys and values of every layer, 16 positions, 2 bytes (bfloat16)
    block = 2 * cfg.num_layers * cfg.num_kv_heads * 16 * cfg.head_dim * 2
    dense = EngineSection(page_size=16, max_concurrent=8, max_model_len=100)
    assert kv_cache_bytes(dense, cfg, "bfloat16") == 8 * 7 * block  # 7 blocks hold 100
    sized = EngineSection(page_size=16, kv_cache_gib=0.001)
    assert kv_cache_bytes(sized, cfg, "bfloat16") == (2**30 // 1000 // block) * block


def test_tensor_parallel_engine_takes_the_setting_and_matches_the_learner(
    checkpoint: Path,
) -> None:
    """vLLM's CPU build shards the model over two CPU workers (the worker binds each to half of
    this process's cores); the engine reports the setting as vLLM took it, and its sampled
    tokens' logprobs are the learner's recomputation within the fp32 tolerance."""
    from tests.conformance.conftest import Learner

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores")
    backend = tiny_engines(
        checkpoint,
        MAX_LEN,
        tensor_parallel_size=2,
    )
    try:
        assert [s["tensor_parallel_size"] for s in backend.engine_settings()] == [2]
        sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=True)
        prompt = (5, 6, 7, 8, 9)
        result = asyncio.run(backend.generate(GenerateRequest("tp", prompt, sampling)))
        assert len(result.token_ids) == 8 and result.logprobs is not None
        ref = Learner(checkpoint).logprobs(prompt, result.token_ids, sampling, None)
        diff = max(abs(a - b) for a, b in zip(result.logprobs, ref, strict=True))
        assert diff <= backend.capabilities.logprob_tolerance, diff
    finally:
        asyncio.run(backend.close())
        assert all(group_gone(pid) for pid in backend.pids)


def test_devices_go_to_engines_tensor_parallel_size_at_a_time() -> None:
    """engine.vllm.devices as launch/gpu.sh --tensor-parallel writes it."""
    assert device_groups("4,5,6,7", 2) == ["4,5", "6,7"]
    assert device_groups("2,3,4,5,6,7", 3) == ["2,3,4", "5,6,7"]
    assert device_groups("1,0", 1) == ["1", "0"]
    assert device_groups("", 2) == []
