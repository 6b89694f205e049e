"""Counting the XLA programs a block of code builds, as JAX reports them: each one either
compiled by the backend or loaded from the persistent compilation cache that the suite's
processes share (tests/conftest.py), so that a count does not depend on what ran before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

COMPILED = "/jax/core/compile/backend_compile_duration"
LOADED = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def programs_built() -> Iterator[list[str]]:
    """A list that gets ``"compiled"`` or ``"loaded"`` for every program built in the block."""
    built: list[str] = []

    def on_duration(event: str, duration: float, **kwargs: object) -> None:
        del duration, kwargs
        if event == COMPILED:
            built.append("compiled")

    def on_event(event: str, **kwargs: object) -> None:
        del kwargs
        if event == LOADED:
            built.append("loaded")

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield built
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
