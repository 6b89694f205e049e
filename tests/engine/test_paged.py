"""The embedded backend over the paged KV cache: memory by real length, prefixes shared by
reference, waiting and preemption under a small pool, chunked prefill beside decode rows.

The engine's state is read while the backend holds it (`pause`): a paused engine admits and
decodes nothing, so the pages and the jobs do not move under the test."""

import asyncio
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.paged import PagedChunk
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import FP32_LOGPROB_TOLERANCE
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams

# fp32 logprobs of one function computed in two reduction orders (a prefill against decode
# steps): the bound of tests/engine/test_engine.py
FP32_LOGPROBS = FP32_LOGPROB_TOLERANCE
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("paged") / "tiny", TINY_QWEN2)


def _backend(checkpoint: Path, **engine_kw: object) -> EmbeddedBackend:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    kw = {
        "max_concurrent_decodes": 4,
        "max_len": 256,
        "page_size": 16,
        "sharder": one_device_sharder(),
        **engine_kw,
    }
    return EmbeddedBackend(Engine(cfg, **kw), w)  # type: ignore[arg-type]


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, 500, n))


async def _until_paused(backend: EmbeddedBackend) -> None:
    while not backend.is_paused():  # a state the backend holds once reached
        await asyncio.sleep(0.01)


def test_pages_in_use_follow_real_lengths(checkpoint: Path) -> None:
    """Mid-flight, each request holds the pages of its cached positions plus its next decode
    call's (never max_len's), and the pool counts a page once however many hold it: two
    episodes of one prompt share its full pages."""
    backend = _backend(checkpoint)
    engine = backend.engine
    prompt = _prompt(0, 50)

    async def scenario() -> None:
        backend.pause("a", tokens=9)
        sampling = SamplingParams(max_tokens=60, temperature=1.0, seed=1)
        tasks = [
            asyncio.create_task(backend.generate(GenerateRequest(rid, p, sampling)))
            for rid, p in (("a", prompt), ("b", prompt), ("c", _prompt(1, 7)))
        ]
        await _until_paused(backend)
        jobs = list(backend._slots.values())
        assert len(jobs) == 3
        for job in jobs:  # its positions, and at most those of its next decode call
            assert engine.pages_for(job.pos) <= len(job.pages)
            assert len(job.pages) <= engine.pages_for(job.pos + backend._steps_per_call)
        held = {p for job in jobs for p in job.pages}
        assert backend._pool.in_use == len(held) < sum(len(job.pages) for job in jobs)
        a, b = (j for j in jobs if j.request.prompt_ids == prompt)
        assert a.pages[:3] == b.pages[:3]  # 48 positions: 3 full pages of the prompt
        assert not set(a.pages[3:]) & set(b.pages[3:])  # each writes into its own
        backend.resume()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert backend._pool.in_use == 0  # no session kept: everything went back
    asyncio.run(backend.close())


def test_a_group_prefills_its_prompt_once(checkpoint: Path) -> None:
    """n episodes of one prompt: the first prefills it, the others take its full pages and
    compute only what lies past them (the prompt's last partial page, fewer tokens than a
    page), and sample as they would alone (the same tokens as one backend per episode)."""
    n, prompt = 4, _prompt(2, 70)  # 4 full pages of 16, then 6 tokens
    requests = [
        GenerateRequest(f"e{i}", prompt, SamplingParams(max_tokens=20, seed=i), session_id=f"e{i}")
        for i in range(n)
    ]
    backend = _backend(checkpoint)

    async def group() -> list:
        return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

    results = asyncio.run(group())
    assert backend.stats.prefilled_tokens == 70 + (n - 1) * 6
    assert backend.stats.prefix_hit_tokens == (n - 1) * 64
    asyncio.run(backend.close())
    for request, result in zip(requests, results, strict=True):
        alone = _backend(checkpoint)
        want = asyncio.run(alone.generate(request))
        assert result.token_ids == want.token_ids
        assert np.abs(np.subtract(result.logprobs, want.logprobs)).max() <= FP32_LOGPROBS
        asyncio.run(alone.close())


