"""The rollout protocol: the one seam between the agent loop and every inference backend.

Token ids in; token ids, their logprobs (and a mixture-of-experts model's experts) and a
finish reason out. Logprobs are those of each
sampled token under the distribution it was actually sampled from: logits / temperature, then
top-k, then top-p, renormalised. Greedy requests (temperature 0) report logprobs under the
same top-k/top-p filtering at temperature 1. The learner recomputes logprobs the same way, so
the two can be compared token by token.

`SamplingParams` says how to sample one request; `engine/sampling.py` is the embedded engine's
(and the learner's) one definition of that distribution. A backend declares what it honours in
`Capabilities`; the trainer does the rest itself (for example recomputing logprobs) rather
than pretending. The protocol imports nothing of the project: the engine and every backend
build on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np


class InvalidRequestError(ValueError):
    """A request a backend refuses before generating anything; the message names the field."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``top_k=-1`` and ``top_p=1`` disable those filters."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (`jax_agent_rl.rollout.stops`)
    logprobs: bool = True

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens}: must be at least 1")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise InvalidRequestError(f"top_k={self.top_k}: must be -1 (off) or >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop={list(self.stop)}: stop strings must be non-empty")


FinishReason = Literal["stop", "length", "abort"]
WeightUpdate = Literal["in_place", "reload", "none"]

# The most |rollout - learner| logprob difference a backend serving in fp32 guarantees: both
# sides compute the same fp32 forward in a different summation order (differences seen are
# ~1e-5, see docs/vllm.md). In any narrower dtype, bf16 rounding sets it.
FP32_LOGPROB_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 5e-2


def logprob_tolerance(dtype: str) -> float:
    """`Capabilities.logprob_tolerance` of a backend whose engine computes in ``dtype``."""
    return FP32_LOGPROB_TOLERANCE if dtype == "float32" else BF16_LOGPROB_TOLERANCE


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation. ``session_id`` ties the turns of one trajectory together, so a backend
    can route them to one replica and reuse the cached prefix instead of prefilling it again.
    ``prefix_session``: the session whose conversation this one continues (a branch of a tree
    rollout, `jax_agent_rl.agent.tree`); a session the backend has not seen yet starts from
    that one's cached prefix, on the replica that holds it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str | None = None
    prefix_session: str | None = None


def validate_request(
    request: GenerateRequest, vocab_size: int, max_model_len: int, max_stop_ids: int | None = None
) -> None:
    """Raises `InvalidRequestError` for what no backend can serve (the message names it), and
    for more stop ids than a backend takes (``max_stop_ids``: its limit, if it has one)."""
    prompt, rid = request.prompt_ids, request.request_id
    if not prompt:
        raise InvalidRequestError(f"request {rid!r}: prompt_ids is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"request {rid!r}: prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room "
            f"to generate within max_model_len={max_model_len}"
        )
    request.sampling.validate()
    stops = request.sampling.stop_token_ids
    if any(not 0 <= t < vocab_size for t in stops):
        raise InvalidRequestError(f"stop_token_ids {stops} reach outside the vocabulary")
    if max_stop_ids is not None and len(stops) > max_stop_ids:
        raise InvalidRequestError(
            f"{len(stops)} stop_token_ids; this engine takes at most {max_stop_ids}"
        )


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What was sampled. ``logprobs`` is ``None`` when the request did not ask for them.
    ``expert_ids`` (routing replay): a mixture-of-experts model's experts, [len(token_ids),
    sparse layers, k] ints (`models.moe.expert_id_dtype`), row i those of the position token i
    was sampled from (aligned as its logprob is); None from a dense model or a backend that
    does not report them (`Capabilities.expert_ids`).

    ``weight_version``: the weights that sampled the first token. A backend that keeps its KV
    over a weight push (the embedded engine with ``engine.keep_kv_on_update``) may sample the
    rest under later ones, over keys and values of earlier ones: ``token_versions`` holds,
    per token, the version that sampled it, and ``kv_versions`` the oldest version that
    computed a key or value it was sampled over (the token's KV version range runs from that
    one to its own). None: ``weight_version`` for every token.

    ``resent``: how many times the request was sent again from its prompt because the engine
    serving it died (a backend that restarts its engines); the tokens are the last sending's."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    weight_version: int
    expert_ids: np.ndarray | None = dataclasses.field(default=None, compare=False)
    token_versions: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    kv_versions: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    resent: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend honours; the conformance suite fails a backend that overclaims."""

    logprobs: bool  # sampled-token logprobs under the sampling distribution
    logprob_tolerance: float  # max |rollout - learner| logprob difference it guarantees (fp32)
    per_request_sampling: bool  # temperature / top-p / top-k / seed per request
    stop_token_ids: bool
    abort: bool
    prefix_cache: bool  # turn N+1 of a session does not re-prefill turns 1..N
    weight_update: WeightUpdate
    max_model_len: int  # prompt + generated tokens of one request
    # a mixture-of-experts model's sampled tokens come with their experts (routing replay)
    expert_ids: bool = False
    # serves a LoRA policy: its base frozen, its adapters applied unmerged, each push the
    # adapters alone (`models.lora.LayerAdapters`); a backend without it refuses such a push
    lora: bool = False
    # takes a delta push (`rollout.delta.WeightDelta`: the elements that changed since the
    # version it serves) and applies it in place; a backend without it refuses one
    delta_push: bool = False


@dataclasses.dataclass(frozen=True)
class PushStats:
    """A backend's last weight push: bytes moved, seconds to convert and write them (this
    process), the slowest engine's seconds to load them, the whole push's seconds, and the
    seconds it stalled generation (``stall_s``): where the push drains (`WeightGate`), the
    time new requests were held (the drain, then the load); where it lands mid-request
    (``engine.keep_kv_on_update``), the time the engine stopped decoding to take it.
    ``delta``: the push moved only what changed since the last (``engine.push.full_every``)."""

    bytes: int
    write_s: float
    load_s: float
    total_s: float
    stall_s: float = 0.0
    delta: bool = False

    def held(self, seconds: float) -> PushStats:
        """These figures, stalled ``seconds`` (a gate's hold: `WeightGate.update`)."""
        return dataclasses.replace(self, stall_s=seconds)


@runtime_checkable
class RolloutBackend(Protocol):
    """An inference engine as the agent loop sees it. All methods are safe to call concurrently
    from one event loop; none blocks it."""

    capabilities: Capabilities

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def update_weights(self, params: Any, version: int) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def close(self) -> None: ...

    def counters(self) -> dict[str, float]:
        """The backend's own running totals by metric name (``rollout/...``), reported with
        each training step; empty for a backend that counts nothing."""
        ...


def resolve_from_thread(
    future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop, value: Any
) -> None:
    """Completes ``future`` (owned by ``loop``) from a backend's worker thread: an exception
    ``value`` is raised to the waiter, anything else is its result. A future already done (a
    cancelled waiter) or a closed loop is left alone."""

    def set_value() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    if not loop.is_closed():
        loop.call_soon_threadsafe(set_value)
