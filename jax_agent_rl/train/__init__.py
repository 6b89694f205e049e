"""Training: the run assembled once (`build_run`), the RL loop and its hooks, SFT,
checkpoints, metrics and rollout traces."""

from jax_agent_rl.train.build import Rollout, Run, build_run, open_rollout
from jax_agent_rl.train.hooks import Hook, StepEnd, default_hooks
from jax_agent_rl.train.loop import rl_loop, train

__all__ = [
    "Hook",
    "Rollout",
    "Run",
    "StepEnd",
    "build_run",
    "default_hooks",
    "open_rollout",
    "rl_loop",
    "train",
]
