"""``verl.interactions.base``: the base class of verl interactions (a simulated user)."""

from jax_agent_rl.compat.verl.interaction import BaseInteraction

__all__ = ["BaseInteraction"]
