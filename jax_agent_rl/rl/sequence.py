"""What the learner reads of an episode: one `TrainSequence`, its tokens and what came with
each, and nothing of how the episode was played (turns, messages, tool calls, errors: the
agent's `jax_agent_rl.agent.trajectory.Trajectory` keeps those and produces this record).

It sits below the agent: the learner's rows (`rl.batch`) are built from these records alone,
so nothing in `rl/` needs the agent loop, its tools or its tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TrainSequence:
    """One sequence ``prompt_ids + response_ids`` as it was sampled.

    ``loss_mask`` is 1 on sampled response tokens and 0 elsewhere (tool and template tokens);
    ``rollout_logprobs`` the sampler's logprob of each (0 where the mask is 0);
    ``token_versions`` the weight version that sampled each (-1 where none did) and
    ``kv_versions`` the oldest weight version that computed a key or value it was sampled
    over (-1 where ``token_versions`` is); ``expert_ids`` (a mixture-of-experts policy's,
    routing replay) [len(response_ids), sparse layers, k] ints, `models.moe.NO_EXPERTS` where
    no token was sampled, or None. ``reward``: the episode's; ``group_id``: the GRPO group
    (its prompt). Per-token lists are aligned with ``response_ids``. The record is not edited:
    a per-turn row (`rl.batch.per_turn_samples`) is a new one."""

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    token_versions: list[int]
    kv_versions: list[int]
    expert_ids: np.ndarray | None = None
    reward: float = 0.0

    @property
    def oldest_version(self) -> int | None:
        """`oldest_version` of its tokens."""
        return oldest_version(self.token_versions, self.kv_versions)


def oldest_version(token_versions: Sequence[int], kv_versions: Sequence[int]) -> int | None:
    """The oldest weight version that sampled one of the tokens or computed a key or value one
    was sampled over (None: none sampled; -1 marks a token no version sampled)."""
    return min((v for v in (*token_versions, *kv_versions) if v >= 0), default=None)