def test_a_tiny_pool_waits_and_preempts_and_gives_the_same_tokens(checkpoint: Path) -> None:
    """A pool of one sequence's pages (8 of 16 positions, max_len 128) and four requests
    that together need far more: admissions wait, decoding requests preempt the one admitted
    last, which is computed again from its tokens so far. Every request finishes with the
    greedy tokens of an unconstrained pool (logprobs to the fp32 bound: a recomputed prefix
    comes from a prefill, not from decode steps)."""
    prompts = [_prompt(10 + i, 20 + 5 * i) for i in range(4)]
    greedy = SamplingParams(max_tokens=70, temperature=0.0)
    requests = [GenerateRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)]

    def serve(**kw: object) -> tuple[list, EmbeddedBackend]:
        backend = _backend(checkpoint, max_len=128, **kw)

        async def all_() -> list:
            return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

        results = asyncio.run(all_())
        asyncio.run(backend.close())
        return results, backend

    small, tight = serve(num_pages=8)
    large, _ = serve()
    assert tight.stats.preempted > 0
    assert tight.stats.peak_pages_in_use <= 8
    for a, b in zip(small, large, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert np.abs(np.subtract(a.logprobs, b.logprobs)).max() <= FP32_LOGPROBS


def test_a_long_prompt_is_prefilled_between_decode_calls(checkpoint: Path) -> None:
    """A 200-token prompt in chunks of 32 (7 chunks) arrives while a short request decodes:
    each chunk is computed in one call with the short one's decode steps, so it keeps
    producing tokens while the long one is admitted; both give the tokens they give alone."""
    backend = _backend(checkpoint, prefill_chunk=32)
    short = GenerateRequest("short", _prompt(3, 5), SamplingParams(max_tokens=120, seed=0))
    long = GenerateRequest("long", _prompt(4, 200), SamplingParams(max_tokens=10, seed=1))
    steps = backend._steps_per_call

    async def scenario() -> list:
        backend.pause("short", tokens=1)
        first = asyncio.create_task(backend.generate(short))
        await _until_paused(backend)
        before = len(backend._slots[0].tokens)
        backend.pause("long", tokens=1)  # replaces the pause: runs until long's first token
        second = asyncio.create_task(backend.generate(long))
        await _until_paused(backend)
        during = len(backend._slots[0].tokens) - before
        assert during >= (7 - 1) * steps
        backend.resume()
        return [await first, await second]

    results = asyncio.run(scenario())
    assert backend.stats.prefilled_tokens == 5 + 200
    asyncio.run(backend.close())
    for request, result in zip((short, long), results, strict=True):
        alone = _backend(checkpoint, prefill_chunk=32)
        assert asyncio.run(alone.generate(request)).token_ids == result.token_ids
        asyncio.run(alone.close())


def test_a_chunk_whose_padding_passes_max_len_is_prefilled(checkpoint: Path) -> None:
    """max_len 192 (12 pages of 16): a session's next turn adds 20 tokens after 165 cached
    ones, one chunk padded to its 32-token bucket, past the sequence's last page; it is
    prefilled (the padding reads and writes nothing) and gives the tokens it gives under a
    longer max_len."""
    first = GenerateRequest("t0", _prompt(5, 155), GREEDY_10, session_id="s")
    outs = []
    for max_len in (192, 512):
        backend = _backend(checkpoint, max_len=max_len)
        turn = asyncio.run(backend.generate(first)).token_ids
        prompt = (*first.prompt_ids, *turn, *_prompt(6, 20))
        second = GenerateRequest("t1", prompt, GREEDY_5, session_id="s")
        outs.append((turn, asyncio.run(backend.generate(second)).token_ids))
        asyncio.run(backend.close())
    assert len(outs[0][0]) == 10 and len(outs[0][1]) == 5 and outs[0] == outs[1]


GREEDY_10 = SamplingParams(max_tokens=10, temperature=0.0)
GREEDY_5 = SamplingParams(max_tokens=5, temperature=0.0)


def test_a_weight_push_drops_the_old_weights_before_it_builds_the_new(checkpoint: Path) -> None:
    """Unstaged (`engine.push.staged: false`), the backend lets go of the weights it served
    before the engine lays out the new ones, so a push holds one copy of the serving weights
    (what `jarl plan` and `plan_memory` count then); weights of the wrong shape are refused
    before that, the old ones kept. (Staged, both copies are held and counted:
    tests/rollout/test_staged_push.py, tests/train/test_check.py.)"""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    held_during_load: list[bool] = []

    class Recording(Engine):
        backend: EmbeddedBackend | None = None

        def load_params(self, weights):  # type: ignore[no-untyped-def]
            if self.backend is not None:
                held_during_load.append(hasattr(self.backend, "_params"))
            return super().load_params(weights)

    engine = Recording(cfg, max_concurrent_decodes=4, max_len=256, sharder=one_device_sharder())
    backend = EmbeddedBackend(engine, w, staged_push=False)
    engine.backend = backend

    async def main() -> None:
        try:
            await backend.update_weights(w, 1)
            bad = dataclasses.replace(w, final_norm=w.final_norm[:-1])
            with pytest.raises(ValueError, match="is declared"):
                await backend.update_weights(bad, 2)
            result = await backend.generate(GenerateRequest("r", _prompt(0, 8), GREEDY))
            assert result.weight_version == 1 and len(result.token_ids) > 0
        finally:
            await backend.close()

    asyncio.run(main())
    assert held_during_load == [False]  # one load, with the old weights let go of


def test_a_forward_attends_with_each_layer_once() -> None:
    """`PagedChunk` (what a custom policy's forward attends through): a layer that attends
    with another's index would overwrite that layer's keys and values and leave its own
    stale, silently; now attending twice with one index, and reading the buffers with a
    layer never attended, are errors naming the layer."""
    G, P, ps, K, B, T = 1, 4, 4, 8, 1, 2
    pools = tuple(jnp.zeros((G, P, ps, K)) for _ in range(2))

    def chunk() -> PagedChunk:
        table = jnp.zeros((B, 2), jnp.int32)
        pos, new = jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32)
        return PagedChunk(one_device_sharder(), pools, pools, table, pos, new, 1, "ragged", B, T)

    q, kv = jnp.ones((B, T, 1, K)), jnp.ones((B, T, G, K))
    twice = chunk()
    twice.attend(0, q, kv, kv)
    with pytest.raises(ValueError, match=r"attend\(0, \.\.\.\): each of the 2 layers"):
        twice.attend(0, q, kv, kv)
    once = chunk()
    once.attend(1, q, kv, kv)
    with pytest.raises(ValueError, match=r"layers \[0\] never called attend"):
        _ = once.k
    both = chunk()
    both.attend(0, q, kv, kv)
    both.attend(1, q, kv, kv)
    assert len(both.k) == len(both.v) == 2
