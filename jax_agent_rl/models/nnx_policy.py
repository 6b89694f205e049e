"""A Flax NNX module as a `policy.Policy`: what ``model.module`` of a run names.

The module a user writes (``examples/flax_nnx_policy``) has this shape:

    module(tokens_bt, positions_bt, attend) -> final hidden [B, T, D]
    module.head_vd() -> the output head [V, D]

``attend(i, q, k, v)`` is layer i's attention of its queries [B, T, H, K] over the keys and
values [B, T, G, K] of the chunk (and, in the engine, of the row's earlier positions): the
run gives the module its own attention for training (`decoder.attention`, packed segments)
and for the engine (`paged.PagedChunk`, a paged KV pool laid out as the config's
``num_layers`` x ``num_kv_heads`` x ``head_dim`` say), so the module never owns a cache.

Its parameters (`nnx.Param`, logical axes as their ``out_sharding``; eager sharding is off
while the module is built) are held as a plain nested dict of arrays (string keys), the tree
`specs` declares; `nnx.merge` of the module's graph with them happens when ``forward`` is
traced, inside the jitted program, never per step on the host.

Not supported, refused by name (`policy.UnsupportedPolicyError` / the run's ConfigError):
LoRA adapters, Qwen3-MoE routing (experts, routing replay), HF checkpoint import / export
(and so the vLLM and JetStream backends, which load HF tensors), a module with state other
than its parameters (batch statistics, RNG streams: the forward is deterministic).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.contract import NO_ROUTING, Forward, Packed, Paged, Routing, WholeParams
from jax_agent_rl.models.decoder import ParamSpec, attention, checked_against
from jax_agent_rl.models.paged import KVPages
from jax_agent_rl.models.policy import UnsupportedPolicyError, head_logits
from jax_agent_rl.models.sharding import Sharder

ModuleFactory = Callable[[nnx.Rngs], nnx.Module]
Path = tuple[str, ...]


def _built(make: ModuleFactory, key: jax.Array) -> nnx.Module:
    """The module ``make`` builds with an `nnx.Rngs` of one stream, ``params``; one that asks
    for another (``nnx.Dropout(rate, rngs=rngs)`` asks for ``dropout``) is refused saying what
    to change: it failed with flax's ``KeyError: "No RngStream named 'dropout' found in
    Rngs."`` and nothing on what to do."""
    with nnx.use_eager_sharding(False):  # the run lays parameters out (`specs`' axes)
        try:
            return make(nnx.Rngs(params=key))
        except KeyError as e:
            if "RngStream" not in str(e):
                raise
            raise UnsupportedPolicyError(
                f"the module asks its nnx.Rngs for a stream the run does not give ({e}): a "
                "policy's forward is deterministic, and its Rngs hold a 'params' stream only; "
                "leave dropout out of it, or build it without rngs "
                "(nnx.Dropout(rate, deterministic=True))"
            ) from None


class NnxPolicy(WholeParams):
    """``make(rngs)`` builds the module (its own initialisers); the sizes are the config's
    (`policy` module docstring): a paged pool of ``num_layers`` layers of ``num_kv_heads`` x
    ``head_dim``, a head of ``vocab_size`` x ``hidden_size``, positions below ``max_len``."""

    def __init__(
        self,
        make: ModuleFactory,
        *,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
    ) -> None:
        self._make = make
        module = nnx.eval_shape(lambda: _built(make, jax.random.key(0)))
        parts: tuple[Any, ...] = nnx.split(module, nnx.Param, ...)
        self._graph: Any = parts[0]
        state, rest = parts[1], parts[2]
        if jax.tree.leaves(rest):
            raise UnsupportedPolicyError(
                f"the module holds state other than nnx.Param ({jax.tree.structure(rest)}): "
                "a policy's forward is a function of its parameters alone"
            )
        self._flat = list(nnx.to_flat_state(state))  # (path, abstract nnx.Param)
        specs: dict[str, Any] = {}
        for path, var in self._flat:
            shape = tuple(var.get_value().shape)
            axes: tuple[str | None, ...] = tuple(
                var.get_metadata().get("out_sharding") or (None,) * len(shape)
            )
            _nested_set(specs, _names(path), ParamSpec(shape, axes, None))
        self._specs = specs
        self.cfg = ModelConfig(
            family="llama",  # sizes only: a custom policy has no HF family (to_hf refuses)
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_len,
            dtype="float32",  # (the learner's; the engine serves `in_dtype` the run's)
        )

    def __repr__(self) -> str:
        return f"NnxPolicy({getattr(self._make, '__qualname__', self._make)!r})"

    def init(self, key: jax.Array, dtype: Any) -> dict[str, Any]:
        """The module's own initialisation under ``key`` (built once, under `init_policy`'
        jit), as the nested dict of arrays `specs` declares."""
        _, state = nnx.split(_built(self._make, key), nnx.Param)
        params: dict[str, Any] = {}
        for path, var in nnx.to_flat_state(state):
            _nested_set(params, _names(path), var.get_value().astype(dtype))
        return params

    def specs(self) -> dict[str, Any]:
        return self._specs

    def checked(self, params: Any) -> Any:
        return checked_against(self._specs, params)

    def in_dtype(self, dtype: str) -> NnxPolicy:
        policy = copy.copy(self)
        policy.cfg = dataclasses.replace(self.cfg, dtype=dtype)  # type: ignore[arg-type]
        return policy

    def serving_layout(self, params: Any) -> Any:
        return params

    def _module(self, params: Any) -> Any:
        """The module holding ``params`` (`nnx.merge`: at trace time only)."""
        flat = [(p, var.replace(_nested_get(params, _names(p)))) for p, var in self._flat]
        return nnx.merge(self._graph, nnx.from_flat_state(flat))

    def forward(
        self,
        params: Any,
        rows: Packed | Paged,
        *,
        sharder: Sharder,
        remat: bool = False,
        routing: Routing = NO_ROUTING,
    ) -> Forward:
        """The policy contract's forward (`contract`) of the module."""
        if routing.asked:
            raise UnsupportedPolicyError(f"routing asked of a {self!r}, which has no experts")
        if isinstance(rows, Paged):
            chunk = rows.attention(sharder)
            h = self._module(params)(rows.tokens, chunk.positions, chunk.attend)
            return Forward(h, KVPages(k=chunk.k, v=chunk.v))
        packed = rows

        def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            del i  # every layer attends within the same segments
            return attention(
                q, k, v, packed.segments, packed.window, sharder=sharder, reach_bt=packed.reach
            )

        def run(params: Any) -> jax.Array:
            h: jax.Array = self._module(params)(packed.tokens, packed.positions, attend)
            return h

        return Forward((jax.checkpoint(run) if remat else run)(params))

    def head_vd(self, params: Any) -> jax.Array:
        head: jax.Array = self._module(params).head_vd()
        return head

    def logits(self, params: Any, h_btd: jax.Array) -> jax.Array:
        return head_logits(self.head_vd(params), h_btd)

    def hf_tensors(self, params: Any, on_device: bool = False) -> Iterator[tuple[str, Any]]:
        del params, on_device
        raise UnsupportedPolicyError(f"{self!r} has no HF checkpoint layout to export")


def _names(path: tuple[Any, ...]) -> Path:
    """A parameter's path as string keys (an `nnx.List`'s indices too: checkpoints want them)."""
    return tuple(str(p) for p in path)


def _nested_set(tree: dict[str, Any], path: Path, value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _nested_get(tree: Any, path: Path) -> Any:
    for part in path:
        tree = tree[part]
    return tree
