"""A staged weight push (`engine.push.staged`, the default): whole new weights are placed on the
engine's devices in a round of their own beside its decode call, then swapped in. It serves
exactly what a push that drops the old weights first serves; bad weights are refused before
anything is swapped; and the push says how long it held generation up (`PushStats.stall_s`)."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import Weights, load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult, SamplingParams
from tests.engine.test_keep_kv import moved

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)
# tokens sampled when the push comes: two calls of 4 steps (the first's ragged step samples
# the first token from the prompt, its 3 decode steps the next ones)
BEFORE = 8
PROMPTS = [tuple(int(t) for t in np.random.default_rng(s).integers(1, 500, 9)) for s in range(3)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Weights, Weights]:
    """The tiny model's engine, its weights, and other weights to push (`moved`)."""
    checkpoint = write_hf_checkpoint(tmp_path_factory.mktemp("staged") / "tiny", TINY_QWEN2)
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    engine = Engine(
        cfg, max_concurrent_decodes=4, max_len=128, page_size=16, sharder=one_device_sharder()
    )
    return engine, w, moved(w)


def _served(
    weights: tuple[Engine, Weights, Weights], staged: bool, keep_kv: bool
) -> tuple[list[GenerateResult], list[GenerateResult], list[np.ndarray], EmbeddedBackend]:
    """A greedy turn with a push of the other weights after its 5th token (the engine held
    there, `pause`, until the push is under way), then greedy turns after the push: the
    results, the engine's weights after the push, and the backend."""
    engine, w, other = weights
    backend = EmbeddedBackend(
        engine, w, steps_per_call=4, staged_push=staged, keep_kv_on_update=keep_kv
    )

    async def until(ready) -> None:  # type: ignore[no-untyped-def]
        while not ready():  # a state the backend holds once reached
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[list[GenerateResult], list[GenerateResult]]:
        try:
            backend.pause("a", tokens=BEFORE)
            running = asyncio.create_task(
                backend.generate(GenerateRequest("a", PROMPTS[0], GREEDY))
            )
            await until(backend.is_paused)
            push = asyncio.create_task(backend.update_weights(other, 1))
            await until(lambda: backend._update is not None or backend._gate._drained is not None)
            backend.resume()
            before = [await running]
            await push
            after = [
                await backend.generate(GenerateRequest(f"b{i}", p, GREEDY))
                for i, p in enumerate(PROMPTS)
            ]
            return before, after
        finally:
            await backend.close()

    before, after = asyncio.run(scenario())
    return before, after, [np.asarray(x) for x in jax.tree.leaves(backend._params)], backend


def test_a_staged_push_serves_exactly_what_a_push_in_place_serves(
    weights: tuple[Engine, Weights, Weights],
) -> None:
    """Draining: the turns in flight finish under the old weights and the later ones run under
    the new, token for token and logprob for logprob as without staging, over weights bitwise
    the same; the push held new requests for ``stall_s`` seconds (the drain and the swap)."""
    staged = _served(weights, staged=True, keep_kv=False)
    in_place = _served(weights, staged=False, keep_kv=False)
    for a, b in zip(staged[0] + staged[1], in_place[0] + in_place[1], strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.token_versions == b.token_versions
    assert set(staged[0][0].token_versions) == {0}  # drained under the old
    assert all(set(r.token_versions) == {1} for r in staged[1])
    assert all(np.array_equal(x, y) for x, y in zip(staged[2], in_place[2], strict=True))
    assert staged[1] != staged[0]  # the push changed what is served
    stats = staged[3].last_push
    assert stats is not None and stats.total_s <= stats.load_s
    assert stats.stall_s > 0 and stats.bytes == sum(x.nbytes for x in jax.tree.leaves(weights[2]))


def test_a_staged_push_mid_request_stalls_decoding_for_its_swap_alone(
    weights: tuple[Engine, Weights, Weights],
) -> None:
    """Keeping the KV: the push lands between two engine calls; staged or not the same tokens
    come out; the staged push's stall is its swap (the engine's time taking it, ``total_s``),
    and its placing is counted in ``load_s`` beside it."""
    staged = _served(weights, staged=True, keep_kv=True)
    in_place = _served(weights, staged=False, keep_kv=True)
    for a, b in zip(staged[0] + staged[1], in_place[0] + in_place[1], strict=True):
        assert a.token_ids == b.token_ids and a.token_versions == b.token_versions
    versions = staged[0][0].token_versions  # the push landed after the 5th token
    assert versions == (0,) * BEFORE + (1,) * (len(versions) - BEFORE) and len(versions) > BEFORE
    stats = staged[3].last_push
    assert stats is not None and stats.stall_s == stats.total_s <= stats.load_s


def test_staged_weights_of_another_shape_are_refused_and_the_old_ones_serve_on(
    weights: tuple[Engine, Weights, Weights],
) -> None:
    """Checked before anything is placed or swapped: a `ValueError` naming the leaf, the
    version unchanged, the old weights serving on; a good push afterwards lands."""
    engine, w, other = weights
    cut = jax.tree.map(lambda x: x[:, :-1] if x.ndim >= 2 else x, other.layers)
    wrong = dataclasses.replace(other, layers=cut)
    backend = EmbeddedBackend(engine, w, steps_per_call=4)

    async def scenario() -> tuple[GenerateResult, GenerateResult, GenerateResult]:
        try:
            first = await backend.generate(GenerateRequest("a", PROMPTS[0], GREEDY))
            with pytest.raises(ValueError, match="shape"):
                await backend.update_weights(wrong, 1)
            again = await backend.generate(GenerateRequest("b", PROMPTS[0], GREEDY))
            await backend.update_weights(other, 1)
            pushed = await backend.generate(GenerateRequest("c", PROMPTS[0], GREEDY))
            return first, again, pushed
        finally:
            await backend.close()

    first, again, pushed = asyncio.run(scenario())
    assert again.token_ids == first.token_ids and again.token_versions == first.token_versions
    assert set(pushed.token_versions) == {1}
