"""What the embedded backend's engine thread works on (`jax_agent_rl.rollout.embedded`): a
generate request with what it has sampled and the pages it holds (`Job`), and a weight
update (`Update`)."""

from __future__ import annotations

import asyncio
import dataclasses

from jax_agent_rl.models import Weights
from jax_agent_rl.rollout.protocol import GenerateRequest, GenerateResult


@dataclasses.dataclass
class Job:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pos: int = 0  # positions its pages hold (host mirror of the state's pos)
    version: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)  # its page table
    slot: int = -1  # where it decodes (its pages are on that slot's shard)
    done: int = 0  # tokens of its sequence prefilled so far
    admitted: int = -1  # admission order (kept through a preemption)


@dataclasses.dataclass
class Update:
    params: Weights
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
