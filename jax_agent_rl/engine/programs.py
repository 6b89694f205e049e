"""The engine's costliest programs as abstract computations, for compiling them for another
platform than this host's (``jarl plan`` compiles them for TPU topologies on a CPU host):
each a jitted function of the engine and its arguments as `jax.ShapeDtypeStruct`s laid out as
the engine lays out the real ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_agent_rl.engine.engine import Engine
from jax_agent_rl.models import Layer, ModelConfig, Sharder, Weights, param_specs
from jax_agent_rl.models.decoder import is_spec

Program = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def serving_shardings(cfg: ModelConfig, sharder: Sharder) -> Weights:
    """The layout of `serving_layout`'s weights: each layer's by its declared logical axes
    less the stacked one, the head [D, V] by ("embed", "vocab")."""
    specs = param_specs(cfg)

    layer: Layer = jax.tree.map(
        lambda s: sharder.sharding(s.logical_axes[1:], s.shape[1:]), specs.layers, is_leaf=is_spec
    )
    head = sharder.sharding(("embed", "vocab"), (cfg.hidden_size, cfg.vocab_size))
    return Weights(
        embed=sharder.sharding(specs.embed.logical_axes, specs.embed.shape),
        layers=(layer,) * cfg.num_layers,
        final_norm=sharder.sharding(specs.final_norm.logical_axes, specs.final_norm.shape),
        lm_head=head,
    )


def abstract_programs(engine: Engine, params: Weights, num_steps: int) -> dict[str, Program]:
    """(jitted function, abstract arguments, static arguments) of the costliest programs
    `Engine.warmup` compiles, by name: ``load_params``, the serving layout of ``params``
    (abstract weights in the declared layout, as a learner holds them, on the engine's mesh);
    ``step``, a ragged step of ``num_steps`` steps at its largest token bucket (a budget of
    prompt chunks, each shard's); ``decode``, one at the bucket that holds every slot's
    decode row (each shard's slots)."""
    state = engine.abstract_decode_state()
    serving = jax.eval_shape(engine._serving_layout, params)
    serving = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        serving,
        serving_shardings(engine.cfg, engine.sharder),
    )

    def rows(n: int, *rest: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
        shape = (engine.shards * n, *rest)
        at = engine.sharder.sharding(("batch",) + (None,) * len(rest), shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=at)

    def step_args(tokens: int) -> tuple[Any, ...]:
        n = engine.step_bucket(tokens)
        r, m = min(n, engine.slots_per_shard), engine.pages_per_seq
        fresh = jax.tree.map(lambda x: rows(r, *x.shape[1:], dtype=x.dtype), state.slots)
        per_token, per_row = (rows(n),) * 3, (rows(r), rows(r), rows(r, dtype=jnp.bool_))
        return (serving, state, *per_token, *per_row, rows(n, m), rows(r, m), fresh)

    largest = engine.step_buckets[-1]
    static = {"num_steps": num_steps}
    return {
        "load_params": (engine._serving_layout, (params,), {}),
        "step": (engine._step, step_args(largest), static),
        "decode": (engine._step, step_args(engine.slots_per_shard), static),
    }
