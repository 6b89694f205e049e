"""Step-level credit for agents, on the host: advantages of a group's turns relative to other
turns taken from the same state (GiGPO) or under the same parent of a rollout tree (Tree-GRPO).

Both work on per-turn rows (``algorithm.turn_mode=per_turn``, `rl.batch.per_turn_samples`:
one row per model turn, its prompt the token-exact prefix before the turn) and give each row a
step advantage ``S``; the learner trains each row on its episode's GRPO advantage plus
``algorithm.step_adv_coef * S`` (`rl.update.prepare`). They need the rows' tokens (exact
matches of prefixes and observations), so they run here, once per step, before the batch
crosses to the device.

A state is identified by exact token match, never by similarity: two turns share a GiGPO
anchor state when the observation tokens each acted on (`observations`) are the same token
for token and they belong to the same group (prompt); two turns are the same tree node when
their whole prefix and their own tokens are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jax_agent_rl.rl.sequence import TrainSequence


def relative_to_group(
    values_n: Sequence[float] | np.ndarray,
    keys_n: Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Each value relative to its group's (the entries of equal key): ``(v_i - mean_g) /
    (std_g + eps)``, or ``v_i - mean_g`` without ``norm_by_std``; ``std_g`` unbiased (ddof=1).
    A group of one gets 0 (no other entry to compare with), float32 [N].

    As verl-agent's GiGPO ``step_norm_reward``: there a group of one has ``mean`` its own
    value and ``std`` 1, so 0 too.
    """
    values = np.asarray(values_n, np.float64)
    index: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys_n):
        index.setdefault(key, []).append(i)
    out = np.zeros(len(values), np.float64)
    for members in index.values():
        if len(members) < 2:
            continue
        v = values[members]
        centred = v - v.mean()
        out[members] = centred / (v.std(ddof=1) + eps) if norm_by_std else centred
    return out.astype(np.float32)


def observations(turns: Sequence[TrainSequence]) -> list[tuple[int, ...]]:
    """The observation each of an episode's per-turn rows (in order) acted on: the tokens of
    its prompt after the previous turn's own tokens (tool results, user and template tokens),
    and for the first turn, or one whose prompt does not extend the previous turn's sequence
    (the first of a new sample: a compacted or sub-agent context), its whole prompt."""
    before: list[int] = []
    out = []
    for turn in turns:
        extends = turn.prompt_ids[: len(before)] == before
        out.append(tuple(turn.prompt_ids[len(before) :] if extends else turn.prompt_ids))
        before = [*turn.prompt_ids, *turn.response_ids]
    return out


def discounted_returns(reward: float, turns: int, gamma: float) -> np.ndarray:
    """The return from each of ``turns`` turns of an episode whose outcome ``reward`` comes at
    its end: ``R_k = gamma^(turns - 1 - k) * reward`` (GiGPO eq. 5 with the reward on the last
    step, verl-agent ``compute_step_discounted_returns``), float32 [turns]."""
    return (gamma ** np.arange(turns - 1, -1, -1) * reward).astype(np.float32)


def gigpo_step_advantages(
    episodes: Sequence[Sequence[TrainSequence]],
    rewards: Sequence[float] | np.ndarray,
    gamma: float = 0.95,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """GiGPO's step-level advantage (Feng et al. 2025, "Group-in-Group Policy Optimization for
    LLM Agent Training", arXiv 2505.10978) of every per-turn row, float32 [sum of turns], in
    the order of ``episodes`` (each a list of its per-turn rows, all of one group per
    ``group_id``) and their turns.

    An anchor state is ``(group_id, observation tokens)`` (`observations`); the rows that
    acted on the same anchor state form a step group, and a row's step advantage is its
    discounted return (`discounted_returns`, ``gamma``) relative to its step group's
    (`relative_to_group`: a state visited once gets 0). The learner adds it, times
    ``omega`` (``algorithm.step_adv_coef``), to the episode's GRPO advantage.

    Deviation: verl-agent's default episode-level statistics count every step of every
    episode (``compute_mean_std_cross_steps``); the learner's count every episode once
    (`core.grpo_advantages` with ``1 / turns`` weights).
    """
    keys: list[Hashable] = []
    returns: list[np.ndarray] = []
    for turns, reward in zip(episodes, rewards, strict=True):
        keys += [(t.group_id, obs) for t, obs in zip(turns, observations(turns), strict=True)]
        returns.append(discounted_returns(float(reward), len(turns), gamma))
    flat = np.concatenate(returns) if returns else np.zeros(0, np.float32)
    return relative_to_group(flat, keys, norm_by_std, eps)


def tree_branch_advantages(
    rows: Sequence[TrainSequence],
    rewards: Sequence[float] | np.ndarray,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Tree-GRPO's step-level advantage (Ji et al. 2025, "Tree Search for LLM Agent
    Reinforcement Learning", arXiv 2509.21240) of every per-turn row of a group's leaves,
    float32 [N]; ``rewards`` the outcome of each row's leaf.

    A node is a turn with its whole prefix, ``(group_id, prompt_ids + response_ids)``: the
    leaves that share a turn (the prefix a branch copied) hold one row each of the same
    node. A node's value ``V`` is the mean outcome of the leaves under it (the rows of the
    node); its parent is the node whose prefix ends where its turn starts, ``(group_id,
    prompt_ids)``, and its branch advantage is ``V`` relative to its siblings' (the distinct
    nodes under that parent, each counted once; `relative_to_group`). A node with no sibling
    (no branching there) gets 0; each row gets its node's. The first turns of a group are
    siblings under the task: for chains (no tree) the advantage of distinct first turns.
    The learner adds it, times ``algorithm.step_adv_coef``, to the leaf's GRPO advantage (the
    paper's inter-tree term, leaves relative to all the prompt's leaves).
    """
    node_of = [(t.group_id, (*t.prompt_ids, *t.response_ids)) for t in rows]
    parent_of = [(t.group_id, tuple(t.prompt_ids)) for t in rows]
    values: dict[Hashable, list[float]] = {}
    parents: dict[Hashable, Hashable] = {}
    for node, parent, reward in zip(node_of, parent_of, rewards, strict=True):
        values.setdefault(node, []).append(float(reward))
        parents[node] = parent
    nodes = list(values)
    node_adv = relative_to_group(
        [float(np.mean(values[n])) for n in nodes], [parents[n] for n in nodes], norm_by_std, eps
    )
    by_node = dict(zip(nodes, node_adv, strict=True))
    return np.asarray([by_node[n] for n in node_of], np.float32)
