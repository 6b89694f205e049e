"""The rollout protocol and its backends."""

from jax_agent_rl.rollout.embedded import BackendStats, EmbeddedBackend
from jax_agent_rl.rollout.protocol import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    RolloutBackend,
    SamplingParams,
    resolve_from_thread,
    validate_request,
)

__all__ = [
    "BackendStats",
    "Capabilities",
    "EmbeddedBackend",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "InvalidRequestError",
    "RolloutBackend",
    "SamplingParams",
    "resolve_from_thread",
    "validate_request",
]
