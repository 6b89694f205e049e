"""The engine's costliest programs as abstract computations, for compiling them for another
platform than this host's (``jarl plan`` compiles them for TPU topologies on a CPU host):
each a jitted function of the engine and its arguments as `jax.ShapeDtypeStruct`s laid out as
the engine lays out the real ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.engine.engine import Engine
from jax_agent_rl.engine.state import slot_axes
from jax_agent_rl.models import Policy, Sharder, Weights, policy_shardings
from jax_agent_rl.models.decoder import is_spec
from jax_agent_rl.protocol import SamplingParams

Program = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def serving_shardings(policy: Policy, sharder: Sharder) -> Any:
    """The layout of a checkpoint family's `serving_layout` (`DecoderPolicy`, `Gemma3Policy`:
    ``embed``, stacked ``layers``, ``final_norm``, ``lm_head``): each layer's weights by their
    declared logical axes less the stacked one, the head [D, V] by ("embed", "vocab")."""
    specs, cfg = policy.specs(), policy.cfg
    layer = jax.tree.map(
        lambda s: sharder.sharding(s.logical_axes[1:], s.shape[1:]), specs.layers, is_leaf=is_spec
    )
    head = sharder.sharding(("embed", "vocab"), (cfg.hidden_size, cfg.vocab_size))
    return dataclasses.replace(
        policy_shardings(policy, sharder), layers=(layer,) * cfg.num_layers, lm_head=head
    )


def abstract_programs(engine: Engine, params: Weights, num_steps: int) -> dict[str, Program]:
    """(jitted function, abstract arguments, static arguments) of the costliest programs
    `Engine.warmup` compiles, by name: ``load_params``, the serving layout of ``params``
    (abstract weights in the declared layout, as a learner holds them, on the engine's mesh);
    ``prefill``, the longest chunk reading the most pages; ``generate``, ``num_steps`` decode
    steps at the largest batch bucket; ``step``, a ragged step at its largest row bucket
    (prompt chunks filling it)."""
    state = engine.abstract_decode_state()
    serving = jax.eval_shape(engine._serving_layout, params)
    serving = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        serving,
        serving_shardings(engine.policy, engine.sharder),
    )
    slots = jax.eval_shape(lambda: engine._request_slots(SamplingParams(max_tokens=1), 0, 0))

    def table(rows: int, axes: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
        shape = (rows, engine.pages_per_seq)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=engine.sharder.sharding(axes, shape))

    bucket, rows = engine.prefill_buckets[-1], engine.batch_buckets[-1]
    padded = jax.ShapeDtypeStruct((1, bucket), jnp.int32)
    start_n = jax.ShapeDtypeStruct((2,), jnp.int32)
    slot_b = jax.ShapeDtypeStruct(
        (rows,), jnp.int32, sharding=engine.sharder.sharding(("batch",), (rows,))
    )
    step_table, step_chunks = engine.filling_chunks(engine.step_buckets[-1])

    def laid_out(x: np.ndarray) -> jax.ShapeDtypeStruct:
        at = engine.sharder.sharding(slot_axes(x.ndim), x.shape)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=at)

    step_args = jax.tree.map(laid_out, engine.step_arguments(step_table, step_chunks))
    return {
        "load_params": (engine._serving_layout, (params,), {}),
        "step": (engine._step, (serving, state, *step_args), {}),
        "prefill": (
            engine._prefill,
            (serving, state, table(1, (None, None)), start_n, padded, slots),
            {"pages_read": engine.page_buckets[-1]},
        ),
        "generate": (
            engine._generate,
            (serving, state, table(rows, ("batch", None)), slot_b),
            {"num_steps": num_steps},
        ),
    }
