"""A weight push with and without ``keep_kv_on_update``: what a running request, a kept
session and a shared prefix do with the keys and values the old weights computed.

The push lands while the engine is held (`pause`) after the request's 5th token (its first
from prefill, four from one decode call): kept, the request goes on from its pages under the
new weights (no prefill again, tokens 6.. stamped with the new version, its KV's version the
old one); not kept, the push waits for the request to finish under the old weights, and the
session's next turn is computed from scratch."""

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.engine import Engine, PagePool
from jax_agent_rl.models import Weights, load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True)
# tokens sampled when the push lands: two calls of 4 steps (the first's ragged step samples
# the first token from the prompt, its 3 decode steps the next ones)
BEFORE = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("keep_kv") / "tiny", TINY_QWEN2)


def _backend(checkpoint: Path, keep: bool) -> tuple[EmbeddedBackend, Weights]:
    """A backend on the tiny model, and other weights to push (every tensor moved by 10% of
    its own scale: the greedy tokens change)."""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    engine = Engine(
        cfg, max_concurrent_decodes=4, max_len=256, page_size=16, sharder=one_device_sharder()
    )
    return EmbeddedBackend(engine, w, steps_per_call=4, keep_kv_on_update=keep), moved(w)


def moved(w: Weights) -> Weights:
    """``w`` with every tensor moved by 10% of its own scale (seeded): other weights to push,
    under which the greedy tokens change."""
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: x + 0.1 * (np.std(x) + 1e-3) * rng.standard_normal(x.shape).astype(x.dtype), w
    )


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, 500, n))


async def _until(ready) -> None:  # type: ignore[no-untyped-def]
    while not ready():  # a state the backend holds once reached
        await asyncio.sleep(0.01)


def _push_mid_request(
    checkpoint: Path, keep: bool
) -> tuple[GenerateResult, GenerateResult, list[int], list[int]]:
    """Turn 1 of session "s" with a push (version 1) after its 5th token, then turn 2 (6 new
    tokens after it). Returns both results and the backend's prefilled tokens after turn 1 and
    after turn 2 (each minus what it was before that turn)."""
    backend, other = _backend(checkpoint, keep)
    prompt = _prompt(0, 37)
    stats = backend.stats

    async def scenario() -> tuple[GenerateResult, GenerateResult, list[int], list[int]]:
        backend.pause("t1", tokens=BEFORE)
        first = asyncio.create_task(
            backend.generate(GenerateRequest("t1", prompt, GREEDY, session_id="s"))
        )
        await _until(backend.is_paused)
        prefilled = [stats.prefilled_tokens]
        push = asyncio.create_task(backend.update_weights(other, 1))
        await _until(lambda: backend._update is not None or backend._gate._drained is not None)
        backend.resume()
        turn1 = await first
        await push
        prefilled.append(stats.prefilled_tokens)
        seq = (*prompt, *turn1.token_ids, *_prompt(1, 6))
        hits = [stats.prefix_hit_tokens]
        turn2 = await backend.generate(GenerateRequest("t2", seq, GREEDY, session_id="s"))
        prefilled.append(stats.prefilled_tokens)
        hits.append(stats.prefix_hit_tokens)
        await backend.close()
        return turn1, turn2, prefilled, hits

    return asyncio.run(scenario())


def _alone(checkpoint: Path, prompt: tuple[int, ...]) -> GenerateResult:
    """What the old weights sample for ``prompt`` with no push."""
    backend, _ = _backend(checkpoint, keep=False)
    result = asyncio.run(backend.generate(GenerateRequest("r", prompt, GREEDY)))
    asyncio.run(backend.close())
    return result


