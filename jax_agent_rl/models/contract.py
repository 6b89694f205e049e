"""The forward contract: what a policy's forward takes and what it returns (`policy.Policy`).

A forward runs over one of two kinds of rows:

- `Packed`: the learner's rows of whole sequences, several packed in a row (``segments``
  number them, 0 marks padding; ``positions`` restart at 0 in each), or tree rows, where
  sequences share their prefix's positions (``reach``);
- `Paged`: the engine's rows over a paged KV cache, each row's new tokens written into its
  own pages: a prefill chunk, a decode step, or one ragged step of both (``rows``).

`Routing` says what a policy with `Experts` replays and records (a policy without experts is
given the empty one). The result is one `Forward`: the final hidden states, the updated
pages for `Paged` rows, and the routing asked for. Each is a pytree (its static settings
its structure), so a jitted function takes and returns them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_agent_rl.models.paged import KVPages, PagedChunk, RaggedStep, StepRows
from jax_agent_rl.models.sharding import Sharder


def _static(default: Any) -> Any:
    """A field of a pytree's structure (a setting the program is compiled for), not a leaf."""
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """Training rows [B, T]: a token attends to the earlier-or-equal tokens of its own
    segment. ``window`` (static): no sequence is longer (the TPU kernel then reads fewer
    keys). ``reach`` [B, T] (tree rows): a token is read by the queries at or after it and
    before ``reach[t]``; it replaces the segments' mask."""

    tokens: jax.Array
    positions: jax.Array
    segments: jax.Array
    window: int | None = _static(None)
    reach: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Paged:
    """The engine's rows [B, T] over ``cache``. Row b's pages are ``page_table[b]`` and it
    holds ``pos[b]`` tokens already; its tokens take positions ``pos[b] + t`` and attend to
    the row's earlier positions plus its own earlier tokens. Only its first ``num_new[b]``
    tokens are real (their keys and values are written into its pages); the rest are
    padding, written nowhere. The caller advances ``pos``.

    ``pages_read`` (static, T > 1: prefill): the pages each row reads, a bucket covering its
    positions. T = 1 (decode) reads each row's own pages (``decode_kernel`` "ragged", or
    "pallas" / "triton", the platform's kernel). ``rows`` instead of the tables: one ragged
    step, B rows of one token (T = 1), the decode rows and prompt chunks of several
    sequences, each row with its own sequence's pages (`paged.StepRows`)."""

    tokens: jax.Array
    cache: KVPages
    page_table: jax.Array | None = None
    pos: jax.Array | None = None
    num_new: jax.Array | None = None
    pages_read: int | None = _static(None)
    decode_kernel: str = _static("ragged")
    rows: StepRows | None = None

    def attention(self, sharder: Sharder, exact: bool = False) -> PagedChunk | RaggedStep:
        """The attention these rows run through, layer by layer (``attend(i, q, k, v)``, and
        the updated pool buffers after): a ragged step's (``rows``) or a chunk's of rows with
        page tables (`paged.PagedChunk`; ``exact``: the exact-logprob pages' reading)."""
        B, T = self.tokens.shape
        k, v = self.cache.k, self.cache.v
        if self.rows is not None:
            if T != 1 or self.rows.pos.shape[0] != B:
                raise ValueError(
                    f"a ragged step's {self.rows.pos.shape[0]} rows of one token, not {B}x{T}"
                )
            return RaggedStep(sharder, k, v, self.rows, self.decode_kernel)
        if self.page_table is None or self.pos is None or self.num_new is None:
            raise ValueError("Paged rows need page_table, pos and num_new (or a step's rows)")
        return PagedChunk(
            sharder, k, v, self.page_table, self.pos, self.num_new, self.pages_read,
            self.decode_kernel, B, T, exact=exact,
        )  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """A policy with `Experts`: ``replay`` [sparse layers, B, T, k]
    (any int dtype) are the experts used instead of the router's own top-k, gated by the
    router's probabilities of them (a token given -1, `moe.NO_EXPERTS`, routes itself);
    ``record``: return the experts each token chose; ``router_logits`` (`Packed` rows only):
    return each sparse layer's router logits (`moe.load_balancing_loss`)."""

    replay: jax.Array | None = None
    record: bool = _static(False)
    router_logits: bool = _static(False)

    @property
    def asked(self) -> bool:
        """Whether this asks anything of a policy's experts."""
        return self.replay is not None or self.record or self.router_logits


NO_ROUTING = Routing()


@dataclasses.dataclass(frozen=True)
class Experts:
    """A policy's experts (`policy.Policy.experts`): what its routing rows hold per token,
    [sparse_layers, per_token] expert ids, each below ``count``."""

    sparse_layers: int
    per_token: int
    count: int


class WholeParams:
    """The capabilities of a policy with neither experts nor adapters (`policy.Policy`): no
    routing to record or replay, and the optimizer updates (and the push sends) every
    parameter; its KL reference is itself."""

    experts: Experts | None = None
    adapted = False

    def trained(self, params: Any) -> Any:
        return params

    def with_trained(self, params: Any, part: Any) -> Any:
        del params
        return part

    def base(self, params: Any) -> Any:
        return params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Forward:
    """A forward's result: final hidden [B, T, D] (the policy's ``logits`` / ``head_vd``
    read it), ``cache`` (the updated pages, `Paged` rows), ``expert_ids`` [sparse layers,
    B, T, k] int32 (`Routing.record`), ``router_logits`` [sparse layers, B, T, E] fp32
    (`Routing.router_logits`)."""

    hidden: jax.Array
    cache: KVPages | None = None
    expert_ids: jax.Array | None = None
    router_logits: jax.Array | None = None
