"""Each decode slot's KV pages on the slot's own shard: the host ledger (`PagePool`,
`SessionPages`) hands a slot pages of its shard's range only, and the decode program
compiled for a TPU moves no keys or values between chips.

The TPU programs are compiled on this CPU host for an abstract v5e 2x2 topology (libtpu):
their HLO, read from ``compiled.as_text()``, is what would run on the chips."""

import dataclasses
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_agent_rl.engine import Engine, PagePool
from jax_agent_rl.engine.programs import abstract_programs
from jax_agent_rl.models import ModelConfig, Sharder, Weights, abstract_params, make_mesh
from jax_agent_rl.models.hf_local import TINY_QWEN2
from jax_agent_rl.rollout import GenerateRequest, SamplingParams
from jax_agent_rl.rollout.session_pages import BackendStats, SessionPages

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def test_the_ledger_hands_each_shard_its_own_pages() -> None:
    """A pool of 4 shards x 6 pages, random takes, shares, registrations and releases on
    every shard: every page a shard hands out (taken, or found as a cached prefix) is in its
    range; a shard that runs out refuses even while others have pages; a prefix cached on
    one shard is not found from another."""
    pool = PagePool(24, shards=4)
    assert [pool.available(d) for d in range(4)] == [6] * 4
    rng = np.random.default_rng(0)
    held: list[tuple[int, list[int]]] = []
    for step in range(400):
        shard = int(rng.integers(4))
        if rng.random() < 0.5 and held:
            _, pages = held.pop(int(rng.integers(len(held))))
            if rng.random() < 0.5:
                pool.register(pages, pool.keys(list(range(step, step + 8 * len(pages))), 8))
            pool.release(pages)
            continue
        keys = pool.keys(list(range(int(rng.integers(0, 400)), 400)), 8)[:3]
        found = pool.lookup(keys, shard)
        taken = pool.take(int(rng.integers(1, 4)), shard)
        pages = found + (taken or [])
        assert all(pool.shard_of(p) == shard for p in pages), (shard, pages)
        assert all(6 * shard <= p < 6 * (shard + 1) for p in pages)
        if taken is None:
            assert pool.available(shard) < 4
        held.append((shard, pages))
    for _, pages in held:
        pool.release(pages)
    assert pool.in_use == 0

    # a shard's cached prefix is its own
    pages = pool.take(2, 1)
    assert pages is not None
    keys = pool.keys(list(range(16)), 8)
    pool.register(pages, keys)
    pool.release(pages)
    assert pool.lookup(keys, 0) == [] and pool.cached(keys, 0) == 0
    assert pool.cached(keys, 1) == 2 and pool.lookup(keys, 1) == pages
    # a full shard refuses though the others are free
    assert pool.take(4, 1) is not None and pool.take(1, 1) is None and pool.take(6, 2) is not None
    with pytest.raises(ValueError, match="do not split into 5 equal shards"):
        PagePool(24, shards=5)


