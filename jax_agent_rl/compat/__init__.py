"""Wings: compatibility with other frameworks, apart from the core (`jax_agent_rl.config.wings`). No
module outside this package imports one; the core loads a wing by name where a config or a
user file needs it, and the wing registers its hooks. Each wing is one package: `verl`."""
