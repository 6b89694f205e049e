"""Tree packing (`rl.tree`): sequences sharing a prefix computed once, and the step exactly
the step of the same sequences packed one after another."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import AlgorithmSection, OptimSection
from jax_agent_rl.models import Sharder, init_params, make_mesh
from jax_agent_rl.models.moe import NO_EXPERTS
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl.batch import Sequences, TrainBatch, per_turn_samples, step_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.objectives import SamplingSpec
from jax_agent_rl.rl.sequence import TrainSequence
from jax_agent_rl.rl.tree import shared, slots
from tests.rl.test_learner import (
    ALGO,
    CFG,
    MOE_CFG,
    _learner,
    assert_close_normwise,
    first_update,
)

PROMPT = 40  # tokens of a group's prompt: more than `tree.MIN_SHARED`


def _chunks(traj: Trajectory, rng: np.random.Generator, n: int, model_first: bool) -> None:
    """``n`` chunks of 4 tokens appended to ``traj``, model and tool tokens in turn."""
    for i in range(n):
        model = (i % 2 == 0) == model_first
        logp = list(rng.normal(-2, 0.5, 4)) if model else None
        traj.append(list(rng.integers(0, 256, 4)), model=model, logprobs=logp)


def groups(num: int = 3, n: int = 4, seed: int = 0) -> list[Trajectory]:
    """``num`` GRPO groups of ``n`` episodes after one prompt each: turns of model tokens
    and tool output in turn, 1 to 5 chunks of 4 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num):
        prompt = list(rng.integers(0, 256, PROMPT))
        for i in range(n):
            traj = Trajectory(uid=f"{g}.{i}", group_id=str(g), prompt_ids=prompt)
            _chunks(traj, rng, int(rng.integers(1, 6)), model_first=True)
            out.append(traj)
    return out


