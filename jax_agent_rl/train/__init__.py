"""The trainer loop, SFT, checkpoints, metrics and rollout traces."""

from jax_agent_rl.train.trainer import Trainer, train

__all__ = ["Trainer", "train"]
