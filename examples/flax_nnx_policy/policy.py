"""A small transformer written in Flax NNX, trained by ``jarl train`` through
``model.module: examples/flax_nnx_policy/policy.py:make_policy`` (README.md).

The module computes whatever it likes; the run gives it one thing, ``attend(i, q, k, v)``:
layer i's attention over its queries [B, T, H, K] and keys / values [B, T, G, K] (packed
training rows, or the engine's paged KV cache: the module never holds a cache itself).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_agent_rl.models.nnx_policy import NnxPolicy

D, H, G, K, F, LAYERS, MAX_LEN = 64, 4, 2, 16, 128, 2, 256


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    """A N(0, 0.02) weight whose dimensions carry the run's logical axes (sharding names)."""
    return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape), out_sharding=axes)


def rms_norm(x: jax.Array, w: nnx.Param) -> jax.Array:
    return w[...] * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.Param(jnp.ones((D,)), out_sharding=("embed",))
        self.q = param(rngs, (D, H, K), ("embed", "heads", "head_dim"))
        self.k = param(rngs, (D, G, K), ("embed", "kv_heads", "head_dim"))
        self.v = param(rngs, (D, G, K), ("embed", "kv_heads", "head_dim"))
        self.o = param(rngs, (H, K, D), ("heads", "head_dim", "embed"))
        self.mlp_norm = nnx.Param(jnp.ones((D,)), out_sharding=("embed",))
        self.up = param(rngs, (D, 2 * F), ("embed", "mlp"))
        self.down = param(rngs, (F, D), ("mlp", "embed"))

    def __call__(self, x_btd: jax.Array, attend_layer: Callable[..., jax.Array]) -> jax.Array:
        h = rms_norm(x_btd, self.attn_norm)
        q = jnp.einsum("btd,dhk->bthk", h, self.q[...])
        k = jnp.einsum("btd,dgk->btgk", h, self.k[...])
        v = jnp.einsum("btd,dgk->btgk", h, self.v[...])
        x_btd = x_btd + jnp.einsum("bthk,hkd->btd", attend_layer(q, k, v), self.o[...])
        gate, up = jnp.split(rms_norm(x_btd, self.mlp_norm) @ self.up[...], 2, axis=-1)
        return x_btd + (jax.nn.silu(gate) * up) @ self.down[...]


class TinyLM(nnx.Module):
    """Token and learned position embeddings, pre-norm blocks, a head tied to the embedding."""

    def __init__(self, vocab_size: int, rngs: nnx.Rngs) -> None:
        self.embed = param(rngs, (vocab_size, D), ("vocab", "embed"))
        self.positions = param(rngs, (MAX_LEN, D), (None, "embed"))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.Param(jnp.ones((D,)), out_sharding=("embed",))

    def __call__(
        self, tokens_bt: jax.Array, positions_bt: jax.Array, attend: Callable[..., jax.Array]
    ) -> jax.Array:
        x = self.embed[...][tokens_bt] + self.positions[...][positions_bt]
        for i, block in enumerate(self.blocks):
            x = block(x, lambda q, k, v, i=i: attend(i, q, k, v))
        return rms_norm(x, self.final_norm)

    def head_vd(self) -> jax.Array:
        return self.embed[...]


def make_policy(vocab_size: int) -> NnxPolicy:
    """The policy ``model.module`` names: called with the tokenizer's vocabulary size."""
    return NnxPolicy(
        lambda rngs: TinyLM(vocab_size, rngs),
        vocab_size=vocab_size,
        hidden_size=D,
        num_layers=LAYERS,
        num_heads=H,
        num_kv_heads=G,
        head_dim=K,
        max_len=MAX_LEN,
    )
