"""Wings: compatibility layers under ``jax_agent_rl/compat/`` (verl's: its tool and interaction
APIs, its reward rules, its tool server route, the ``verl`` import shim) that no module of the core
imports. The core loads one by name where a config or a user file needs it (`load_wing`); loading it
runs the wing's registration, which fills the core's hooks: named reward rules and the rule of the
data sources it knows (`jax_agent_rl.rewards.hooks`), a tools-file format
(`jax_agent_rl.tools.registry.register_tool_format`), an interaction config loader
(`jax_agent_rl.envs.register_interactions`), tool-server routes
(`jax_agent_rl.tools.app.register_routes`) and, apart (``verl_keys``), verl's spellings of the
config's keys (`jax_agent_rl.config.foreign_keys`). The agent loop and the train step only read
those hooks.

A shim (`install_shims`) is apart from its wing's hooks: it lets user code import the other
framework's module names (``import verl.tools.base_tool``) and turning it on imports only the
standard library, so user code loaded in a worker process pays for nothing more."""

from __future__ import annotations

import importlib

# a wing's name -> the module whose import registers its hooks
WINGS = {
    "verl": "jax_agent_rl.compat.verl.wing",
    "verl_keys": "jax_agent_rl.compat.verl.keys.wing",  # light: as every config loads
}
# the import shims, each a module with install(): a finder for the framework's names
SHIMS = ("jax_agent_rl.compat.verl.shim",)


def load_wing(name: str) -> None:
    """Registers the hooks of the wing ``name`` (once: a module is imported once)."""
    importlib.import_module(WINGS[name])


def install_shims() -> None:
    """Turns on every shim (each installs its finder once)."""
    for module in SHIMS:
        importlib.import_module(module).install()
