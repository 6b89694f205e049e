"""verl's tool API (`jax_agent_rl.tools.verl`) under verl's module names."""
