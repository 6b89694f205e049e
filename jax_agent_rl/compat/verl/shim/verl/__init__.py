"""jax_agent_rl's stand-in for the ``verl`` package (see `jax_agent_rl.compat.verl.shim`): the
names verl tool, interaction and reward modules import, served by jax_agent_rl. It is imported only
when no real verl is on ``sys.path``."""
