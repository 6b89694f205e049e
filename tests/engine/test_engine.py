"""The embedded engine and backend beyond the protocol: bounded compilation, in-place weight
swaps, the session prefix cache, cancellation, and sharded decoding."""

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jax_agent_rl.engine import Engine
from jax_agent_rl.engine.state import StepChunk
from jax_agent_rl.models import Sharder, inference_mesh, load_hf, make_mesh, param_shardings
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import FP32_LOGPROB_TOLERANCE
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from tests.programs import programs_built


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", TINY_QWEN2)


def _backend(checkpoint: Path, **engine_kw: object) -> EmbeddedBackend:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    kw = {"max_concurrent_decodes": 4, "max_len": 256, "sharder": one_device_sharder(), **engine_kw}
    return EmbeddedBackend(Engine(cfg, **kw), w)  # type: ignore[arg-type]


# fp32 logprobs of one function computed in two reduction orders (sharded and not): the bound
# the fp32 parity tests use (against transformers, sampler against learner). Measured here:
# up to 1.1e-5 (it was 8.8e-6 before decode attention went blockwise); a sharding error (a head
# or a slot read from the wrong shard) moves logprobs by far more.
FP32_LOGPROBS = FP32_LOGPROB_TOLERANCE


def _req(rid: str, prompt: tuple[int, ...], max_tokens: int = 8, **kw: object) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=hash(rid) % 1000)
    return GenerateRequest(rid, prompt, sampling, **kw)  # type: ignore[arg-type]


def test_compilations_are_bounded_and_weight_swaps_reuse_them(checkpoint: Path) -> None:
    backend = _backend(checkpoint)
    engine = backend.engine
    rng = np.random.default_rng(0)

    async def many() -> None:
        lengths = list(range(1, 200, 7))
        await asyncio.gather(
            *(
                backend.generate(_req(f"r{n}", tuple(int(t) for t in rng.integers(1, 500, n)), 40))
                for n in lengths
            )
        )

    asyncio.run(many())
    counts = dict(engine.compile_counts)
    # one ragged step program per row bucket, whatever the mix of prompts and decode rows,
    # and one decode program per batch bucket
    assert set(counts) == {"step", "generate"}
    assert counts["step"] <= len(engine.step_buckets)
    assert counts["generate"] <= len(engine.batch_buckets)
    params = jax.tree.map(lambda x: x * 1.01, backend._params)
    asyncio.run(backend.update_weights(params, version=1))
    asyncio.run(many())
    assert dict(engine.compile_counts) == counts  # same shapes: nothing recompiled
    asyncio.run(backend.close())


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "inference_mesh"])
def test_warmup_compiles_everything_serving_needs(checkpoint: Path, sharded: bool) -> None:
    """After warm-up, serving compiles nothing at all: no engine function and no other XLA
    program (JAX's own count of programs compiled or loaded from the compilation cache, which
    also sees helpers outside the engine, such as a cache made per request), on one device and
    on an 8-device inference mesh. Its progress counts every compiled program once, in order,
    ending at the total."""
    sharder = Sharder(inference_mesh(make_mesh(2, 2, 2))) if sharded else one_device_sharder()
    backend = _backend(checkpoint, max_len=128, sharder=sharder)
    engine = backend.engine
    heard: list[tuple[int, int]] = []
    engine.warmup(backend._params, num_steps=4, on_program=lambda *n: heard.append(n))
    after_warmup = dict(engine.compile_counts)
    total = heard[-1][1]
    assert heard == [(done, total) for done in range(1, total + 1)]
    assert total == after_warmup["step"] + after_warmup["generate"] + 1  # + copy_page
    rng = np.random.default_rng(1)

    async def sessions() -> None:
        async def one(i: int) -> None:
            prompt = tuple(int(t) for t in rng.integers(1, 500, 1 + 9 * i))
            for turn in range(3):  # later turns prefill on top of the cached prefix
                result = await backend.generate(
                    _req(f"w{i}-{turn}", prompt, 10, session_id=f"w{i}")
                )
                prompt = prompt + result.token_ids + (5, 6)

        await asyncio.gather(*(one(i) for i in range(8)))

    with programs_built() as compiles:
        asyncio.run(sessions())
    assert dict(engine.compile_counts) == after_warmup
    assert compiles == []
    asyncio.run(backend.close())


