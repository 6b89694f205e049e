"""The rollout protocol's contract; every backend in conftest.BACKENDS must pass all of it."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from jax_agent_rl.models.adapters import init_adapters
from jax_agent_rl.rollout import (
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    RolloutBackend,
    SamplingParams,
)
from jax_agent_rl.rollout.delta import DeltaPusher, WeightDelta, push_bytes
from tests.conformance.conftest import (
    LORA,
    MAX_LEN,
    Learner,
    Pushes,
    as_served,
    is_paused,
    pause,
    perturbed,
    resume,
    run,
    served_bits,
)
from tests.weights import sparse_step

# every backend decodes every case: optimized code pays (compiled at O0 the file took 472 s of
# a suite run's CPU, 384 s optimized)
pytestmark = pytest.mark.compute_bound

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1, 500, n))


def _req(
    rid: str, prompt: tuple[int, ...], sampling: SamplingParams, **kw: object
) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, **kw)  # type: ignore[arg-type]


def _assert_logprobs_match(
    backend: RolloutBackend,
    learner: Learner,
    prompt: tuple[int, ...],
    result: GenerateResult,
    sampling: SamplingParams,
    weights: object = None,
) -> float:
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    ref = learner.logprobs(prompt, result.token_ids, sampling, weights)  # type: ignore[arg-type]
    diff = float(np.abs(np.array(result.logprobs) - ref).max())
    assert diff <= backend.capabilities.logprob_tolerance, diff
    return diff


def test_greedy_is_deterministic(backend: RolloutBackend) -> None:
    prompt = _prompt(0, 9)
    a = run(backend.generate(_req("a", prompt, GREEDY)))
    b = run(backend.generate(_req("b", prompt, GREEDY)))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.logprobs == b.logprobs
    assert a.finish_reason == "length"


def _gap(a: GenerateResult, b: GenerateResult) -> float:
    """The largest difference of two results' logprobs (0 where neither has any)."""
    if a.logprobs is None and b.logprobs is None:
        return 0.0
    return float(np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max())


def test_seeded_sampling_reproduces(backend: RolloutBackend) -> None:
    prompt = _prompt(1, 7)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    if not backend.capabilities.per_request_sampling:  # declared absent: refused, by name
        with pytest.raises(InvalidRequestError, match="seed=1234"):
            seeded = dataclasses.replace(as_served(backend, params), seed=1234)
            run(backend.generate(_req("a", prompt, seeded)))
        other = dataclasses.replace(as_served(backend, params), temperature=0.7)
        with pytest.raises(InvalidRequestError, match=r"temperature=0\.7"):
            run(backend.generate(_req("t", prompt, other)))
        return
    a = run(backend.generate(_req("a", prompt, params)))
    b = run(backend.generate(_req("b", prompt, params)))
    c = run(backend.generate(_req("c", prompt, dataclasses.replace(params, seed=99))))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 16 tokens over a 512 vocab: equal only by accident


def test_stop_token_ids_and_budgets(backend: RolloutBackend) -> None:
    prompt = _prompt(2, 10)
    free = run(backend.generate(_req("free", prompt, GREEDY)))
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    stopped = run(backend.generate(_req("stop", prompt, params)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is returned
    one = run(backend.generate(_req("one", prompt, dataclasses.replace(GREEDY, max_tokens=1))))
    assert one.token_ids == free.token_ids[:1] and one.finish_reason == "length"
    # the model length bounds prompt + generated tokens
    long_prompt = _prompt(3, MAX_LEN - 5)
    capped = run(
        backend.generate(_req("cap", long_prompt, dataclasses.replace(GREEDY, max_tokens=50)))
    )
    assert capped.finish_reason == "length"
    assert len(long_prompt) + len(capped.token_ids) == backend.capabilities.max_model_len


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=24, temperature=1.0, seed=7),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=8),
        SamplingParams(max_tokens=24, temperature=1.3, top_p=0.8, seed=9),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.9, seed=10),
        SamplingParams(max_tokens=24, temperature=0.0),
    ],
    ids=["t1", "topk", "topp", "topk-topp", "greedy"],
)
def test_logprobs_match_learner_recomputation(
    backend: RolloutBackend, learner: Learner, sampling: SamplingParams
) -> None:
    prompt = _prompt(4, 11)
    if as_served(backend, sampling) != sampling:  # this backend's server samples otherwise
        with pytest.raises(InvalidRequestError):
            run(backend.generate(_req("lp", prompt, sampling)))
        return
    result = run(backend.generate(_req("lp", prompt, sampling)))
    if not backend.capabilities.logprobs:
        # declared absent: the trainer recomputes them, so none may be made up here
        assert result.logprobs is None
        return
    _assert_logprobs_match(backend, learner, prompt, result, sampling)
    no_lp = run(
        backend.generate(_req("nolp", prompt, dataclasses.replace(sampling, logprobs=False)))
    )
    assert no_lp.logprobs is None and no_lp.token_ids == result.token_ids


