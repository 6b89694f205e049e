"""verl compatibility, in one wing: verl's tool API and its tools-file format (`tools`,
`gsm8k_tool`), its interactions and interaction config (`interaction`, `gsm8k_interaction`), its
rule scorers (`rules`), verl-tool's route on the tool server (`tool_routes`), the ``verl``
import shim for user code (`shim`), and verl's config keys (`jax_agent_rl.compat.verl.keys`, read as
the config loads). Importing `wing` registers the hooks (the core does, by name:
`jax_agent_rl.wings.load_wing`); this file imports nothing, so turning the shim on does not."""
