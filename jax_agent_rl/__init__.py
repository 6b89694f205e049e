"""jax_agent_rl: JAX-native agentic reinforcement learning for language models."""

__version__ = "0.1.0"
