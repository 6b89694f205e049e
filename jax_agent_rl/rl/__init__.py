"""RL math (`core`), what the learner reads of an episode (`sequence`), the learner batch
(`batch`), one micro-batch's losses (`objectives`), the update as one device program
(`update`) and the sharded learner that runs it (`learner`)."""

from jax_agent_rl.rl.batch import TrainBatch, make_batch
from jax_agent_rl.rl.learner import Learner, critic_from_policy
from jax_agent_rl.rl.objectives import Critic, SamplingSpec
from jax_agent_rl.rl.sequence import TrainSequence

__all__ = [
    "Critic",
    "Learner",
    "SamplingSpec",
    "TrainBatch",
    "TrainSequence",
    "critic_from_policy",
    "make_batch",
]
