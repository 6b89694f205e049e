"""Trajectories -> padded arrays: the only place token lists become a learner batch.

A row is ``prompt_ids + response_ids``, right-padded. Everything per token is stored at the
position that *predicts* it: ``targets[t] = tokens[t + 1]``, and ``mask[t]`` is 1 when that
target is a model-sampled token (the trajectory's loss mask), so the logits at ``t`` score
``targets[t]`` with no further shifting anywhere. Nothing is re-tokenized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_agent_rl.agent.trajectory import Trajectory

Array = Any  # np.ndarray on the host, jax.Array on the devices


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """Padded [B, T] arrays; per-token fields are aligned with ``targets`` (see module doc)."""

    tokens: Array  # int32, the model's input
    positions: Array  # int32
    segment_ids: Array  # int32, 1 on real tokens, 0 on padding
    targets: Array  # int32, tokens shifted left by one
    mask: Array  # float32, 1 where the target is a sampled token
    rollout_logp: Array  # float32, the sampler's logprob of each target
    advantages: Array  # float32
    old_logp: Array  # float32, learner logprobs before this update
    ref_logp: Array  # float32, reference-model logprobs (KL term)
    old_values: Array  # float32, critic values before the update (PPO)
    returns: Array  # float32, value targets (PPO)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def rows(self, index: np.ndarray | slice) -> TrainBatch:
        """A subset of rows (host arrays)."""
        return jax.tree.map(lambda x: np.asarray(x)[index], self)


def turn_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each model turn: each maximal run of sampled tokens (mask 1). The
    loop samples a turn in one run (a continued inline block included) and follows it with
    template or tool tokens (mask 0), so runs and turns are the same."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(loss_mask):
        if m and spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        elif m:
            spans.append((i, i + 1))
    return spans


def per_turn_samples(traj: Trajectory) -> list[Trajectory]:
    """``traj`` as one training sample per model turn (``algorithm.turn_mode=per_turn``):
    sample ``k``'s prompt is the token-exact prefix up to turn ``k`` (``prompt_ids`` and the
    response before it), its response that turn's tokens only, with their logprobs and
    versions; uid ``<uid>#<k>``, group and reward the episode's. An episode without a model
    token stays one sample."""
    samples = []
    for k, (a, b) in enumerate(turn_spans(traj.loss_mask)):
        samples.append(
            dataclasses.replace(
                traj,
                uid=f"{traj.uid}#{k}",
                prompt_ids=[*traj.prompt_ids, *traj.response_ids[:a]],
                response_ids=traj.response_ids[a:b],
                loss_mask=traj.loss_mask[a:b],
                rollout_logprobs=traj.rollout_logprobs[a:b],
                token_versions=traj.token_versions[a:b],
            )
        )
    return samples or [traj]


def padded_length(n: int, bucket: int) -> int:
    """The smallest ``bucket * 2**k`` holding ``n`` tokens: a run whose sequences reach
    ``max_len`` meets at most ``log2(max_len / bucket) + 1`` lengths, so its training step
    compiles that many times at most (each compile costs far more than the <= 2x padding)."""
    blocks = max(1, -(-n // bucket))
    return bucket * (1 << (blocks - 1).bit_length())


def longest_sequence(trajectories: Sequence[Trajectory]) -> int:
    return max((len(t.prompt_ids) + len(t.response_ids) for t in trajectories), default=1)


def make_batch(
    trajectories: Sequence[Trajectory],
    bucket: int,
    rows: int | None = None,
    longest: int | None = None,
) -> TrainBatch:
    """Packs trajectories into a `TrainBatch` of ``rows`` rows (default: one per trajectory;
    extra rows are all padding with mask 0, so a batch can be filled to a divisible size),
    padded for ``longest`` tokens (default: the longest trajectory's; processes whose rows
    form one batch pass the longest of all)."""
    B = rows if rows is not None else len(trajectories)
    if len(trajectories) > B:
        raise ValueError(f"{len(trajectories)} trajectories do not fit {B} rows")
    own = longest_sequence(trajectories)
    if longest is not None and longest < own:
        raise ValueError(f"longest={longest} is shorter than a trajectory of {own} tokens")
    T = padded_length(longest or own, bucket)
    tokens = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    rollout_logp = np.zeros((B, T), np.float32)
    for b, traj in enumerate(trajectories):
        seq = [*traj.prompt_ids, *traj.response_ids]
        P, n = len(traj.prompt_ids), len(seq)
        tokens[b, :n] = seq
        segment_ids[b, :n] = 1
        # response token i sits at sequence position P + i and is predicted from P + i - 1
        mask[b, P - 1 : n - 1] = traj.loss_mask
        rollout_logp[b, P - 1 : n - 1] = traj.rollout_logprobs
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    zeros = np.zeros((B, T), np.float32)
    return TrainBatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        segment_ids=segment_ids,
        targets=targets,
        mask=mask,
        rollout_logp=rollout_logp,
        advantages=zeros.copy(),
        old_logp=zeros.copy(),
        ref_logp=zeros.copy(),
        old_values=zeros.copy(),
        returns=zeros.copy(),
    )
