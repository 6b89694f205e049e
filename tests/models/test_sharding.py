"""The same forward on a (fsdp=2, tensor=4) mesh of 8 fake CPU devices and unsharded."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.models import (
    ModelConfig,
    Packed,
    Paged,
    Sharder,
    ShardingRules,
    forward,
    init_pages,
    init_params,
    lm_logits,
    make_mesh,
)
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.models.sharding import one_device_sharder

# Heads, kv heads, MLP and vocab divide by tensor=4; hidden divides by fsdp=2.
CFG = dataclasses.replace(
    ModelConfig.from_hf(TINY["qwen2"]), num_heads=8, num_kv_heads=4, head_dim=8
)


@pytest.fixture(scope="module")
def sharder() -> Sharder:
    assert jax.device_count() == 8
    return Sharder(make_mesh(data=1, fsdp=2, tensor=4))


def test_parameters_are_really_sharded(sharder: Sharder) -> None:
    w = init_params(jax.random.key(0), CFG, sharder)
    q = w.layers.q  # [L, D, H, K]: D over fsdp, H over tensor
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.sharding.device_set) == 8
    shard_shapes = {s.data.shape for s in q.addressable_shards}
    L, D, H, K = q.shape
    assert shard_shapes == {(L, D // 2, H // 4, K)}
    assert {s.data.shape for s in w.embed.addressable_shards} == {(CFG.vocab_size // 4, D // 2)}


def test_sharded_forward_equals_unsharded(sharder: Sharder) -> None:
    """Tolerance 1e-5: the same fp32 sums, split and reduced across devices in another order."""
    w = init_params(jax.random.key(0), CFG, sharder)
    w_local = jax.device_put(w, jax.devices()[0])
    rng = np.random.default_rng(0)
    B, T = 4, 12
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segments = jnp.ones((B, T), jnp.int32).at[1, 9:].set(0)

    def run(w, tokens, sharder):  # type: ignore[no-untyped-def]
        return lm_logits(
            w, forward(w, CFG, Packed(tokens, positions, segments), sharder=sharder).hidden
        )

    batch_sharding = sharder.sharding(("batch", "seq"), (B, T))
    sharded = jax.jit(partial(run, sharder=sharder))(w, jax.device_put(tokens, batch_sharding))
    local = jax.jit(partial(run, sharder=one_device_sharder()))(w_local, tokens)
    assert len(sharded.sharding.device_set) == 8
    assert np.abs(np.asarray(sharded) - np.asarray(local)).max() <= 1e-5

    # the paged KV path, the pool's pages sharded over batch, kv heads over tensor
    pages = init_pages(CFG, num_pages=4 * B, page_size=16, sharder=sharder)
    assert {k.sharding.spec for k in pages.k} == {
        jax.sharding.PartitionSpec("tensor", ("data", "fsdp"), None, None)
    }
    table = jnp.arange(4 * B, dtype=jnp.int32).reshape(B, 4)[:, ::-1]

    def paged(w, cfg, tokens, n, pages, sharder):  # type: ignore[no-untyped-def]
        rows = Paged(tokens, pages, table, jnp.zeros((B,), jnp.int32), n, pages_read=4)
        out = forward(w, cfg, rows, sharder=sharder)
        return out.hidden, out.cache

    step = jax.jit(paged, static_argnames=("cfg", "sharder"))
    h, pages = step(w, CFG, tokens, jnp.full((B,), T), pages, sharder)
    h_local, _ = step(
        w_local,
        CFG,
        tokens,
        jnp.full((B,), T),
        init_pages(CFG, 4 * B, page_size=16, sharder=one_device_sharder()),
        one_device_sharder(),
    )
    assert np.abs(np.asarray(h) - np.asarray(h_local)).max() <= 1e-5


def test_rules_reject_collisions_and_uneven_splits(sharder: Sharder) -> None:
    with pytest.raises(ValueError, match="mesh axis 'tensor' shards both 'heads' and 'mlp'"):
        ShardingRules().spec(("heads", "mlp"))
    with pytest.raises(KeyError, match="unknown logical axis 'hidden'"):
        ShardingRules().spec(("hidden",))
    uneven = dataclasses.replace(CFG, num_kv_heads=2, num_heads=4)
    with pytest.raises(
        ValueError, match="'kv_heads' of size 2 does not divide over mesh axes tensor"
    ):
        init_params(jax.random.key(0), uneven, sharder)
    with pytest.raises(ValueError, match="needs 4 devices, have 8"):
        make_mesh(fsdp=2, tensor=2)