def test_sessions_start_on_the_shard_that_holds_their_prefix() -> None:
    """`SessionPages` on 2 shards of 8 pages (pages of 4 tokens): a session's next turn goes
    to the shard that keeps it, and finds its pages there; another request's prompt (not
    cached anywhere) goes where most pages are free; a shared page about to be written is
    copied into a page of its own shard; evictions for room free the shard that needs it."""
    pool = PagePool(16, shards=2)
    stats = BackendStats()
    sessions = SessionPages(pool, page_size=4, size=8, stats=stats)

    def shard_of(slot: int) -> int:  # 2 slots per shard
        return slot // 2

    first = tuple(range(1, 11))  # 10 tokens: 2 full pages and 2 tokens
    pages = sessions.take(3, 1)
    assert pages is not None and all(8 <= p < 16 for p in pages)
    pool.register(pages, pool.keys(first, 4))
    sessions.keep("s", first, pages)
    turn = GenerateRequest("t", (*first, 11, 12), SamplingParams(max_tokens=4), session_id="s")
    slot = sessions.best_slot(turn, turn.prompt_ids, [0, 1, 2, 3], shard_of, need=4)
    assert shard_of(slot) == 1
    found, common = sessions.cached_prefix(turn, turn.prompt_ids, 1)
    assert found == pages and common == 10
    copies: list[tuple[int, int]] = []
    assert sessions.private_tail(found, common, lambda a, b: copies.append((a, b)))
    assert copies == [] and found == pages  # its own session's pages, handed over

    other = GenerateRequest("o", tuple(range(50, 70)), SamplingParams(max_tokens=4))
    slot = sessions.best_slot(other, other.prompt_ids, [0, 1, 2, 3], shard_of, need=6)
    assert shard_of(slot) == 0  # shard 1 holds 3 pages; nothing cached anywhere

    branch = GenerateRequest(
        "b", (*first[:6], 99), SamplingParams(max_tokens=4), prefix_session="s"
    )
    sessions.keep("s", (*first, 11, 12), found)
    shared, common = sessions.cached_prefix(branch, branch.prompt_ids, 1)
    assert common == 6 and shared == found[:2]
    assert sessions.private_tail(shared, common, lambda a, b: copies.append((a, b)))
    assert copies == [(found[1], shared[1])] and pool.shard_of(shared[1]) == 1
    assert sessions.cached_prefix(branch, branch.prompt_ids, 0) == ([], 0)  # not shard 0's
    # room on shard 1 evicts the session kept there, never shard 0's pages
    zero = sessions.take(8, 0)
    assert zero is not None and sessions.take(1, 0) is None
    pool.release(shared)
    assert sessions.take(8, 1) is not None and stats.sessions_evicted == 1


# ---------------------------------------------------------------------------- TPU programs


@pytest.fixture(scope="module")
def topology() -> object:
    from jax.experimental import topologies

    # several processes of this machine may compile for TPU at once; libtpu refuses a second
    # one without this
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")


def _computations(hlo: str) -> dict[str, list[str]]:
    """The HLO module's computations: name -> its instruction lines."""
    comps: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            lines = comps.setdefault(header.group(1), [])
        elif line == "}":
            lines = None
        elif lines is not None:
            lines.append(line)
    return comps


def _called(line: str) -> list[str]:
    names = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def _within(comps: dict[str, list[str]], roots: list[str]) -> Iterator[str]:
    """The instruction lines of ``roots`` and of every computation they call."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            yield line
            todo += _called(line)


def _collectives(lines: Iterator[str] | list[str]) -> list[str]:
    pattern = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
    return [line for line in lines if pattern.search(line)]


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def _serving_abstract(cfg: ModelConfig, sharder: Sharder) -> Weights:
    """The weights as `Engine.load_params` lays them out (`serving_layout`: a tree per layer,
    the tied head [D, V]), as ShapeDtypeStructs with their shardings."""
    declared = abstract_params(cfg, sharder)

    def laid(x: jax.ShapeDtypeStruct, shape: tuple[int, ...], spec: tuple) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(sharder.mesh, P(*spec)))

    def one_layer(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return laid(x, x.shape[1:], tuple(x.sharding.spec)[1:])

    layer = jax.tree.map(one_layer, declared.layers)
    e = declared.embed
    head = laid(e, e.shape[::-1], tuple(e.sharding.spec)[::-1])
    return dataclasses.replace(declared, layers=(layer,) * cfg.num_layers, lm_head=head)


def _decode_hlo(topology: object, data: int, tensor: int, kernel: str) -> tuple[str, Engine]:
    """The engine's decode program (2 steps, every slot) compiled for the topology's 4 chips
    on a data x tensor inference mesh, its bfloat16 weights and pool laid out as a run lays
    them out (head_dim 128: the TPU kernel's block shape)."""
    cfg = ModelConfig.from_hf(dict(TINY_QWEN2, head_dim=128), dtype="bfloat16")
    sharder = Sharder(make_mesh(data, 1, tensor, devices=topology.devices))  # type: ignore[attr-defined]
    engine = Engine(
        cfg,
        max_concurrent_decodes=8,
        max_len=256,
        page_size=16,
        sharder=sharder,
        decode_kernel=kernel,
    )
    params = _serving_abstract(cfg, sharder)
    state = engine.abstract_decode_state()
    n, m = engine.max_concurrent_decodes, engine.pages_per_seq
    table = jax.ShapeDtypeStruct(
        (n, m), jnp.int32, sharding=sharder.sharding(("batch", None), (n, m))
    )
    slot_b = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharder.sharding(("batch",), (n,)))
    compiled = engine._generate.lower(params, state, table, slot_b, num_steps=2).compile()
    return compiled.as_text(), engine


