"""Weights moved as a training step would move them, for tests of weight pushes."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def sparse_step(weights: Any, seed: int) -> Any:
    """``weights`` after a sparse step: about 2% of each leaf's elements moved by 1%."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(jax.device_get(weights))
    moved = [
        np.where(rng.random(x.shape) < 0.02, x * (1 + 0.01 * rng.standard_normal(x.shape)), x)
        for x in leaves
    ]
    cast = [jnp.asarray(m, x.dtype) for m, x in zip(moved, leaves, strict=True)]
    return jax.tree.unflatten(treedef, cast)
