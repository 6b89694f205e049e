"""verl compatibility, in one wing: verl's tool API and its tools-file format (`tools`,
`gsm8k_tool`), its interactions and interaction config (`interaction`, `gsm8k_interaction`), its
rule scorers (`rules`), verl-tool's route on the tool server (`tool_routes`), the ``verl``
import shim for user code (`shim`) and verl's config keys (`keys`). Importing `wing` registers
the hooks, and `keys.wing` the config keys (the core does, by name:
`jax_agent_rl.config.wings.load_wing`); this file imports nothing, so turning the shim on does
not."""
