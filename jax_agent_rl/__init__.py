"""jax_agent_rl: JAX-native agentic reinforcement learning for language models."""

import jax_agent_rl_verl_shim

__version__ = "0.1.0"

# verl tool, interaction and reward modules import `verl.*` unchanged (a real verl still wins)
jax_agent_rl_verl_shim.install()
