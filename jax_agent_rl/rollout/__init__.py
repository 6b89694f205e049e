"""The rollout protocol and its backends."""

from jax_agent_rl.protocol import (
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
from jax_agent_rl.rollout.embedded import EmbeddedBackend
from jax_agent_rl.rollout.registry import (
    BackendBuild,
    BackendFactory,
    backend_names,
    make_backend,
    register_backend,
)
from jax_agent_rl.rollout.session_pages import BackendStats

__all__ = [
    "BackendBuild",
    "BackendFactory",
    "BackendStats",
    "Capabilities",
    "EmbeddedBackend",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "InvalidRequestError",
    "RolloutBackend",
    "SamplingParams",
    "backend_names",
    "make_backend",
    "register_backend",
    "resolve_from_thread",
    "validate_request",
]
