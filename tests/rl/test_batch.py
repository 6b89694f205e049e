"""Trajectories as learner rows: per-turn samples are the trajectory restricted per turn."""

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.rl.batch import make_batch, per_turn_samples, turn_spans


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
