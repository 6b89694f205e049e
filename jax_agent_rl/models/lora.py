"""LoRA: low-rank adapters on the decoder's projections, as HF PEFT defines them.

A target projection ``y = x W`` (W [in..., out...]) becomes ``y = x W + s (x A) B`` with
A [in..., r], B [r, out...] and ``s = alpha / r``. A is initialised as PEFT does
(``kaiming_uniform_(a=sqrt(5))`` of its ``nn.Linear`` [r, in]: U(-1/sqrt(in), 1/sqrt(in))),
B as zeros, so a fresh adapter leaves the model's function unchanged.

The adapters are parameters of the decoder's layers (`decoder.Layer.lora`, stacked on L like
every other layer weight) and are declared in `decoder.param_specs` when the model's config
carries a `Lora`; a layer whose ``lora`` is ``None`` runs the base model (the reference policy
of a LoRA run reads the same base arrays with the adapters left out).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

# the projections an adapter may wrap, in PEFT's order (HF module names in `adapters`)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
MLP_TARGETS = frozenset({"gate", "up", "down"})
# the largest scale alpha / rank taken: two orders past the largest in use (alpha 1024 over
# rank 8, 128), and far below where float32 overflows (~3.4e38): a huge scale (alpha 1e308 is
# inf in float32) turns the first nonzero adapter gradient into inf or NaN weights
MAX_SCALE = 1e4
# the smallest alpha: four orders below the smallest in use (1); a tiny alpha (1e-310,
# subnormal) makes a scale that rounds every adapter's contribution to nothing in bf16 and
# fp32, so the run trains adapters that change no output (over any rank a projection allows,
# 1e-4 keeps the scale a normal float32)
MIN_ALPHA = 1e-4


@dataclasses.dataclass(frozen=True)
class Lora:
    """Adapters of rank ``rank`` scaled by ``alpha / rank`` on the projections ``targets``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank}: expected >= 1")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha={self.alpha}: expected a finite number > 0")
        if self.alpha < MIN_ALPHA:
            raise ValueError(
                f"LoRA alpha={self.alpha:g}: expected >= {MIN_ALPHA:g} (a smaller one rounds "
                "the adapters' contribution to nothing)"
            )
        if self.scale > MAX_SCALE:
            raise ValueError(
                f"LoRA alpha={self.alpha:g} / rank={self.rank} = {self.scale:g}: expected a "
                f"scale <= {MAX_SCALE:g}"
            )
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"LoRA targets={list(self.targets)}: expected distinct names of {list(TARGETS)}"
                + (f" ({unknown[0]!r} is none)" if unknown else "")
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapter:
    """One projection's adapter: ``a`` [L, in..., r], ``b`` [L, r, out...] (stacked)."""

    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerAdapters:
    """Every layer's adapters, one `Adapter` per target (``None``: not a target)."""

    q: Adapter | None = None
    k: Adapter | None = None
    v: Adapter | None = None
    o: Adapter | None = None
    gate: Adapter | None = None
    up: Adapter | None = None
    down: Adapter | None = None


def peft_uniform(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """PEFT's A of shape [L, in..., r]: U(-1/sqrt(in), 1/sqrt(in)), ``in`` the product of the
    input dimensions (kaiming_uniform_ with a=sqrt(5) of the [r, in] ``nn.Linear``)."""
    bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _parts(spec: str) -> tuple[str, str, str, str]:
    """``"btd,dhk->bthk"`` -> (x's subscripts, W's, the output's, the contracted ones)."""
    xs, rest = spec.split(",")
    ws, out = rest.split("->")
    return xs, ws, out, "".join(c for c in ws if c not in out)


def lora_delta(spec: str, x: jax.Array, adapter: Adapter, scale: float) -> jax.Array:
    """``scale * (x A) B`` for the projection ``einsum(spec, x, W)``; each matmul accumulated
    in fp32 and rounded to ``x``'s dtype, as the decoder's own (`decoder.matmul`)."""
    xs, ws, out, contracted = _parts(spec)
    assert "r" not in spec, spec
    kept = "".join(c for c in xs if c not in contracted)
    a, b = adapter.a.astype(x.dtype), adapter.b.astype(x.dtype)
    f32 = jnp.float32
    xa = jnp.einsum(f"{xs},{contracted}r->{kept}r", x, a, preferred_element_type=f32)
    outs = "".join(c for c in ws if c not in contracted)
    y = jnp.einsum(f"{kept}r,r{outs}->{out}", xa.astype(x.dtype), b, preferred_element_type=f32)
    return (scale * y).astype(x.dtype)


def merged(w: jax.Array, adapter: Adapter, scale: float) -> jax.Array:
    """``W + scale * A B`` for stacked [L, in..., out...] ``w`` (fp32 sums, ``w``'s dtype)."""
    r = adapter.a.shape[-1]
    a = adapter.a.reshape(adapter.a.shape[0], -1, r).astype(jnp.float32)
    b = adapter.b.reshape(adapter.b.shape[0], r, -1).astype(jnp.float32)
    ab = jnp.einsum("lir,lro->lio", a, b).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)
