"""What the embedded backend's engine thread works on (`jax_agent_rl.rollout.embedded`): a
generate request with what it has sampled and the pages it holds (`Job`), and a weight
update (`Update`)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from jax_agent_rl.models import Weights
from jax_agent_rl.models.lora import LayerAdapters
from jax_agent_rl.protocol import FinishReason, GenerateRequest, GenerateResult
from jax_agent_rl.rollout.delta import WeightDelta
from jax_agent_rl.rollout.stops import Decode, stop_string_end


@dataclasses.dataclass
class Job:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # a MoE model's: the experts [sparse layers, k] of each sampled token (routing replay)
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    # per sampled token: the weight version that sampled it, and the oldest that computed a
    # key or value it was sampled over (`GenerateResult.kv_versions`)
    versions: list[int] = dataclasses.field(default_factory=list)
    kv_versions: list[int] = dataclasses.field(default_factory=list)
    kv_version: int = 0  # the oldest version of the keys and values its pages hold now
    pos: int = 0  # positions its pages hold (host mirror of the state's pos)
    pages: list[int] = dataclasses.field(default_factory=list)  # its page table
    slot: int = -1  # where it decodes (its pages are on that slot's shard)
    done: int = 0  # tokens of its sequence prefilled so far
    admitted: int = -1  # admission order (kept through a preemption)

    def add(self, token: int, logprob: float, experts: np.ndarray | None, version: int) -> None:
        """A sampled token, its logprob and (a MoE model's) experts, sampled under weight
        ``version`` over the keys and values its pages hold now (``kv_version``)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.kv_versions.append(self.kv_version)
        if experts is not None:
            self.experts.append(experts)

    def cut_at_stop_string(self, decode: Decode | None, new: int) -> bool:
        """Whether the last ``new`` sampled tokens complete one of the request's stop strings
        (read with ``decode``; without it, never); the job then keeps the tokens up to the one
        that does, and those sampled after it in the same decode call are dropped
        (`stop_string_end`)."""
        stops = self.request.sampling.stop
        if decode is None or not stops:
            return False
        end = stop_string_end(decode, self.tokens, stops, new)
        if end is None:
            return False
        self.pos -= len(self.tokens) - end
        del self.tokens[end:], self.logprobs[end:], self.experts[end:]
        del self.versions[end:], self.kv_versions[end:]
        return True

    def result(self, reason: FinishReason, version: int) -> GenerateResult:
        """What it sampled (the logprobs if asked for) and under which weights: its first
        token's version (``version`` if it sampled none) and each token's."""
        return GenerateResult(
            token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs) if self.request.sampling.logprobs else None,
            finish_reason=reason,
            weight_version=self.versions[0] if self.versions else version,
            expert_ids=np.stack(self.experts) if self.experts else None,
            token_versions=tuple(self.versions),
            kv_versions=tuple(self.kv_versions),
        )


@dataclasses.dataclass
class Stage:
    """Whole new weights to place on the engine's devices while it decodes (a staged push):
    ``future`` resolves once they are placed; ``placed`` holds them until the swap."""

    params: Weights
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    placed: Weights | None = None
    seconds: float = 0.0  # from the placing's start to its arrays being ready


@dataclasses.dataclass
class Update:
    # a LoRA policy's push: its adapters only; a delta push: what changed (`WeightDelta`)
    params: Weights | LayerAdapters | WeightDelta
    version: int  # what they are served as
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
