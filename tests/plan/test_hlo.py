"""`plan.hlo.count`: a compiled program's FLOPs and HBM bytes with every loop's trip count
applied, read from its HLO text. Programs compiled here (CPU) for the loops and the slices;
TPU constructs (a matmul written as a padded convolution, an async collective, a Pallas kernel
whose metadata runs over several lines, a SparseCore computation) in HLO text as libtpu prints
it, cut down."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jax_agent_rl.plan import hlo

L, B, D = 8, 16, 128


def stacked_matmuls(w_ldd: jax.Array, x_bd: jax.Array, n: jax.Array) -> jax.Array:
    """L matmuls over stacked weights (a scan), then a loop of ``n`` steps, a count only the
    device knows, under the named scope "rows"."""

    def layer(x: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(x @ w), None

    y_bd, _ = jax.lax.scan(layer, x_bd, w_ldd)
    with jax.named_scope("rows"):
        return jax.lax.fori_loop(0, n, lambda i, c: c + jnp.sum(y_bd[i]), 0.0)


def compiled_text() -> str:
    args = (jnp.ones((L, D, D)), jnp.ones((B, D)), jnp.int32(B))
    text = jax.jit(stacked_matmuls).lower(*args).compile().as_text()
    assert text is not None
    return text


def test_a_scan_counts_its_body_once_per_layer_and_its_slices_by_what_they_read() -> None:
    """The scan's matmul counts L times (XLA's own cost analysis counts it once); the slice
    of the stacked weights each layer takes counts one layer's bytes, not the stack's: the
    whole program moves under four stacks (each layer read and written by its slice, then
    read by its matmul, and the activations), where counting the stack per layer would be
    L = 8 of them."""
    count = hlo.count(compiled_text(), {"rows": B})
    assert count.flops == L * 2 * B * D * D
    stack = L * D * D * 4
    assert 3 * stack < count.bytes < 4 * stack
    assert {(loop.trips, loop.source) for loop in count.loops} == {(L, "known"), (B, "given")}


def test_a_loop_only_the_device_counts_takes_its_trip_count_by_named_scope() -> None:
    """Given by its scope, the loop's ops count B times; not given, once, and the loop is
    listed as of unknown count."""
    text = compiled_text()
    given, unknown = hlo.count(text, {"rows": B}), hlo.count(text)
    assert [loop.source for loop in unknown.loops].count("unknown") == 1
    in_rows = lambda c: [o for o in c.ops if "/rows/" in o.where]  # noqa: E731
    assert in_rows(given) and all(o.trips == B for o in in_rows(given))
    assert all(o.trips == 1 for o in in_rows(unknown))
    assert given.bytes > unknown.bytes


# tpu_step.hlo, cut down from libtpu's compiled RL update: a loop of 7 steps whose body runs the q
# projection as a convolution over a window of 6 heads padded by 5 on each side (one real
# position per output), gathers a weight asynchronously (its start and done fusions), runs a
# Pallas kernel whose metadata spans lines, and reads a stacked weight one layer at a time
TPU_TEXT = (Path(__file__).parent / "tpu_step.hlo").read_text()


def test_tpu_constructs_are_counted_as_what_they_do() -> None:
    """Per step of the loop (7, from its condition ``i < 7``): the convolution's real
    multiply-adds only (each output position meets one input position of its window of 6:
    2 x 4096 x 6 heads x 128 x 1536, not 6 times that); the gather once, at its start, as its
    result in HBM (its operand is in on-chip memory, ``S(1)``); the layer's slice as one
    layer read from HBM (written on chip); the kernel at the cost the caller gives it."""
    layer = 768 * 4480 * 2
    given: list[tuple[str, list[str], str]] = []

    def kernels(name: str, operands: list[str], result: str) -> tuple[float, float]:
        given.append((name, operands, result))
        return 1e9, 1e6

    count = hlo.count(TPU_TEXT, kernels=kernels)
    assert [(loop.trips, loop.source) for loop in count.loops] == [(7, "known")]
    assert [name for name, _, _ in given] == ["splash_mha_fwd"]
    by_kind = {o.kind: o for o in count.ops}
    assert set(by_kind) == {"fusion", "all-gather", "kernel splash_mha_fwd", "add", "compare"}
    projection = next(o for o in count.ops if o.name == "proj")
    assert projection.flops == 7 * 2 * 4096 * 6 * 128 * 1536
    assert by_kind["all-gather"].bytes == 7 * 2 * layer  # its result (its operand is on chip)
    assert next(o for o in count.ops if o.name == "slice").bytes == 7 * (layer + 4)
    assert by_kind["kernel splash_mha_fwd"].flops == 7 * 1e9
    assert count.flops == projection.flops + 7 * 1e9
    assert [o.kind for o in count.collectives] == ["all-gather"]