def test_session_prefix_is_not_prefilled_again(checkpoint: Path) -> None:
    backend = _backend(checkpoint)

    async def turns() -> None:
        prompt: tuple[int, ...] = tuple(range(1, 40))
        for turn in range(3):
            result = await backend.generate(_req(f"t{turn}", prompt, 10, session_id="s"))
            prompt = prompt + result.token_ids + (7, 8, 9)  # a tool response, say

    asyncio.run(turns())
    # later turns prefill only the last sampled token (never cached) and the 3 new tokens
    stats = backend.stats
    assert stats.requests == 3
    assert stats.prefix_hit_tokens == (39 + 9) + (39 + 10 + 3 + 9)
    assert stats.prefilled_tokens == 39 + (1 + 3) + (1 + 3)
    assert stats.page_copies == 0  # the session's pages were handed over, not copied
    assert backend.engine.compile_counts["copy_page"] == 0
    asyncio.run(backend.close())


def test_cancelling_the_caller_aborts_and_frees_the_slot(checkpoint: Path) -> None:
    backend = _backend(checkpoint, max_concurrent_decodes=1)

    async def scenario() -> int:
        task = asyncio.create_task(backend.generate(_req("long", (1, 2, 3), 240)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await backend.generate(_req("next", (4, 5, 6), 5))
        return len(result.token_ids)

    assert asyncio.run(scenario()) == 5
    assert backend.stats.aborted == 1
    asyncio.run(backend.close())


def test_sharded_engine_equals_unsharded(checkpoint: Path) -> None:
    """The run's inference mesh (a data=2 x fsdp=2 x tensor=2 learner mesh with fsdp folded into
    data): the KV cache really splits, slots over 4 devices and kv heads over 2, prefill rows
    keep kv heads over tensor, and the engine gives the same greedy tokens as on one device
    (logprobs within the fp32 bound: only the reduction order differs). Weights pushed in the
    learner's fsdp layout are resharded onto the engine's."""
    learner_sharder = Sharder(make_mesh(data=2, fsdp=2, tensor=2))
    sharder = Sharder(inference_mesh(learner_sharder.mesh))
    assert dict(sharder.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    sharded, local = _backend(checkpoint, sharder=sharder), _backend(checkpoint)
    cfg = sharded.engine.cfg
    assert sharded.engine.batch_buckets == (4,)  # slots split over data: all in every step
    assert len(sharded._state.pages.k) == cfg.num_layers  # a buffer per layer
    k = sharded._state.pages.k[0]  # [G, P, page_size, K]
    assert k.sharding.spec == PartitionSpec("tensor", ("data", "fsdp"), None, None)
    G, P, S, K = k.shape
    assert {s.data.shape for s in k.addressable_shards} == {(G // 2, P // 4, S, K)}
    assert len({s.device for s in k.addressable_shards}) == 8
    q = sharded._params.layers[0].q  # [D, H, K]: whole D (no fsdp), heads over tensor
    assert {s.data.shape for s in q.addressable_shards} == {
        (cfg.hidden_size, cfg.num_heads // 2, cfg.head_dim)
    }
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    requests = [GenerateRequest(f"g{i}", tuple(range(1 + i, 9 + 2 * i)), greedy) for i in range(6)]

    async def run_all(backend: EmbeddedBackend) -> list:
        return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

    def same(a_results: list, b_results: list) -> None:
        for a, b in zip(a_results, b_results, strict=True):
            assert a.token_ids == b.token_ids
            assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= FP32_LOGPROBS

    same(asyncio.run(run_all(sharded)), asyncio.run(run_all(local)))
    compiled = dict(sharded.engine.compile_counts)
    _, w = load_hf(checkpoint, sharder=one_device_sharder())
    scaled = jax.tree.map(lambda x: x * 1.5, w)
    on_learner = jax.device_put(scaled, param_shardings(cfg, learner_sharder))
    asyncio.run(sharded.update_weights(on_learner, version=1))
    asyncio.run(local.update_weights(scaled, version=1))
    same(asyncio.run(run_all(sharded)), asyncio.run(run_all(local)))
    assert sharded._state.pages.k[0].sharding.is_equivalent_to(k.sharding, k.ndim)  # kept layout
    assert sharded.engine.compile_counts == compiled  # no layout recompiles
    asyncio.run(sharded.close())
    asyncio.run(local.close())


def test_sharded_engine_needs_slots_that_split_over_data(checkpoint: Path) -> None:
    cfg, _ = load_hf(checkpoint, sharder=one_device_sharder())
    sharder = Sharder(inference_mesh(make_mesh(data=2, fsdp=2, tensor=2)))
    with pytest.raises(ValueError, match="'batch' of size 6 does not divide over mesh axes"):
        Engine(cfg, max_concurrent_decodes=6, max_len=64, sharder=sharder)


def test_bad_engine_settings_are_refused(checkpoint: Path) -> None:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    with pytest.raises(ValueError, match="max_step_tokens=2 is fewer than the 4 rows"):
        Engine(
            cfg,
            max_concurrent_decodes=4,
            max_len=64,
            max_step_tokens=2,
            sharder=one_device_sharder(),
        )
    # a budget past every slot's whole sequence is that one (a 301-digit one built no bucket)
    huge = Engine(cfg, max_concurrent_decodes=4, max_len=64, max_step_tokens=10**300,
                  sharder=one_device_sharder())  # fmt: skip
    assert huge.max_step_tokens == 4 * 64 and huge.step_buckets[-1] == 256
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Engine(cfg, max_len=cfg.max_position_embeddings + 1, sharder=one_device_sharder())
    engine = Engine(cfg, max_len=64, sharder=one_device_sharder())
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim > 1 else x, w)
    with pytest.raises(ValueError, match="weight of shape"):
        engine.load_params(wrong)


def test_a_slots_tokens_do_not_depend_on_its_batch_mates(checkpoint: Path) -> None:
    """Which requests share a decode step sets the number of (slot, page) pairs attention
    reads. A slot's logprobs (and so its sampled tokens) are the same bit for bit whether it
    decodes alone or beside a longer request: each slot reads its own pages only, and a run
    does not depend on how its requests happened to be batched. (The batch is fixed here:
    XLA:CPU's matmuls round differently by row count, which ``batch_buckets=False`` pins.)"""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    cfg = dataclasses.replace(cfg, max_position_embeddings=1024)  # (RoPE has no bound)
    engine = Engine(
        cfg,
        max_concurrent_decodes=2,
        max_len=1024,
        page_size=8,
        batch_buckets=False,
        sharder=one_device_sharder(),
    )
    params = engine.load_params(w)
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    prompt = list(range(5, 35))

    def decode(beside: int) -> tuple[np.ndarray, np.ndarray]:
        state = engine.init_decode_state()
        tables = []
        for slot, n in enumerate((len(prompt), beside)[: 1 + (beside > 0)]):
            pages = list(range(slot * 128, slot * 128 + engine.pages_for(n + 24)))
            tokens = prompt if slot == 0 else list(range(1, n + 1))
            state, prefix = engine.prefill(params, state, pages, 0, tokens[:512], sampling, 3)
            if n > 512:  # a long prompt, in chunks
                state, prefix = engine.prefill(params, state, pages, 512, tokens[512:], sampling, 3)
            state = engine.insert(prefix, state, slot)
            tables.append(pages)
        _, out = engine.generate(params, state, engine.page_table(tables), range(len(tables)), 24)
        return np.asarray(out.token[:, 0]), np.asarray(out.logprob[:, 0])

    alone = decode(0)
    for beside in (40, 300, 900):
        tokens, logprobs = decode(beside)
        np.testing.assert_array_equal(tokens, alone[0])
        np.testing.assert_array_equal(logprobs, alone[1])
    assert engine.compile_counts["generate"] == 1  # one program for every pair count


def test_a_decode_step_computes_only_the_slots_in_use(checkpoint: Path) -> None:
    """Requests in slots 0-2 of 8: a step computes a batch of 4 (the bucket that covers
    them), and gives the tokens and logprobs of the whole 8-slot step (logprobs to the fp32
    bound: only the row count of the matmuls differs, which changes their rounding)."""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    engine = Engine(cfg, max_concurrent_decodes=8, max_len=128, sharder=one_device_sharder())
    assert engine.batch_buckets == (1, 2, 4, 8)
    assert Engine(
        cfg,
        max_concurrent_decodes=8,
        max_len=128,
        batch_buckets=False,
        sharder=one_device_sharder(),
    ).batch_buckets == (8,)
    params = engine.load_params(w)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    def decode(every_slot: bool) -> tuple:
        state = engine.init_decode_state()
        tables = []
        for slot in range(3):
            pages = [2 * slot, 2 * slot + 1]
            prompt = list(range(3 + slot, 20 + 2 * slot))
            state, prefix = engine.prefill(params, state, pages, 0, prompt, greedy, 0)
            state = engine.insert(prefix, state, slot)
            tables.append(pages)
        table = engine.page_table(tables + [[]] * 5)
        return engine.generate(params, state, table, range(8 if every_slot else 3), 16)

    (part, few), (whole, every) = decode(False), decode(True)
    assert few.token.shape == (16, 4) and every.token.shape == (16, 8)
    np.testing.assert_array_equal(few.valid, every.valid[:, :4])
    assert not np.asarray(every.valid[:, 3:]).any()
    np.testing.assert_array_equal(few.token, every.token[:, :4])
    assert np.abs(np.asarray(few.logprob - every.logprob[:, :4])).max() <= FP32_LOGPROBS
    np.testing.assert_array_equal(part.pos, whole.pos)
    assert engine.compile_counts["generate"] == 2  # one program per batch bucket


def test_scattered_slots_decode_as_a_compact_batch(checkpoint: Path) -> None:
    """Requests in slots 1 and 6 of 8: a step computes a batch of 2 (those slots, named by
    ``slot``), not the 8 that cover slot 6, and each request's tokens are those of the whole
    8-slot step (logprobs to the fp32 bound: the matmuls' row count differs); its slot state
    goes on from there (a second call continues both requests as the whole step does)."""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    engine = Engine(cfg, max_concurrent_decodes=8, max_len=128, sharder=one_device_sharder())
    params = engine.load_params(w)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)

    def decode(every_slot: bool) -> list:
        state = engine.init_decode_state()
        tables: list[list[int]] = [[] for _ in range(8)]
        for slot in (1, 6):
            pages = [2 * slot, 2 * slot + 1]
            prompt = list(range(3 + slot, 20 + 2 * slot))
            state, prefix = engine.prefill(params, state, pages, 0, prompt, greedy, 0)
            state = engine.insert(prefix, state, slot)
            tables[slot] = pages
        table = engine.page_table(tables)
        outs = []
        for _ in range(2):
            state, out = engine.generate(
                params, state, table, (1, 6), 8, slots_in_use=8 if every_slot else None
            )
            outs.append(jax.device_get(out))
        return outs

    for few, every in zip(decode(False), decode(True), strict=True):
        np.testing.assert_array_equal(few.slot, [1, 6])
        np.testing.assert_array_equal(every.slot, np.arange(8))
        np.testing.assert_array_equal(few.token, every.token[:, [1, 6]])
        np.testing.assert_array_equal(few.valid, every.valid[:, [1, 6]])
        assert few.valid.all()
        assert np.abs(few.logprob - every.logprob[:, [1, 6]]).max() <= FP32_LOGPROBS
    assert engine.compile_counts["generate"] == 2  # a batch of 2, and of 8


def test_sharded_sessions_share_prompts_within_their_shards(checkpoint: Path) -> None:
    """8 slots over data=4 (2 per shard): a group of 6 episodes of one 70-token prompt, each
    a session; then two branches of one of them (``prefix_session``), then each session's
    next turn. Episodes on different shards do not share the prompt's pages (each shard
    prefills it once and its episodes share them there); a branch starts from its parent's
    pages on the parent's shard (copying the one it writes into); a next turn runs on its
    session's shard and prefills only what is new. Every decode step checks that each slot
    names pages of its own shard only (`Engine.generate`), and the tokens are those of one
    device (logprobs within the fp32 bound)."""
    sharder = Sharder(inference_mesh(make_mesh(data=2, fsdp=2, tensor=2)))
    sharded = _backend(checkpoint, sharder=sharder, max_concurrent_decodes=8, page_size=16)
    local = _backend(checkpoint, max_concurrent_decodes=8, page_size=16)
    assert sharded.engine.shards == 4 and sharded._pool.shards == 4
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(1, 500, 70))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    group = [GenerateRequest(f"e{i}", prompt, greedy, session_id=f"s{i}") for i in range(6)]

    def run(backend: EmbeddedBackend, requests: list[GenerateRequest]) -> list:
        async def all_() -> list:
            return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

        return asyncio.run(all_())

    def same(a_results: list, b_results: list) -> None:
        for a, b in zip(a_results, b_results, strict=True):
            assert a.token_ids == b.token_ids
            assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= FP32_LOGPROBS

    first = run(sharded, group)
    same(first, run(local, group))
    shard_of = sharded._pool.shard_of
    kept = {sid: pages for sid, (_, pages) in sharded._sessions._kept.items()}
    shards = {shard_of(pages[0]) for pages in kept.values()}
    assert len(shards) > 1  # the group really spread over shards
    for pages in kept.values():
        assert len({shard_of(p) for p in pages}) == 1
    # the prompt's 4 full pages: computed once per shard the group ran on, shared there
    assert sharded.stats.prefilled_tokens == 70 * len(shards) + 6 * (6 - len(shards))
    assert local.stats.prefilled_tokens == 70 + 6 * 5
    history = (*prompt, *first[0].token_ids)
    branches = [
        GenerateRequest(f"b{j}", (*history[: 75 + j], 9, 9), greedy, prefix_session="s0")
        for j in range(2)
    ]
    turns = [
        GenerateRequest(f"t{i}", (*prompt, *r.token_ids, 5, 6, 7), greedy, session_id=f"s{i}")
        for i, r in enumerate(first)
    ]
    before = sharded.stats.prefilled_tokens
    same(run(sharded, branches), run(local, branches))
    same(run(sharded, turns), run(local, turns))
    # each branch prefills its 2 tokens past its parent's pages (on the parent's shard);
    # each turn, on its session's shard, its 3 new tokens and the last one sampled before
    assert sharded.stats.prefilled_tokens - before == 2 * 2 + 6 * 4
    assert sharded.stats.page_copies >= 1
    asyncio.run(sharded.close())
    asyncio.run(local.close())


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "inference_mesh"])
def test_a_ragged_step_gives_what_prefill_and_decode_give(checkpoint: Path, sharded: bool) -> None:
    """`Engine.step`: three prompts (37, 5 and 70 tokens) computed in one step, then decoded
    5 more steps (`generate` of the slots it sampled, as the backend's call does), give the
    tokens (greedy) of prefilling each alone, inserting it and decoding, with logprobs to
    the fp32 bound; a later step of those three decode rows beside the first chunk of a
    fourth prompt (which samples nothing) goes on as decode does, and the fourth prompt's
    last chunk, in the next step, starts it as its whole prefill does. On an 8-device
    inference mesh (slots and pages over data x fsdp = 4, heads over tensor=2) as on one
    device. One step program per row bucket."""
    sharder = Sharder(inference_mesh(make_mesh(2, 2, 2))) if sharded else one_device_sharder()
    cfg, w = load_hf(checkpoint, sharder=sharder)
    engine = Engine(
        cfg, max_concurrent_decodes=4, max_len=256, max_step_tokens=128, sharder=sharder
    )
    params = engine.load_params(w)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 500, n)] for n in (37, 5, 70, 50)]
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    first = (greedy, 0, 0)
    slots = [0, 2, 1, 3]  # over the shards when sharded
    base = [
        engine.slot_shard(s) * engine.shard_pages + s % engine.slots_per_shard * 8 for s in range(4)
    ]
    pages = [list(range(b, b + 8)) for b in base]
    table = engine.page_table(pages)

    def reference(prompt: list[int], slot: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        state = engine.init_decode_state()
        state, prefix = engine.prefill(params, state, pages[slot], 0, prompt, greedy, 0)
        state = engine.insert(prefix, state, slot)
        _, out = engine.generate(params, state, table, [slot], steps)
        row = list(np.asarray(out.slot)).index(slot)
        tokens = [int(prefix.slots.token[0]), *np.asarray(out.token)[:, row]]
        logprobs = [float(prefix.logprob[0]), *np.asarray(out.logprob)[:, row]]
        return np.asarray(tokens), np.asarray(logprobs)

    def call(state: Any, chunks: list[StepChunk], more: int) -> tuple[Any, dict[int, tuple]]:
        """A step, then ``more`` decode steps of the slots it sampled: each slot's tokens and
        logprobs."""
        state, out = engine.step(params, state, table, chunks)
        sampled = [c.slot for c in chunks if c.samples]
        state, rest = engine.generate(params, state, table, sampled, more)
        out, rest = jax.device_get((out, rest))
        got = {}
        for slot in sampled:
            row, row2 = out.slot.tolist().index(slot), rest.slot.tolist().index(slot)
            got[slot] = (
                np.concatenate([out.token[:, row], rest.token[:, row2]]),
                np.concatenate([out.logprob[:, row], rest.logprob[:, row2]]),
            )
        return state, got

    state = engine.init_decode_state()
    state, got = call(state, [StepChunk(slots[i], 0, prompts[i], first) for i in range(3)], 5)
    later_chunks = [StepChunk(slots[i], len(prompts[i]) + 5) for i in range(3)]
    state, later = call(state, [*later_chunks, StepChunk(slots[3], 0, prompts[3][:30])], 3)
    assert slots[3] not in later  # a chunk that does not end its prompt
    for i in range(3):
        tokens, logprobs = reference(prompts[i], slots[i], 9)
        np.testing.assert_array_equal(
            np.concatenate([got[slots[i]][0], later[slots[i]][0]]), tokens
        )
        both = np.concatenate([got[slots[i]][1], later[slots[i]][1]])
        assert np.abs(both - logprobs).max() <= FP32_LOGPROBS
    state, last = call(state, [StepChunk(slots[3], 30, prompts[3][30:], first)], 2)
    tokens, logprobs = reference(prompts[3], slots[3], 2)
    np.testing.assert_array_equal(last[slots[3]][0], tokens)
    assert np.abs(last[slots[3]][1] - logprobs).max() <= FP32_LOGPROBS
    # a shard's rows: 128 for the three prompts, then 64 and 32 (on 4 shards: 128, 32, 32)
    assert engine.compile_counts["step"] == (2 if sharded else 3)


def test_a_ragged_steps_rows_do_not_depend_on_their_batch_mates(checkpoint: Path) -> None:
    """With ``batch_buckets=False`` every step computes ``max_step_tokens`` rows, and a
    decode row's logprob is the same bit for bit alone and beside a prompt chunk of 90
    tokens or another decoding slot: each row reads its own pages only (the decode loop's
    pairs, the chunks' query blocks), so a run does not depend on what shared its steps."""
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    engine = Engine(
        cfg,
        max_concurrent_decodes=4,
        max_len=256,
        max_step_tokens=128,
        batch_buckets=False,
        sharder=one_device_sharder(),
    )
    params = engine.load_params(w)
    sampling = (SamplingParams(max_tokens=40, temperature=1.0), 3, 0)
    prompt = list(range(5, 35))
    table = engine.page_table([list(range(s * 8, s * 8 + 8)) for s in range(4)])

    def decode(mates: list[StepChunk]) -> tuple[np.ndarray, np.ndarray]:
        state = engine.init_decode_state()
        for slot, tokens in ((0, prompt), (1, list(range(40, 100)))):
            state, _ = engine.step(params, state, table, [StepChunk(slot, 0, tokens, sampling)])
        state, out = engine.step(params, state, table, [StepChunk(0, len(prompt)), *mates])
        out = jax.device_get(out)
        row = out.slot.tolist().index(0)
        return np.asarray(out.token[:, row]), np.asarray(out.logprob[:, row])

    alone = decode([])
    for mates in ([StepChunk(2, 0, list(range(1, 91)), sampling)], [StepChunk(1, 60)]):
        tokens, logprobs = decode(mates)
        np.testing.assert_array_equal(tokens, alone[0])
        np.testing.assert_array_equal(logprobs, alone[1])
    assert engine.compile_counts["step"] == 1
