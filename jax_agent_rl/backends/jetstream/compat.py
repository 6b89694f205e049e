"""What JetStream 0.2.2 needs to run on current JAX and to take token ids as given.

- Its orchestrator frees prefill results with ``jax.tree_map``, which JAX removed in favour
  of ``jax.tree.map`` (the same function).
- Its ``token_utils.pad_tokens`` reads ``tokens.shape``, but the orchestrator hands it a
  request's token ids as a list; only when it first prepends a BOS token (which makes an
  array) does that work. Token-id requests without a BOS would kill the server.

`install` fixes both; call it before JetStream's orchestrator serves a request.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


def install() -> None:
    """Restores ``jax.tree_map`` and makes ``pad_tokens`` take a list (idempotent)."""
    from jetstream.engine import token_utils

    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map  # type: ignore[attr-defined]
    pad_tokens = token_utils.pad_tokens
    if getattr(pad_tokens, "takes_lists", False):
        return

    @functools.wraps(pad_tokens)
    def pad_token_ids(tokens: Any, *args: Any, **kwargs: Any) -> Any:
        return pad_tokens(np.asarray(tokens, np.int32), *args, **kwargs)

    pad_token_ids.takes_lists = True  # type: ignore[attr-defined]
    token_utils.pad_tokens = pad_token_ids
