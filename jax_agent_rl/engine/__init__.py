"""The JAX inference engine (JetStream-shaped: prefill, insert, generate over decode slots)."""

from jax_agent_rl.engine.engine import Engine
from jax_agent_rl.engine.pages import PagePool
from jax_agent_rl.engine.sampling import sample, sampling_logprobs, token_logprobs
from jax_agent_rl.engine.state import (
    DecodeState,
    Prefix,
    Slots,
    StepTokens,
    cache_dtype,
    compile_platform,
    page_bytes,
    pool_pages,
)

__all__ = [
    "DecodeState",
    "Engine",
    "PagePool",
    "Prefix",
    "Slots",
    "StepTokens",
    "cache_dtype",
    "compile_platform",
    "page_bytes",
    "pool_pages",
    "sample",
    "sampling_logprobs",
    "token_logprobs",
]
