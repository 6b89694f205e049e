"""``verl.interactions.gsm8k_interaction``: the interaction class verl's GSM8K interaction YAML
names."""

from jax_agent_rl.compat.verl.gsm8k_interaction import Gsm8kInteraction

__all__ = ["Gsm8kInteraction"]