def test_kept_kv_goes_on_under_the_new_weights(checkpoint: Path) -> None:
    """Kept: the push lands mid-request. Its tokens up to the push are the old weights' (those
    of a run with no push), the rest sampled under the new ones (stamped 1, and not what the
    old weights sample), over the prompt's keys and values of version 0; nothing is prefilled
    again, for the request or for its session's next turn (its 6 new tokens and the last
    sampled one only)."""
    turn1, turn2, prefilled, hits = _push_mid_request(checkpoint, keep=True)
    old = _alone(checkpoint, _prompt(0, 37))
    assert len(turn1.token_ids) == 40 and turn1.weight_version == 0
    assert turn1.token_versions == (0,) * BEFORE + (1,) * (40 - BEFORE)
    assert turn1.kv_versions == (0,) * 40
    assert turn1.token_ids[:BEFORE] == old.token_ids[:BEFORE]
    assert turn1.token_ids != old.token_ids  # the new weights sampled the rest
    assert prefilled[1] == prefilled[0] == 37  # the push prefilled nothing again
    assert prefilled[2] - prefilled[1] == 6 + 1  # turn 2: past its session's pages
    assert hits[1] - hits[0] == 37 + 40 - 1
    assert turn2.token_versions == (1,) * 40 and turn2.kv_versions == (0,) * 40


def test_without_keeping_the_push_waits_and_the_session_is_computed_again(
    checkpoint: Path,
) -> None:
    """Not kept: the push waits until the running request is done; all its tokens are the
    old weights' (those of a run with no push). The session's pages are dropped: turn 2
    prefills its whole sequence under the new weights, its KV of version 1."""
    turn1, turn2, prefilled, hits = _push_mid_request(checkpoint, keep=False)
    old = _alone(checkpoint, _prompt(0, 37))
    assert turn1.token_ids == old.token_ids
    assert turn1.token_versions == turn1.kv_versions == (0,) * 40
    assert prefilled[1] == prefilled[0] == 37
    assert prefilled[2] - prefilled[1] == 37 + 40 + 6
    assert hits[1] == hits[0]
    assert turn2.weight_version == 1
    assert turn2.token_versions == turn2.kv_versions == (1,) * 40


@pytest.mark.parametrize("keep", [False, True])
def test_a_shared_prefix_never_matches_across_versions(checkpoint: Path, keep: bool) -> None:
    """Two requests of one 70-token prompt (4 full pages of 16), no session, a push between
    them: kept or not, the second does not find the first's pages (their keys are salted with
    the version) and prefills the whole prompt under the new weights. Without the push it
    would take 64 tokens from them."""
    backend, other = _backend(checkpoint, keep)
    prompt = _prompt(2, 70)

    async def scenario() -> list[GenerateResult]:
        out = [await backend.generate(GenerateRequest("a", prompt, GREEDY))]
        out.append(await backend.generate(GenerateRequest("b", prompt, GREEDY)))
        await backend.update_weights(other, 1)
        out.append(await backend.generate(GenerateRequest("c", prompt, GREEDY)))
        await backend.close()
        return out

    _, same_version, after_push = asyncio.run(scenario())
    assert backend.stats.prefix_hit_tokens == 64  # b's only
    assert backend.stats.prefilled_tokens == 70 + 6 + 70
    assert same_version.kv_versions == (0,) * 40
    assert after_push.token_versions == after_push.kv_versions == (1,) * 40


def test_the_pool_stamps_pages_with_the_version_they_were_taken_under() -> None:
    """`PagePool.oldest` is the oldest stamp of a sequence's pages; a copy takes its source's
    stamp; keys are salted with a version (the current one unless named)."""
    pool = PagePool(8)
    first = pool.take(2, 0)
    assert first is not None
    pool.version = 3
    second = pool.take(2, 0)
    assert second is not None
    assert pool.oldest(second) == 3 and pool.oldest([*second, *first]) == 0
    pool.copied(first[0], second[0])
    assert pool.oldest(second) == 0
    tokens = list(range(32))
    assert pool.keys(tokens, 16) == pool.keys(tokens, 16, 3) != pool.keys(tokens, 16, 0)
    assert pool.keys(tokens, 16, 0) == PagePool(8).keys(tokens, 16)
