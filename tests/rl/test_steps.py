"""Step-level credit (`jax_agent_rl.rl.steps`) on hand-built groups, every expected number
worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from jax_agent_rl.rl import steps
from jax_agent_rl.rl.batch import per_turn_samples
from jax_agent_rl.rl.sequence import TrainSequence

TOL = dict(rtol=1e-6, atol=1e-6)


def episode(
    uid: str, group: str, prompt: list[int], turns: list[tuple[list[int], list[int]]]
) -> list[TrainSequence]:
    """The per-turn rows of an episode: ``turns`` of (the model's tokens, the observation
    after them), as the agent loop lays them out (model tokens mask 1, observations 0)."""
    response: list[int] = []
    mask: list[int] = []
    for own, observation in turns:
        response += own + observation
        mask += [1] * len(own) + [0] * len(observation)
    seq = TrainSequence(
        uid=uid,
        group_id=group,
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(response),
        token_versions=[0 if m else -1 for m in mask],
        kv_versions=[0 if m else -1 for m in mask],
    )
    return per_turn_samples(seq)


def test_relative_to_group_hand_case() -> None:
    # group a: 1, 3 -> mean 2, std (ddof 1) sqrt(2); group b alone -> 0
    got = steps.relative_to_group([1.0, 5.0, 3.0], ["a", "b", "a"])
    np.testing.assert_allclose(got, [-1 / (2**0.5 + 1e-6), 0.0, 1 / (2**0.5 + 1e-6)], **TOL)
    np.testing.assert_allclose(
        steps.relative_to_group([1.0, 5.0, 3.0], ["a", "b", "a"], False), [-1, 0, 1], **TOL
    )


def test_observations_are_what_each_turn_acted_on() -> None:
    rows = episode("e", "g", [1, 2], [([10], [20, 21]), ([11], [22]), ([12], [])])
    assert steps.observations(rows) == [(1, 2), (20, 21), (22,)]
    # a sample started from a context of its own (compacted: the task and a note [30]): its
    # first turn acted on that whole context, not on a slice of it
    again = episode("e@1", "g", [1, 2, 30], [([13], [23]), ([14], [])])
    assert steps.observations([*rows, *again]) == [(1, 2), (20, 21), (22,), (1, 2, 30), (23,)]


def test_discounted_returns() -> None:
    np.testing.assert_allclose(steps.discounted_returns(2.0, 3, 0.5), [0.5, 1.0, 2.0], **TOL)


# three episodes of group g from prompt [1, 2]: first turns all from the task; E1 and E2 then
# see the same tool result [20], E3 another [21]; E4 is another group's, with the same tokens
GIGPO_EPISODES = [
    episode("e1", "g", [1, 2], [([10], [20]), ([11], [])]),
    episode("e2", "g", [1, 2], [([12], [20]), ([13], [])]),
    episode("e3", "g", [1, 2], [([14], [21]), ([15], [])]),
    episode("e4", "h", [1, 2], [([10], [20]), ([11], [])]),
]
GIGPO_REWARDS = [1.0, 0.0, 1.0, 1.0]


def test_gigpo_step_advantages_hand_case() -> None:
    """gamma 0.5: returns E1 [0.5, 1], E2 [0, 0], E3 [0.5, 1], E4 [0.5, 1].
    Anchor (g, [1 2]) holds the first turns of E1-E3: returns 0.5, 0, 0.5, mean 1/3 ->
    1/6, -1/3, 1/6. Anchor (g, [20]): E1 and E2's second turns, 1 and 0, mean 1/2 -> +-1/2.
    Anchor (g, [21]): E3's alone -> 0. E4 is alone in group h on both anchors -> 0, 0."""
    got = steps.gigpo_step_advantages(GIGPO_EPISODES, GIGPO_REWARDS, 0.5, norm_by_std=False)
    np.testing.assert_allclose(got, [1 / 6, 0.5, -1 / 3, -0.5, 1 / 6, 0.0, 0.0, 0.0], **TOL)


