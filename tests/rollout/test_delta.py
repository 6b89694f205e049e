"""Delta weight pushes (`jax_agent_rl.rollout.delta`): each leaf sent in its fewest bytes,
applied in place by the engine, the result bitwise the learner's cast to the serving dtype."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import (
    ModelConfig,
    Sharder,
    inference_mesh,
    init_params,
    make_mesh,
    param_shardings,
)
from jax_agent_rl.models.hf_local import TINY_QWEN2
from jax_agent_rl.rollout.delta import (
    BLOCK,
    DeltaPusher,
    WeightDelta,
    apply_delta,
    bucket,
    encode_leaf,
    push_bytes,
)


def _bits(x: jax.Array) -> np.ndarray:
    a = np.asarray(jax.device_get(x))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _encoded(old: jax.Array, new: jax.Array):  # type: ignore[no-untyped-def]
    diff = (_bits(old) != _bits(new)).reshape(-1)
    changed = int(diff.sum())
    blocks = int(np.pad(diff, (0, -diff.size % BLOCK)).reshape(-1, BLOCK).any(1).sum())
    return encode_leaf(old, new, changed, blocks)


def test_each_leaf_goes_in_its_fewest_bytes() -> None:
    """A bf16 leaf of 4096: 3 scattered elements go as elements (padded to 4: 4 x 6 bytes,
    against a block of 4 + 64 x 2); one whole block as that block; every 10th (410) as a bit
    per element and their values (512 + 512 x 2 bytes); every element as the leaf;
    a sign flip of zero (-0.0) is a change; nothing changed: nothing sent. Applied, each gives
    the new leaf bit for bit."""
    old = jnp.zeros(4096, jnp.bfloat16)
    cases = {
        "elements": old.at[jnp.array([5, 900, 4000])].set(1.5),
        "blocks": old.at[128:192].set(jnp.arange(64, dtype=jnp.bfloat16)),
        "mask": old.at[::10].set(jnp.arange(1, 411, dtype=jnp.bfloat16)),
        "whole": old + 0.25,
    }
    for kind, new in cases.items():
        d = _encoded(old, new)
        assert d is not None and d.kind == kind
        sizes = {"elements": 4 * 6, "blocks": 4 + BLOCK * 2, "mask": 512 + 512 * 2, "whole": 8192}
        assert d.nbytes == sizes[kind]
        served = apply_delta(
            [jnp.zeros(4096, jnp.bfloat16)], WeightDelta(0, jax.tree.structure([old]), (d,)), 0
        )
        assert (_bits(served[0]) == _bits(new)).all(), kind
    d = _encoded(old, old.at[7].set(-0.0))
    assert d is not None and d.kind == "elements" and int(d.index[0]) == 7
    assert _encoded(old, old) is None
    # a blocks leaf whose last block runs past its end: the tail is dropped
    odd = jnp.zeros((3, 5000), jnp.bfloat16)
    new = odd.at[2, 4900:].set(2.0)  # elements 14900-14999: blocks 232-234 (past the end)
    d = _encoded(odd, new)
    assert d is not None and d.kind == "blocks"
    served = apply_delta([odd + 0], WeightDelta(3, jax.tree.structure([odd]), (d,)), 3)
    assert (_bits(served[0]) == _bits(new)).all()
    assert [bucket(n) for n in (1, 2, 3, 100, 1024)] == [1, 2, 4, 128, 1024]


def test_a_delta_on_another_version_or_shape_is_refused_before_anything_changes() -> None:
    old = [jnp.zeros(256, jnp.float32)]
    d = _encoded(old[0], old[0].at[3].set(1.0))
    delta = WeightDelta(4, jax.tree.structure(old), (d,))
    with pytest.raises(ValueError, match="on weight version 4 to an engine serving version 5"):
        apply_delta(old, delta, 5)
    with pytest.raises(ValueError, match="the engine serves float32\\[128\\] there"):
        apply_delta([jnp.zeros(128, jnp.float32)], delta, 4)
    assert float(old[0].sum()) == 0.0  # not donated: still readable, unchanged


def _adam_steps(cfg: ModelConfig, sharder: Sharder, lr: float, n: int) -> list[object]:
    """The bf16 casts of ``n`` + 1 fp32 weights: the start, then after each of ``n`` steps of
    ``lr`` x the sign of a random gradient (what Adam's update is while its moments agree),
    each placed in the engine's layout (as `Serving.pushed` places them)."""
    start = init_params(jax.random.key(0), dataclasses.replace(cfg, dtype="float32"), sharder)
    leaves, treedef = jax.tree.flatten(jax.device_get(start))
    rng, layout, casts = np.random.default_rng(0), param_shardings(cfg, sharder), []
    for _ in range(n + 1):
        cast = [x.astype(jnp.bfloat16) for x in leaves]
        casts.append(jax.device_put(jax.tree.unflatten(treedef, cast), layout))
        leaves = [x - lr * np.sign(rng.standard_normal(x.shape)) for x in leaves]
    return casts


def test_ten_delta_pushes_leave_a_sharded_engine_bitwise_on_the_learners_cast() -> None:
    """A bf16 engine over 8 devices (data 4 x tensor 2): a whole push, then 10 delta pushes of
    Adam-sized steps (`_adam_steps`, lr 1e-6): each a `WeightDelta` on the version before, of
    fewer bytes than half the weights'; after them every served leaf is bitwise that of the
    engine loading the last cast whole, in the same layout. With ``full_every=4``, pushes 0, 4
    and 8 are whole."""
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY_QWEN2), dtype="bfloat16")
    sharder = Sharder(inference_mesh(make_mesh(data=2, fsdp=2, tensor=2)))
    engine = Engine(cfg, sharder=sharder, max_concurrent_decodes=4, max_len=64)
    casts = _adam_steps(cfg, sharder, 1e-6, 10)
    pusher = DeltaPusher(cfg, full_every=11)
    served = engine.load_params(casts[0])
    sent, base = pusher.encode(casts[0])
    assert sent is casts[0]
    pusher.took(sent, base, 0)
    for version, cast in enumerate(casts[1:], start=1):
        sent, base = pusher.encode(cast)
        assert isinstance(sent, WeightDelta) and sent.base == version - 1
        assert 0 < push_bytes(sent) < push_bytes(cast) / 2, (version, push_bytes(sent))
        served = apply_delta(served, sent, version - 1)
        pusher.took(sent, base, version)
    want = engine.load_params(casts[-1])
    for got, ref in zip(jax.tree.leaves(served), jax.tree.leaves(want), strict=True):
        assert got.sharding.is_equivalent_to(ref.sharding, got.ndim)
        assert (_bits(got) == _bits(ref)).all()

    every4, whole = DeltaPusher(cfg, full_every=4), []
    for version, cast in enumerate(casts[:9]):
        sent, base = every4.encode(cast)
        whole += [] if isinstance(sent, WeightDelta) else [version]
        every4.took(sent, base, version)
    assert whole == [0, 4, 8]