def _mixed_requests(n: int) -> list[GenerateRequest]:
    out = []
    for i in range(n):
        sampling = SamplingParams(
            max_tokens=4 + 3 * (i % 7),
            temperature=[0.0, 1.0, 0.8][i % 3],
            top_k=[-1, 30][i % 2],
            seed=100 + i,
        )
        out.append(_req(f"m{i}", _prompt(10 + i, 3 + 5 * (i % 6)), sampling))
    return out


def test_concurrent_requests_equal_sequential(backend: RolloutBackend) -> None:
    requests = [
        dataclasses.replace(r, sampling=as_served(backend, r.sampling)) for r in _mixed_requests(14)
    ]

    async def together() -> list[GenerateResult]:
        return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

    async def one_by_one() -> list[GenerateResult]:
        return [
            await backend.generate(dataclasses.replace(r, request_id=r.request_id + "s"))
            for r in requests
        ]

    batched, sequential = run(together()), run(one_by_one())
    for req, a, b in zip(requests, batched, sequential, strict=True):
        assert a.token_ids == b.token_ids, req.request_id
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.token_ids) == req.sampling.max_tokens
        assert _gap(a, b) <= backend.capabilities.logprob_tolerance


def test_abort_running_and_queued(backend: RolloutBackend) -> None:
    """Aborting a running request (x0) and a queued one (x5: behind 4 slots, or held while
    the backend is paused) ends each with ``abort`` and fewer tokens than asked, leaves the
    others whole, and the backend serves on.

    The backend is held (`conftest.pause`) in the state under test: x0 has produced a token and
    nothing generates while the aborts go out, so neither request can finish first, however
    loaded the machine or far away the engine (vLLM's and JetStream's are other processes)."""
    long = as_served(backend, SamplingParams(max_tokens=100, temperature=1.0, seed=5))
    if not backend.capabilities.abort:  # declared absent: aborting must fail loudly
        with pytest.raises(Exception):  # noqa: B017 - any clear refusal will do
            run(backend.abort("anything"))
        return

    async def scenario() -> tuple[list[GenerateResult], GenerateResult]:
        pause(backend, "x0", tokens=1)
        try:
            tasks = [
                asyncio.create_task(backend.generate(_req(f"x{i}", _prompt(i, 5), long)))
                for i in range(6)
            ]
            while not is_paused(backend):  # a state the backend holds once reached
                await asyncio.sleep(0.01)
            for i in (0, 5):
                await backend.abort(f"x{i}")
        finally:
            resume(backend)
        done = await asyncio.gather(*tasks)
        after = await backend.generate(_req("after", _prompt(0, 5), GREEDY))
        return list(done), after

    results, after = run(scenario())
    for i in (0, 5):
        assert results[i].finish_reason == "abort" and len(results[i].token_ids) < 100, i
    assert len(results[0].token_ids) >= 1  # x0 was aborted while running
    for i in (1, 2, 3, 4):
        assert results[i].finish_reason == "length" and len(results[i].token_ids) == 100, i
    assert len(after.token_ids) == 12  # still serving


