"""RL math (`core`), the learner batch (`batch`), one micro-batch's losses (`objectives`), the
update as one device program (`update`) and the sharded learner that runs it (`learner`)."""

from jax_agent_rl.rl.batch import TrainBatch, make_batch
from jax_agent_rl.rl.learner import Learner, critic_from_policy
from jax_agent_rl.rl.objectives import Critic, SamplingSpec

__all__ = ["Critic", "Learner", "SamplingSpec", "TrainBatch", "critic_from_policy", "make_batch"]
