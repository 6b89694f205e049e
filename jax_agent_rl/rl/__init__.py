"""RL math (`core`), the learner batch (`batch`) and the sharded learner (`learner`)."""

from jax_agent_rl.rl.batch import TrainBatch, make_batch
from jax_agent_rl.rl.learner import Critic, Learner, SamplingSpec, critic_from_policy

__all__ = ["Critic", "Learner", "SamplingSpec", "TrainBatch", "critic_from_policy", "make_batch"]
