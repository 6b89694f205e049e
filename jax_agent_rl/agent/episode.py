"""A played `Trajectory` with what the trainer made of it (`Episode`): its reward, whether it
succeeded, why the reward failed, how often it was run again and the filter that left it out.
The trajectory stays the agent's record, never edited after its loop ends; the trainer
returns these alongside it (`jax_agent_rl.train.rollout_score.rollout_episodes`)."""

from __future__ import annotations

import dataclasses

from jax_agent_rl.agent.trajectory import UNTRAINABLE, StopReason, Trajectory


@dataclasses.dataclass(frozen=True)
class Episode:
    """``traj`` and its outcome. ``stop_reason`` and ``error`` are the trajectory's unless its
    reward failed (``reward_stop``: ``reward_error``, and ``reward_error`` the text added to
    the trajectory's error)."""

    traj: Trajectory
    reward: float = 0.0
    # whether it succeeded: its environment's env_success when said, else its outcome
    # (without the turn rewards) >= data.success_reward
    success: bool = False
    # why its outcome is 0 when the reward failed on its answer and not on the row's own (a
    # wrong answer, trained on: `rewards.AnswerFaultError`), else None
    answer_fault: str | None = None
    reruns: int = 0  # times it was run again from its prompt after its tool service failed
    filtered_by: str | None = None  # the filter (agent.filters) that left it out of updates
    reward_error: str | None = None  # what its reward's failure added to its error
    reward_stop: StopReason | None = None  # its stop reason when its reward failed and ended it

    @property
    def uid(self) -> str:
        return self.traj.uid

    @property
    def group_id(self) -> str:
        return self.traj.group_id

    @property
    def stop_reason(self) -> StopReason:
        return self.reward_stop or self.traj.stop_reason

    @property
    def error(self) -> str | None:
        """The trajectory's error, and what its reward's failure added to it."""
        if self.reward_error is None:
            return self.traj.error
        return (self.traj.error or "") + self.reward_error

    @property
    def trainable(self) -> bool:
        """False for episodes cut short by infrastructure or whose reward failed (their
        outcome says nothing), and for those a filter left out."""
        return self.filtered_by is None and self.stop_reason not in UNTRAINABLE