def test_update_weights_changes_outputs_and_stamps_versions(
    backend: RolloutBackend, learner: Learner, pushes: Pushes
) -> None:
    """(With a LoRA policy, test_lora_conformance.py: the pushes are its adapters alone.)"""
    prompt = _prompt(6, 8)
    before = run(backend.generate(_req("v0", prompt, GREEDY)))
    v = before.weight_version
    new = pushes.other(seed=1)
    run(backend.update_weights(new, version=v + 1))
    after = run(backend.generate(_req("v1", prompt, GREEDY)))
    assert after.weight_version == v + 1
    assert after.token_ids != before.token_ids
    sampling = as_served(backend, SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    result = run(backend.generate(_req("v1s", prompt, sampling)))
    if backend.capabilities.logprobs:
        weights = pushes.weights(new)
        _assert_logprobs_match(backend, learner, prompt, result, sampling, weights=weights)
    run(backend.update_weights(pushes.start, version=v + 2))
    restored = run(backend.generate(_req("v2", prompt, GREEDY)))
    assert restored.token_ids == before.token_ids and restored.weight_version == v + 2


def test_request_arriving_during_weight_swap(
    backend: RolloutBackend, learner: Learner, pushes: Pushes
) -> None:
    """Every result is sampled under exactly the version it is stamped with."""
    new = pushes.other(seed=2)
    sampling = as_served(backend, SamplingParams(max_tokens=40, temperature=1.0, seed=11))
    prompts = [_prompt(20 + i, 6) for i in range(6)]

    async def scenario() -> list[GenerateResult]:
        early = [
            asyncio.create_task(backend.generate(_req(f"e{i}", p, sampling)))
            for i, p in enumerate(prompts[:3])
        ]
        await asyncio.sleep(0.05)
        swap = asyncio.create_task(backend.update_weights(new, version=1007))
        await asyncio.sleep(0)
        late = [
            asyncio.create_task(backend.generate(_req(f"l{i}", p, sampling)))
            for i, p in enumerate(prompts[3:])
        ]
        await swap
        return list(await asyncio.gather(*early, *late))

    results = run(scenario())
    assert {r.weight_version for r in results[3:]} == {1007}
    for prompt, result in zip(prompts, results, strict=True):
        weights = pushes.weights(new if result.weight_version == 1007 else pushes.start)
        if backend.capabilities.logprobs:
            _assert_logprobs_match(backend, learner, prompt, result, sampling, weights=weights)
    run(backend.update_weights(pushes.start, version=1008))


def test_back_to_back_updates_drain_the_requests_the_first_let_go(
    backend: RolloutBackend, learner: Learner
) -> None:
    """Requests waiting on one update go out when it ends, before a second can start: the
    second drains them, and each result is sampled wholly under the version it is stamped
    with. (Tasks run in the order they are made, and each takes its place at the weight gate
    before its first await: the first request is admitted before the update starts, so the
    update drains it, and the update holds the requests made after it. Greedy decoding makes
    every result comparable with a reference sampled alone under its version.)"""
    original, other = learner.weights, perturbed(learner.weights, seed=3)
    prompts = [(5, 6, 7 + i) for i in range(3)]
    long = as_served(backend, SamplingParams(max_tokens=60, temperature=0.0))

    async def scenario() -> list[GenerateResult]:
        first = asyncio.create_task(backend.generate(_req("long", (9, 9), long)))
        up1 = asyncio.create_task(backend.update_weights(original, 2001))
        gated = [
            asyncio.create_task(backend.generate(_req(f"g{i}", p, long)))
            for i, p in enumerate(prompts)
        ]
        await up1
        await backend.update_weights(other, 2002)  # at once: the gated ones are out already
        await first
        return list(await asyncio.gather(*gated))

    async def under(weights: object, version: int) -> list[GenerateResult]:
        await backend.update_weights(weights, version)
        requests = [_req(f"ref{version}-{i}", p, long) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

    results = run(scenario())
    reference = {v: run(under(w, v)) for v, w in ((2001, original), (2002, other))}
    assert reference[2001][0].token_ids != reference[2002][0].token_ids
    for i, result in enumerate(results):
        assert result.token_ids == reference[result.weight_version][i].token_ids
    run(backend.update_weights(original, 2003))


def test_an_abort_right_after_the_awaited_update_still_aborts(
    backend: RolloutBackend, learner: Learner
) -> None:
    """A request the update held is let through as the update ends, and is not sent yet when
    the awaited update returns (the ordering above: the first request is admitted and
    drained, the one made after the update waits at the gate): aborting it then still ends
    it."""
    if not backend.capabilities.abort:  # declared absent: test_abort_running_and_queued
        return  # checks that aborting is refused
    long = as_served(backend, SamplingParams(max_tokens=100, temperature=0.0))

    async def scenario() -> GenerateResult:
        first = asyncio.create_task(backend.generate(_req("long", (9, 9), long)))
        up = asyncio.create_task(backend.update_weights(learner.weights, 2004))
        gated = asyncio.create_task(backend.generate(_req("g", (5, 6), long)))
        await up
        await backend.abort("g")  # released already, not sent yet
        await first
        return await gated

    result = run(scenario())
    assert result.finish_reason == "abort" and len(result.token_ids) < 100


def test_a_lora_push_is_refused_unless_declared(backend: RolloutBackend, learner: Learner) -> None:
    """A backend serving no LoRA policy (`Capabilities.lora` false) refuses a push of adapters
    in words that say so, keeps its version and serves on. (Those that declare it are pushed
    adapters in test_lora_conformance.py.)"""
    assert not backend.capabilities.lora
    lora = dataclasses.replace(LORA, targets=("q", "v"))  # (the MoE's MLPs take none)
    adapters = init_adapters(jax.random.key(0), dataclasses.replace(learner.cfg, lora=lora))
    before = run(backend.generate(_req("before-lora", _prompt(0, 5), GREEDY)))
    with pytest.raises(ValueError, match="push of LoRA adapters"):
        run(backend.update_weights(adapters, version=before.weight_version + 1))
    after = run(backend.generate(_req("after-lora", _prompt(0, 5), GREEDY)))
    assert after.weight_version == before.weight_version  # the failed push changed nothing
    assert after.token_ids == before.token_ids


def test_delta_pushes_serve_what_a_whole_push_serves(
    backend: RolloutBackend, learner: Learner
) -> None:
    """A backend that declares `Capabilities.delta_push`: a whole push, then 10 delta pushes of
    sparse steps (`DeltaPusher`, each fewer than a third of the weights' bytes), leave it
    serving bit for bit the weights a whole push of the last step gives (the learner's cast),
    token for token and logprob for logprob what that push serves, and not what the first
    weights served (tests/rollout/test_delta.py holds the whole-every-K schedule). One that
    does not refuses a delta in words that say so, keeps its version and serves on."""
    prompt = _prompt(40, 8)
    sampling = as_served(backend, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    before = run(backend.generate(_req("d0", prompt, sampling)))
    v = before.weight_version
    if not backend.capabilities.delta_push:
        refused = WeightDelta(v, jax.tree.structure(learner.weights), ())
        with pytest.raises(ValueError, match="takes whole weights only"):
            run(backend.update_weights(refused, version=v + 1))
        after = run(backend.generate(_req("d1", prompt, sampling)))
        assert after.weight_version == v and after.token_ids == before.token_ids
        return
    pusher, steps = DeltaPusher(learner.cfg, full_every=11), [learner.weights]
    for seed in range(10):
        steps.append(sparse_step(steps[-1], seed))
    sent = []
    for i, weights in enumerate(steps):
        run(pusher.push(backend, weights, v + 1 + i))
        sent.append(pusher.last)
    whole = [i for i, d in enumerate(sent) if not isinstance(d, WeightDelta)]
    assert whole == [0] and sent[0] is steps[0]
    full = push_bytes(steps[0])
    assert all(push_bytes(d) < full / 3 for i, d in enumerate(sent) if i not in whole)
    by_delta = run(backend.generate(_req("d-delta", prompt, sampling)))
    bits_by_delta = served_bits(backend)
    run(backend.update_weights(steps[-1], version=v + 12))
    by_whole = run(backend.generate(_req("d-whole", prompt, sampling)))
    assert served_bits(backend) == bits_by_delta
    assert (by_delta.weight_version, by_whole.weight_version) == (v + 11, v + 12)
    assert by_delta.token_ids == by_whole.token_ids
    assert by_delta.logprobs == by_whole.logprobs
    assert by_delta.logprobs != before.logprobs
    run(backend.update_weights(learner.weights, version=v + 13))


def test_session_turns_equal_fresh_requests(backend: RolloutBackend) -> None:
    """A session's next turn (prompt = previous prompt + sampled + new tokens) samples exactly
    what a fresh request would, whether or not the backend reuses the cached prefix."""
    turn1 = _prompt(30, 9)
    sampling = as_served(backend, SamplingParams(max_tokens=10, temperature=1.0, seed=21))
    r1 = run(backend.generate(_req("s1", turn1, sampling, session_id="traj-1")))
    turn2 = turn1 + r1.token_ids + _prompt(31, 5)
    in_session = run(backend.generate(_req("s2", turn2, sampling, session_id="traj-1")))
    fresh = run(backend.generate(_req("s2f", turn2, sampling)))
    assert in_session.token_ids == fresh.token_ids
    assert _gap(in_session, fresh) <= backend.capabilities.logprob_tolerance


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ((), GREEDY, "prompt_ids is empty"),
        ((1, 2, 10**6), GREEDY, "outside the vocabulary"),
        ((-1, 2), GREEDY, "outside the vocabulary"),
        (tuple(range(1, MAX_LEN + 1)), GREEDY, "leaves no room"),
        ((1, 2), SamplingParams(max_tokens=0), "max_tokens=0"),
        ((1, 2), SamplingParams(max_tokens=4, temperature=-0.5), "temperature=-0.5"),
        ((1, 2), SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_raise_and_others_proceed(
    backend: RolloutBackend, prompt: tuple[int, ...], sampling: SamplingParams, message: str
) -> None:
    async def scenario() -> GenerateResult:
        good = asyncio.create_task(backend.generate(_req("good", _prompt(40, 6), GREEDY)))
        with pytest.raises(InvalidRequestError, match=message):
            await backend.generate(_req("bad", prompt, sampling))
        return await good

    assert len(run(scenario()).token_ids) == 12


def test_capabilities_are_declared(backend: RolloutBackend) -> None:
    caps = backend.capabilities
    assert isinstance(backend, RolloutBackend)
    assert caps.max_model_len == MAX_LEN
    assert caps.weight_update in ("in_place", "reload", "none")
    assert 0 < caps.logprob_tolerance <= 1e-1
