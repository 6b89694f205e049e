"""``verl.tools.gsm8k_tool``: the tool class verl's GSM8K tool YAML names."""

from jax_agent_rl.compat.verl.gsm8k_tool import Gsm8kTool

__all__ = ["Gsm8kTool"]