def tree_rollouts(num: int = 3, n: int = 4, seed: int = 0) -> list[Trajectory]:
    """Groups whose episodes branch off one sampled trunk (model tokens, a tool call's
    output, model tokens: the same tokens and logprobs in each), then in pairs off a second
    shared turn, then each its own: shared positions whose targets are sampled tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num):
        prompt = list(rng.integers(0, 256, PROMPT))
        trunk = Trajectory(uid="", group_id=str(g), prompt_ids=prompt)
        _chunks(trunk, rng, 3, model_first=True)
        pairs = []
        for _ in range(n // 2):
            pair = dataclasses.replace(trunk, response_ids=[*trunk.response_ids])
            pair.loss_mask, pair.rollout_logprobs = [*trunk.loss_mask], [*trunk.rollout_logprobs]
            pair.token_versions = [*trunk.token_versions]
            _chunks(pair, rng, 2, model_first=False)
            pairs.append(pair)
        for i in range(n):
            pair = pairs[i // 2]
            traj = dataclasses.replace(pair, uid=f"{g}.{i}", response_ids=[*pair.response_ids])
            traj.loss_mask, traj.rollout_logprobs = [*pair.loss_mask], [*pair.rollout_logprobs]
            traj.token_versions = [*pair.token_versions]
            _chunks(traj, rng, int(rng.integers(1, 4)), model_first=False)
            out.append(traj)
    return out


REWARDS = np.array([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0, 0.3, 0.9, 0.1, 0.6], np.float32)


def workload(name: str) -> tuple[list[TrainSequence], np.ndarray, np.ndarray]:
    """Trajectories, rewards and weights: GRPO groups, their per-turn samples (sample k a
    prefix of sample k + 1; weights 1 / turns), or tree rollouts."""
    played = tree_rollouts() if name == "tree_rollouts" else groups()
    trajs = [t.train_sequence(0.0) for t in played]
    if name != "per_turn":
        return trajs, REWARDS, np.ones(len(trajs), np.float32)
    samples = [per_turn_samples(t) for t in trajs]
    rewards = np.repeat(REWARDS, [len(x) for x in samples])
    weights = np.concatenate([np.full(len(x), 1 / len(x)) for x in samples])
    return [t for x in samples for t in x], rewards, weights.astype(np.float32)


def _step(
    trajs: list[TrainSequence],
    rewards: np.ndarray,
    weights: np.ndarray,
    K: int,
    tree: bool,
    per_micro: int = 2,
) -> tuple[TrainBatch, Sequences, int]:
    return step_batch(
        trajs,
        rewards,
        [t.group_id for t in trajs],
        weights,
        mini_batches=K,
        row_tokens=128,
        bucket=8,
        rows_per_micro=per_micro,
        tree=tree,
    )


ALGOS = {
    "grpo_kl_tis_entropy_2x2": dataclasses.replace(ALGO, mini_batches=2, ppo_epochs=2),
    "agg_seq-mean-token-sum": dataclasses.replace(ALGO, loss_agg_mode="seq-mean-token-sum"),
    "dr_grpo": AlgorithmSection(
        norm_adv_by_std=False, loss_agg_mode="seq-mean-token-sum-norm", tis_cap=None
    ),
    "dapo": AlgorithmSection(clip_high=0.28, loss_agg_mode="token-mean", clip_c=None),
    "ppo_gae": AlgorithmSection(
        adv_estimator="gae", mini_batches=2, tis_cap=None, loss_agg_mode="seq-mean-token-mean"
    ),
}
# each algorithm and aggregation mode once at least; per-turn samples and tree rollouts (the
# workloads whose shared positions score sampled tokens) under GRPO's groups and GAE (each
# case compiles two update programs, ~30 s: the matrix covers, it does not multiply)
CASES = [
    ("dr_grpo", "groups"),
    ("grpo_kl_tis_entropy_2x2", "per_turn"),
    ("ppo_gae", "per_turn"),
    ("dapo", "tree_rollouts"),
    ("agg_seq-mean-token-sum", "tree_rollouts"),
    ("ppo_gae", "tree_rollouts"),
]


@pytest.mark.parametrize(("algo", "work"), CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_the_tree_packed_step_equals_the_packed_step(algo: str, work: str) -> None:
    """The same sequences tree-packed and packed one after another (rows of 128 positions,
    2 a micro-batch): the same first update's loss and gradients (policy, and critic with
    GAE) within fp32 reduction-order rounding (normwise 1e-5) and the same metrics after
    the step (1e-4 relative), for GRPO (KL, TIS, entropy, 2 mini-batches x 2 epochs),
    Dr.GRPO, DAPO and PPO with GAE, each aggregation mode, on GRPO groups, per-turn samples
    and tree rollouts (shared positions whose targets are sampled tokens, of sequences of
    different advantages). The tree rows compute under 70% of the positions."""
    a = ALGOS[algo]
    params = init_params(jax.random.key(5), CFG, sharder=one_device_sharder())
    reference = jax.tree.map(lambda x: x * 0.9, params) if a.kl_coef else None
    trajs, rewards, weights = workload(work)
    tree, plain = (_step(trajs, rewards, weights, a.mini_batches, on) for on in (True, False))
    rows = tree[0].tree
    assert rows is not None and plain[0].tree is None
    assert (rows.count > 0).sum() < 0.7 * (plain[0].segment_ids > 0).sum()
    learners = [_learner(a, params, reference=reference, lr=1e-6) for _ in range(2)]
    (loss_a, grads_a), (loss_b, grads_b) = (
        first_update(*x, *b) for x, b in zip(learners, (tree, plain), strict=True)
    )
    assert_close_normwise(loss_a, loss_b)
    assert_close_normwise(grads_a, grads_b)
    (_, got, _), (_, want, _) = (
        learner.rl_update(state, *b)
        for (learner, state), b in zip(learners, (tree, plain), strict=True)
    )
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def test_a_moe_policy_s_replayed_routing_and_router_loss_are_those_of_the_packed_step() -> None:
    """A MoE policy replaying its sampler's experts, with the router's load-balancing loss,
    on per-turn samples: a sample's turn carries experts, the next sample's prompt holds the
    same tokens without (the learner routes them itself), so they are not shared; the
    router loss counts each shared position once per sequence holding it. The same loss,
    gradients and metrics as the packed step, at the bounds above; the whole batch one
    micro-batch (the router loss is a function of a forward's token set, not a sum over
    sequences: micro-batches of other sequences give another value, in any layout)."""
    rng = np.random.default_rng(3)
    trajs = groups()
    for t in trajs:
        mask = np.asarray(t.loss_mask, bool)[:, None, None]
        drawn = rng.integers(0, MOE_CFG.num_experts, (len(t.response_ids), 2, 2))
        t.expert_ids = np.where(mask, drawn, NO_EXPERTS).astype(np.int8)
    samples = [per_turn_samples(t.train_sequence(0.0)) for t in trajs]
    rewards = np.repeat(REWARDS, [len(x) for x in samples])
    weights = np.concatenate([np.full(len(x), 1 / len(x)) for x in samples]).astype(np.float32)
    flat = [t for x in samples for t in x]
    tree, plain = (_step(flat, rewards, weights, 1, on, per_micro=16) for on in (True, False))
    assert tree[2] == plain[2] == 1
    assert tree[0].tree is not None and tree[0].tree.expert_ids is not None
    params = init_params(jax.random.key(6), MOE_CFG, sharder=one_device_sharder())
    algo = AlgorithmSection(routing_replay=True, router_aux_loss_coef=0.01)
    learner = Learner(
        MOE_CFG,
        algo=algo,
        optim=OptimSection(lr=1e-6),
        sampling=SamplingSpec(0.8),
        micro_batch_size=16,
        sharder=one_device_sharder(),
    )
    # each its own state: an update donates it
    states = [learner.init_state(jax.tree.map(jnp.copy, params)) for _ in range(2)]
    (loss_a, grads_a), (loss_b, grads_b) = (
        first_update(learner, s, *b) for s, b in zip(states, (tree, plain), strict=True)
    )
    assert_close_normwise(loss_a, loss_b)
    assert_close_normwise(grads_a, grads_b)
    (_, got, _), (_, want, _) = (
        learner.rl_update(s, *b) for s, b in zip(states, (tree, plain), strict=True)
    )
    assert got.keys() == want.keys() and "router_aux_loss" in want
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def test_the_sharded_tree_step_equals_the_unsharded() -> None:
    """8 fake CPU devices, data=2 x fsdp=2 x tensor=2, tree rows split over data x fsdp
    with their loss rows (each loss row's tree row on its device): the first update's loss
    and gradients equal one device's within 1e-5, normwise."""
    trajs, rewards, weights = workload("groups")
    batch = _step(trajs, rewards, weights, 1, True, per_micro=4)
    params = init_params(jax.random.key(5), CFG, sharder=one_device_sharder())
    algo = AlgorithmSection(entropy_coef=0.01, clip_high=0.28)
    sharded = _learner(algo, params, Sharder(make_mesh(2, 2, 2)), micro_batch_size=4, lr=1e-6)
    plain = _learner(algo, params, micro_batch_size=4, lr=1e-6)
    assert sharded[0].device_batch(batch[0], local=True).tree.tokens.sharding.spec[1] == (
        "data",
        "fsdp",
    )
    (loss_a, grads_a), (loss_b, grads_b) = (
        first_update(*sharded, *batch),
        first_update(*plain, *batch),
    )
    assert_close_normwise(loss_a, loss_b)
    assert_close_normwise(grads_a, grads_b)


def test_shared_positions_are_those_computing_the_same_and_scoring_the_same() -> None:
    """A position is shared when the tokens up to it and the next one (its target) agree;
    equal sequences share all, a prefix all but its last (which scores nothing), and
    differing experts cut the sharing before their position."""
    a = np.array([1, 2, 3, 4, 5])
    assert shared(a, np.array([1, 2, 3, 9, 9, 9]), None, None) == 2
    assert shared(a, a.copy(), None, None) == 5
    assert shared(a[:3], a, None, None) == 2
    assert shared(a, np.array([7, 2]), None, None) == 0
    e = np.zeros((5, 1, 2), np.int32)
    f = e.copy()
    f[1] = 3
    assert shared(a, a.copy(), e, f) == 1


def test_slots_lay_out_a_trie_depth_first_with_each_slot_s_reach() -> None:
    """Sequences [prompt + x], [prompt + y + z], [prompt + y + w] and an unrelated one: the
    prompt and y computed once; each branch re-computes the last shared token (its target
    differs); a slot's reach ends with the last sequence holding it."""
    p = [10, 11, 12]
    seqs = [
        np.array([*p, 1, 2]),
        np.array([*p, 3, 4, 5]),
        np.array([*p, 3, 4, 6]),
        np.array([9, 9]),
    ]
    order, where, reach = slots(seqs, [None] * 4, [2, 0, 3, 1])
    assert order == [3, 0, 1, 2]  # lexicographic
    assert where[3].tolist() == [0, 1]
    assert where[0].tolist() == [2, 3, 4, 5, 6]
    assert where[1].tolist() == [2, 3, 7, 8, 9, 10]  # shares 10, 11; recomputes 12 (target 3)
    assert where[2].tolist() == [2, 3, 7, 8, 11, 12]  # shares 10, 11, 12, 3; recomputes 4
    assert reach.tolist() == [2, 2, 13, 13, 7, 7, 7, 13, 13, 11, 11, 13, 13]


def test_tree_rows_gather_each_loss_position_from_its_slot() -> None:
    """Every real position of the loss rows maps to a slot of the same token, position and
    target; the tree rows' positions continue from the shared prefix."""
    trajs, rewards, weights = workload("per_turn")
    batch, _, _ = _step(trajs, rewards, weights, 1, True)
    rows = batch.tree
    assert rows is not None
    real = batch.segment_ids > 0
    for field in ("tokens", "positions", "targets"):
        got = np.take_along_axis(getattr(rows, field), rows.index, axis=1)
        np.testing.assert_array_equal(got[real], getattr(batch, field)[real])
    assert jnp.all(jnp.asarray(rows.count)[rows.reach > 0] >= 1)
