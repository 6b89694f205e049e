"""Trajectories as learner rows: per-turn samples are the trajectory restricted per turn."""

import numpy as np
import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import AlgorithmSection
from jax_agent_rl.rl.batch import make_batch, per_turn_samples, sequence_arrays, turn_spans
from jax_agent_rl.rl.tree import units
from jax_agent_rl.train.learn import training_rows


def _episode() -> Trajectory:
    """Prompt [1, 2]; turn 0 samples [10, 11] (version 3), a tool result [20, 21, 22],
    turn 1 samples [12] (version 4), template [23], turn 2 samples [13, 14] (version 4)."""
    t = Trajectory(uid="e", group_id="g", prompt_ids=[1, 2])
    t.append([10, 11], model=True, logprobs=[-0.1, -0.2], version=3)
    t.append([20, 21, 22], model=False)
    t.append([12], model=True, logprobs=[-0.3], version=4)
    t.append([23], model=False)
    t.append([13, 14], model=True, logprobs=[-0.4, -0.5], version=4)
    return t


def test_turn_spans_are_the_runs_of_sampled_tokens() -> None:
    assert turn_spans([1, 1, 0, 0, 0, 1, 0, 1, 1]) == [(0, 2), (5, 6), (7, 9)]
    assert turn_spans([0, 0]) == [] and turn_spans([]) == []


def test_per_turn_samples_are_the_trajectory_restricted_per_turn() -> None:
    traj = _episode()
    samples = per_turn_samples(traj.train_sequence(0.5))
    full = traj.prompt_ids + traj.response_ids
    assert [s.uid for s in samples] == ["e#0", "e#1", "e#2"]
    for s, (a, b) in zip(samples, turn_spans(traj.loss_mask), strict=True):
        # the token-exact prefix up to the turn, then the turn alone
        assert s.prompt_ids + s.response_ids == full[: len(traj.prompt_ids) + b]
        assert s.response_ids == traj.response_ids[a:b]
        assert s.loss_mask == [1] * (b - a)
        assert s.rollout_logprobs == traj.rollout_logprobs[a:b]
        assert s.token_versions == traj.token_versions[a:b]
        assert (s.group_id, s.reward) == ("g", 0.5)
    # the sampled tokens of all samples are the trajectory's, each exactly once
    assert [t for s in samples for t in s.response_ids] == [
        t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m
    ]
    # as learner rows: each sample scores its turn's targets with the trajectory's logprobs
    whole = make_batch([traj.train_sequence(0.5)], bucket=8)
    rows = make_batch(samples, bucket=8, longest=len(full))
    assert rows.mask.sum() == whole.mask.sum() == 5
    for r, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert (rows.tokens[r, :n] == whole.tokens[0, :n]).all()
        on = rows.mask[r] > 0
        assert (whole.mask[0][on] > 0).all()
        assert (rows.rollout_logp[r][on] == whole.rollout_logp[0][on]).all()


def test_an_episode_without_model_tokens_stays_one_sample() -> None:
    traj = Trajectory(uid="e", group_id="g", prompt_ids=[1, 2])
    assert per_turn_samples(traj.train_sequence(0.0)) == [traj.train_sequence(0.0)]


def _compacted_episode() -> Trajectory:
    """A shared prompt of 40 tokens; sample 0 samples [50, 51], reads [60], samples [52];
    sample 1 starts from the prompt and a summary [70, 71] (the compacted context) and samples
    [53]; sample 2 (a sub-agent's own context [90, 91]) samples [54, 55]; then sample 0 goes on:
    it reads [61] and samples [56]."""
    prompt = list(range(100, 140))
    t = Trajectory(uid="e", group_id="g", prompt_ids=prompt)
    t.add_sample([50, 51], [-0.1, -0.2], version=1)
    t.add_observation([60])
    t.add_sample([52], [-0.3], version=1)
    t.start_sample([*prompt, 70, 71])
    t.add_sample([53], [-0.4], version=2)
    t.start_sample([90, 91])
    t.add_sample([54, 55], [-0.5, -0.6], version=2)
    t.resume_sample(0)
    t.add_observation([61])
    t.add_sample([56], [-0.7], version=3)
    return t


def test_samples_that_do_not_extend_each_other_are_rows_of_their_own() -> None:
    """Each sample is its own row, token for token as it was sampled, sharing the episode's
    reward; one that only appended is the one row it always was."""
    t = _compacted_episode()
    prompt = list(range(100, 140))
    rows = t.train_sequences(0.5)
    assert [r.uid for r in rows] == ["e", "e@1", "e@2"] and t.num_samples == 3
    assert rows[0].prompt_ids == prompt
    assert rows[0].response_ids == [50, 51, 60, 52, 61, 56]
    assert rows[0].loss_mask == [1, 1, 0, 1, 0, 1]
    assert rows[0].rollout_logprobs == [-0.1, -0.2, 0.0, -0.3, 0.0, -0.7]
    assert rows[0].token_versions == [1, 1, -1, 1, -1, 3]
    assert (rows[1].prompt_ids, rows[1].response_ids) == ([*prompt, 70, 71], [53])
    assert (rows[2].prompt_ids, rows[2].response_ids, rows[2].loss_mask) == (
        [90, 91],
        [54, 55],
        [1, 1],
    )
    assert {r.reward for r in rows} == {0.5} and {r.group_id for r in rows} == {"g"}
    assert t.num_model_tokens == 7 and t.oldest_version == 1
    # per-turn rows of each sample, each named by its sample
    assert [s.uid for r in rows for s in per_turn_samples(r)] == [
        "e#0",
        "e#1",
        "e#2",
        "e@1#0",
        "e@2#0",
    ]
    appended = _episode()
    assert appended.train_sequences(0.5) == [appended.train_sequence(0.5)]
    assert appended.train_sequence(0.5).uid == "e" and appended.num_samples == 1


def test_a_sample_started_but_never_sampled_is_not_trained() -> None:
    t = _episode()
    t.start_sample([1, 2, 3])
    assert [r.uid for r in t.train_sequences(1.0)] == ["e"]
    with pytest.raises(ValueError, match="has no sample 5"):
        t.resume_sample(5)


def test_training_rows_give_each_sample_its_share_of_the_episode() -> None:
    """Every row of an episode carries its reward and 1 / its rows (GRPO counts the episode
    once), and the tree packing computes the prompt the samples share once."""
    episodes = [Episode(_compacted_episode()), Episode(_episode())]
    for mode, n in (("trajectory", 3), ("per_turn", 5)):
        algo = AlgorithmSection(turn_mode=mode)
        rows, rewards, groups, weights, _ = training_rows(
            episodes, np.array([0.5, -1.0], np.float32), algo
        )
        k = n + (1 if mode == "trajectory" else 3)
        assert len(rows) == k and groups == ["g"] * k
        assert rewards.tolist() == [0.5] * n + [-1.0] * (k - n)
        assert np.allclose(weights, [1 / n] * n + [1 / (k - n)] * (k - n))
    rows = _compacted_episode().train_sequences(0.0)
    seqs, experts = sequence_arrays(rows)
    runs, sizes = units(seqs, experts, [0, 1], row_tokens=256)
    # one run: the 40 prompt tokens (and nothing else) computed once for both samples
    assert runs == [[0, 1]] and sizes == [len(seqs[0]) + len(seqs[1]) - 40 + 1]