def test_gigpo_step_advantages_divide_by_the_anchor_groups_std() -> None:
    """The same with the std: anchor (g, [1 2]) std = sqrt((1/36 + 1/9 + 1/36) / 2) =
    sqrt(1/12); anchor (g, [20]) std = sqrt(1/2)."""
    s1, s2 = (1 / 12) ** 0.5 + 1e-6, 0.5**0.5 + 1e-6
    got = steps.gigpo_step_advantages(GIGPO_EPISODES, GIGPO_REWARDS, 0.5)
    want = [1 / 6 / s1, 0.5 / s2, -1 / 3 / s1, -0.5 / s2, 1 / 6 / s1, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(got, want, **TOL)


# a group's tree from prompt [1]: root turn A [5] shared by leaves L1-L3, which after the tool
# result [9] branch into B [6] (L1, L2) and C [7] (L3); B branches after [9] into D [8] (L1)
# and E [3] (L2). Another root F [4] goes on to G [2] (leaf L4). Outcomes L1 1, L2 0, L3 1, L4 0
TREE_LEAVES = [
    episode("L1", "g", [1], [([5], [9]), ([6], [9]), ([8], [])]),
    episode("L2", "g", [1], [([5], [9]), ([6], [9]), ([3], [])]),
    episode("L3", "g", [1], [([5], [9]), ([7], [])]),
    episode("L4", "g", [1], [([4], [9]), ([2], [])]),
]
TREE_REWARDS = [1.0, 0.0, 1.0, 0.0]


def tree_rows() -> tuple[list[TrainSequence], list[float]]:
    rows = [row for leaf in TREE_LEAVES for row in leaf]
    rewards = [r for leaf, r in zip(TREE_LEAVES, TREE_REWARDS, strict=True) for _ in leaf]
    return rows, rewards


def test_tree_branch_advantages_hand_case() -> None:
    """V(A) = mean(1, 0, 1) = 2/3, V(F) = 0: siblings under the task, mean 1/3 -> A +1/3,
    F -1/3. V(B) = mean(1, 0) = 1/2, V(C) = 1: mean 3/4 -> B -1/4, C +1/4. V(D) = 1,
    V(E) = 0 -> +-1/2. G has no sibling -> 0. Each row gets its node's."""
    rows, rewards = tree_rows()
    got = steps.tree_branch_advantages(rows, rewards, norm_by_std=False)
    third = 1 / 3
    want = [third, -0.25, 0.5, third, -0.25, -0.5, third, 0.25, -third, 0.0]
    np.testing.assert_allclose(got, want, **TOL)


def test_tree_branch_advantages_divide_by_the_siblings_std() -> None:
    """A, F: values 2/3 and 0, std sqrt(2) / 3; B, C: 1/2 and 1, std sqrt(2) / 4; D, E: 1 and
    0, std sqrt(2) / 2 (each node counted once, however many leaves share it)."""
    rows, rewards = tree_rows()
    got = steps.tree_branch_advantages(rows, rewards)
    a, b, d = (1 / 3) / (2**0.5 / 3 + 1e-6), 0.25 / (2**0.5 / 4 + 1e-6), 0.5 / (2**0.5 / 2 + 1e-6)
    want = [a, -b, d, a, -b, -d, a, b, -a, 0.0]
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("fn", ["gigpo", "tree"])
def test_equal_outcomes_give_no_step_advantage(fn: str) -> None:
    rows, _ = tree_rows()
    if fn == "gigpo":
        got = steps.gigpo_step_advantages(TREE_LEAVES, [1.0] * 4, 1.0)
    else:
        got = steps.tree_branch_advantages(rows, [1.0] * len(rows))
    np.testing.assert_allclose(got, 0.0, **TOL)


@pytest.mark.parametrize("estimator", ["gigpo", "tree_grpo"])
def test_the_learner_adds_omega_times_the_step_advantage(estimator: str) -> None:
    """`update.prepare` gives each per-turn row's tokens its episode's GRPO advantage plus
    ``step_adv_coef`` times its step advantage, carried from the host in the outcomes."""
    import jax
    import jax.numpy as jnp

    from jax_agent_rl.config import AlgorithmSection
    from jax_agent_rl.models import init_params
    from jax_agent_rl.models.sharding import one_device_sharder
    from jax_agent_rl.rl import core
    from jax_agent_rl.rl.batch import step_batch
    from jax_agent_rl.rl.update import RLBatch, prepare
    from tests.rl.test_learner import CFG, _learner

    algo = AlgorithmSection(
        adv_estimator=estimator,  # type: ignore[arg-type]
        turn_mode="per_turn",
        step_adv_coef=0.5,
        tis_cap=None,
    )
    rows, rewards = tree_rows()
    weights = [1 / len(leaf) for leaf in TREE_LEAVES for _ in leaf]
    if estimator == "gigpo":
        step = steps.gigpo_step_advantages(TREE_LEAVES, TREE_REWARDS, algo.gigpo_gamma)
    else:
        step = steps.tree_branch_advantages(rows, rewards)
    assert (step != 0).any()
    batch, seqs, real = step_batch(
        rows,
        rewards,
        [r.group_id for r in rows],
        weights,
        mini_batches=1,
        row_tokens=None,
        bucket=8,
        rows_per_micro=2,
        step_advantages=step,
    )
    params = init_params(jax.random.key(0), CFG, sharder=one_device_sharder())
    learner, state = _learner(algo, params)
    rb = RLBatch(
        learner.device_batch(batch, local=True),
        *(jnp.asarray(x) for x in (seqs.rewards, seqs.groups, seqs.weights, seqs.minis)),
        jnp.int32(real),
        jnp.asarray(seqs.step_advantages),
    )
    dv, _ = prepare(learner.spec, state, rb)
    S = len(seqs.rewards)
    episode = core.grpo_advantages(seqs.rewards, seqs.groups, S, weights_n=seqs.weights)
    want = np.asarray(episode)[: len(rows)] + 0.5 * step
    seq, mask = np.asarray(batch.sequence), np.asarray(batch.mask) > 0
    got = np.asarray(dv.advantages).reshape(seq.shape)
    for n in range(len(rows)):
        np.testing.assert_allclose(got[(seq == n) & mask], want[n], **TOL)
