"""A LoRA model served by vLLM's own LoRA support (one engine, started once): the pushed
adapters, written as PEFT folders, change what vLLM samples to what the learner's forward with
those adapters computes, a second push replaces them, and a request in flight during a push
finishes under the adapters it started with."""

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.backends.vllm.backend import VLLMBackend
from jax_agent_rl.models import Lora
from jax_agent_rl.models.adapters import init_adapters, with_adapters
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.lora import TARGETS, Adapter, LayerAdapters
from jax_agent_rl.rollout import GenerateRequest, GenerateResult, SamplingParams
from tests.conformance.conftest import Learner
from tests.processes import group_gone

LORA = Lora(rank=8, alpha=16.0)  # every target: q, k, v, o, gate, up, down
SAMPLING = SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=True)
PROMPT = (5, 6, 7, 8, 9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("vllm-lora") / "tiny", TINY_QWEN2)


@pytest.fixture(scope="module")
def learner(checkpoint: Path) -> Learner:
    """The learner's forward, with ``LORA`` in its config (weights without adapters run the
    base model)."""
    learner = Learner(checkpoint)
    learner.cfg = dataclasses.replace(learner.cfg, lora=LORA)
    return learner


def _adapters(learner: Learner, seed: int) -> LayerAdapters:
    """Adapters with A as PEFT initialises it and B drawn too (PEFT's zeros change nothing)."""
    fresh = init_adapters(jax.random.key(seed), learner.cfg)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(TARGETS)))
    drawn = {}
    for t in TARGETS:
        a, b = getattr(fresh, t).a, getattr(fresh, t).b
        drawn[t] = Adapter(a, 0.3 * jax.random.normal(next(keys), b.shape))
    return LayerAdapters(**drawn)


@pytest.fixture(scope="module")
def served(checkpoint: Path, learner: Learner) -> Iterator[tuple[VLLMBackend, LayerAdapters]]:
    """The backend, started as a run starts it: the policy's weights (base + adapters) as
    version 0, which pushes the adapters alone."""
    adapters = _adapters(learner, seed=1)
    backend = VLLMBackend(
        checkpoint,
        learner.cfg,
        params=with_adapters(learner.weights, adapters),
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_bytes=32 * 2**20,
    )
    try:
        yield backend, adapters
    finally:
        asyncio.run(backend.close())
        assert all(group_gone(pid) for pid in backend.pids)


def _diff(learner: Learner, result: GenerateResult, adapters: LayerAdapters | None) -> float:
    """The largest gap between the result's logprobs and the learner's for its tokens, under
    the base weights with ``adapters`` (None: the base model)."""
    w = learner.weights if adapters is None else with_adapters(learner.weights, adapters)
    assert result.logprobs is not None and len(result.token_ids) == SAMPLING.max_tokens
    ref = learner.logprobs(PROMPT, result.token_ids, SAMPLING, w)
    return float(np.max(np.abs(np.asarray(result.logprobs) - ref)))


def _request(rid: str, sampling: SamplingParams = SAMPLING) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, sampling)


def test_pushed_adapters_are_what_vllm_samples_under(
    served: tuple[VLLMBackend, LayerAdapters], learner: Learner
) -> None:
    backend, first = served
    tol = backend.capabilities.logprob_tolerance
    # the start pushed the adapters alone: their fp32 tensors' bytes
    assert backend.last_push is not None
    assert backend.last_push.bytes == sum(x.nbytes for x in jax.tree.leaves(first))
    result = asyncio.run(backend.generate(_request("a1")))
    assert result.weight_version == 0
    assert _diff(learner, result, first) <= tol
    assert _diff(learner, result, None) > 10 * tol  # the adapters matter

    second = _adapters(learner, seed=2)
    asyncio.run(backend.update_weights(second, version=1))
    assert backend.last_push.bytes == sum(x.nbytes for x in jax.tree.leaves(second))
    again = asyncio.run(backend.generate(_request("a2")))
    assert again.weight_version == 1
    assert _diff(learner, again, second) <= tol
    assert _diff(learner, again, first) > 10 * tol  # the first adapters are gone


def test_a_request_in_flight_finishes_under_the_adapters_it_started_with(
    served: tuple[VLLMBackend, LayerAdapters], learner: Learner
) -> None:
    """The gate drains the request admitted before the push (each task takes its place at
    the gate before its first await, so ``early`` is admitted and ``late`` held)."""
    backend = served[0]
    tol = backend.capabilities.logprob_tolerance
    old, new = _adapters(learner, seed=3), _adapters(learner, seed=4)
    v = backend.weight_version
    asyncio.run(backend.update_weights(old, version=v + 1))

    async def scenario() -> tuple[GenerateResult, GenerateResult]:
        early = asyncio.create_task(backend.generate(_request("early")))
        push = asyncio.create_task(backend.update_weights(new, version=v + 2))
        late = asyncio.create_task(backend.generate(_request("late")))
        await push
        return await early, await late

    early, late = asyncio.run(scenario())
    assert early.weight_version == v + 1 and _diff(learner, early, old) <= tol
    assert late.weight_version == v + 2 and _diff(learner, late, new) <= tol
    # not the same numbers by chance: the two adapters give the same tokens other logprobs
    assert _diff(learner, late, old) > 10 * tol


def test_full_weights_pushed_to_a_lora_engine_are_refused(
    served: tuple[VLLMBackend, LayerAdapters], learner: Learner
) -> None:
    backend = served[0]
    v = backend.weight_version
    with pytest.raises(ValueError, match="take its adapters alone"):
        asyncio.run(backend.update_weights(learner.weights, version=v + 1))
    assert backend.weight_version == v  # a failed push keeps the version
    result = asyncio.run(backend.generate(_request("still")))
    assert result.weight_version == v and len(result.token_ids) == SAMPLING.max_tokens
