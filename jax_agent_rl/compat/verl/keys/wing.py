"""Registers verl's Hydra keys with the config loader (`jax_agent_rl.config.foreign_keys`): the
core loads this by name (`jax_agent_rl.config.wings.load_wing("verl_keys")`) as a `JarlConfig`
loads."""

from jax_agent_rl.compat.verl.keys.convert import to_jarl
from jax_agent_rl.compat.verl.keys.rules import VERL_SECTIONS
from jax_agent_rl.config.foreign_keys import ForeignKeys, register_foreign_keys

register_foreign_keys(ForeignKeys("verl", VERL_SECTIONS, to_jarl))
