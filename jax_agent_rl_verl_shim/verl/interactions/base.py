"""``verl.interactions.base``: the base class of verl interactions (a simulated user)."""

from jax_agent_rl.envs.verl_interaction import BaseInteraction

__all__ = ["BaseInteraction"]
