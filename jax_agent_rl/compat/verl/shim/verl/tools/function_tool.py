"""``verl.tools.function_tool``: the ``@function_tool`` decorator."""

from jax_agent_rl.compat.verl.tools import function_tool

__all__ = ["function_tool"]
