"""The JAX inference engine (JetStream-shaped: prefill, insert, generate over decode slots)."""

from jax_agent_rl.engine.engine import DecodeState, Engine, Prefix, Slots, StepTokens
from jax_agent_rl.engine.sampling import (
    InvalidRequestError,
    SamplingParams,
    sample,
    sampling_logprobs,
    token_logprobs,
)

__all__ = [
    "DecodeState",
    "Engine",
    "InvalidRequestError",
    "Prefix",
    "SamplingParams",
    "Slots",
    "StepTokens",
    "sample",
    "sampling_logprobs",
    "token_logprobs",
]