@pytest.mark.parametrize("kernel", ["ragged", "pallas"])
def test_tpu_decode_reads_each_chips_own_pages(topology: object, kernel: str) -> None:
    """The decode program for 4 TPU v5e chips, slots and pages over data=4: no collective
    at all in its attention (the ragged kernel's loops over (slot, page) pairs, or the
    Pallas kernel's custom call and what feeds it). What remains in the whole step is one
    scalar all-reduce: the sampler's `jnp.any` over the slots of whether any needs the
    top-k / top-p filter (the predicate of its ``lax.cond``). Pallas is what the engine
    picks for a TPU mesh (a 16-bit cache), whatever backend this process runs."""
    hlo, engine = _decode_hlo(topology, data=4, tensor=1, kernel=kernel)
    assert engine.shards == 4 and engine.shard_pages == engine.num_pages // 4
    if kernel == "pallas":
        assert Engine(engine.cfg, max_len=256, sharder=engine.sharder).decode_kernel == "pallas"
        assert hlo.count('custom_call_target="tpu_custom_call"') == engine.cfg.num_layers
    comps = _computations(hlo)
    loops = [
        _called(line)
        for lines in comps.values()
        for line in lines
        if " while(" in line and "/attention/" in _op_name(line)
    ]
    assert len(loops) == (2 * engine.cfg.num_layers if kernel == "ragged" else 0)
    assert _collectives(_within(comps, [n for names in loops for n in names])) == []
    remaining = _collectives(hlo.splitlines())
    assert len(remaining) == 1 and re.search(r"= u32\[\]\S* all-reduce\(", remaining[0])
    assert _op_name(remaining[0]).endswith("reduce_or")


@pytest.mark.parametrize("kernel", ["ragged", "pallas"])
def test_tpu_decode_on_a_tensor_mesh_moves_activations_only(topology: object, kernel: str) -> None:
    """data=2 x tensor=2: slots and pages over data, kv heads over tensor. The attention
    loops hold no collective; in the attention block the only one left is the all-reduce
    of the output projection's partial sums over tensor (heads split: a tensor-parallel
    matmul); none carries a page (every collective's operand is activations of at most
    the slots' [rows, hidden] or the vocab's logits, never [kv heads, pages, ...])."""
    hlo, engine = _decode_hlo(topology, data=2, tensor=2, kernel=kernel)
    comps = _computations(hlo)
    loops = [
        _called(line)
        for lines in comps.values()
        for line in lines
        if " while(" in line and "/attention/" in _op_name(line)
    ]
    assert _collectives(_within(comps, [n for names in loops for n in names])) == []
    in_attention = [
        line for line in _collectives(hlo.splitlines()) if "/attention/" in _op_name(line)
    ]
    assert in_attention and all("bthk,hkd->btd" in _op_name(line) for line in in_attention)
    page = f"{engine.page_size},{engine.cfg.head_dim}]"
    assert not [
        line for line in _collectives(hlo.splitlines()) if page in line.split("=")[1].split("(")[0]
    ]


