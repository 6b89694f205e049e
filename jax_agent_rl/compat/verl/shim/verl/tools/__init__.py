"""verl's tool API (`jax_agent_rl.compat.verl.tools`) under verl's module names."""