@pytest.mark.parametrize("data", [2, 4])
def test_the_ragged_step_compiles_for_tpu_with_each_chips_own_pages(
    topology: object, data: int
) -> None:
    """The ragged step (prompt chunks and decode rows of many sequences) at its largest row
    bucket, compiled for 4 v5e chips on data=4 and data=2 x tensor=2 with the Pallas kernel
    the engine picks there: one kernel call per layer (the decode rows'), and no collective
    carries a page (each shard's rows read and write its own pages; what crosses chips is
    activations and the sampled rows)."""
    cfg = ModelConfig.from_hf(dict(TINY_QWEN2, head_dim=128), dtype="bfloat16")
    mesh = make_mesh(data, 1, 4 // data, devices=topology.devices)  # type: ignore[attr-defined]
    sharder = Sharder(mesh)
    engine = Engine(
        cfg,
        max_concurrent_decodes=8,
        max_len=256,
        page_size=16,
        max_step_tokens=64,
        sharder=sharder,
    )
    assert engine.decode_kernel == "pallas" and engine.shards == data
    fn, args, static = abstract_programs(engine, abstract_params(cfg, sharder), 1)["step"]
    assert args[2].shape == (data * 64,)  # each shard's 64 token rows
    hlo = fn.lower(_serving_abstract(cfg, sharder), *args[1:], **static).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == cfg.num_layers
    page = f"{engine.page_size},{engine.cfg.head_dim}]"
    assert not [
        line for line in _collectives(hlo.splitlines()) if page in line.split("=")[1].split("(")[0]
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_decode_lowers_with_the_triton_kernel(dtype: str) -> None:
    """The engine's decode program (2 steps, every slot) lowered on this CPU host for an
    abstract H100 (an abstract mesh of one GPU): with a bfloat16 pool the engine picks JAX's
    GPU (Triton) paged-attention kernel by itself and the program calls it; with fp32 (whose
    Triton matmuls would take TF32) it keeps the ragged XLA loop and calls no Triton kernel."""
    card = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"), abstract_device=card)
    sharder = Sharder(mesh)  # type: ignore[arg-type]
    cfg = ModelConfig.from_hf(dict(TINY_QWEN2, head_dim=128), dtype=dtype)
    engine = Engine(cfg, max_concurrent_decodes=8, max_len=256, page_size=16, sharder=sharder)
    assert engine.decode_kernel == ("triton" if dtype == "bfloat16" else "ragged")
    n, m = engine.max_concurrent_decodes, engine.pages_per_seq
    table = jax.ShapeDtypeStruct(
        (n, m), jnp.int32, sharding=sharder.sharding(("batch", None), (n, m))
    )
    slot_b = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharder.sharding(("batch",), (n,)))
    args = (_serving_abstract(cfg, sharder), engine.abstract_decode_state(), table, slot_b)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = engine._generate.trace(*args, num_steps=2)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    kernels = set(re.findall(r'"(paged_attention\w*)"', text))
    assert (kernels != set()) == (dtype == "bfloat16"), kernels
    assert ("xla.gpu.triton" in text) == (dtype == "bfloat16")


def test_a_pool_budget_that_does_not_split_evenly_is_rounded_down_to_the_shards() -> None:
    """engine.kv_cache_gib gives a page count (`pool_pages`) that need not divide over the
    shards: each shard takes an equal range, the few pages left over go unused (100 GiB over
    4 shards was refused as a pool that "cannot hold one sequence", of 2,184,533 pages)."""
    sharder = Sharder(make_mesh(data=4, devices=jax.devices()[:4]))
    cfg = ModelConfig.from_hf(TINY_QWEN2)
    engine = Engine(
        cfg,
        max_concurrent_decodes=8,
        max_len=64,
        page_size=16,
        num_pages=4 * 5 + 3,
        sharder=sharder,
    )
    assert (engine.shards, engine.num_pages, engine.shard_pages) == (4, 20, 5)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_len=64"):
        Engine(
            cfg, max_concurrent_decodes=8, max_len=64, page_size=16, num_pages=15, sharder=sharder
        )
