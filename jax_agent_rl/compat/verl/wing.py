"""The verl wing's hooks, registered when the core loads the wing
(`jax_agent_rl.config.wings.load_wing("verl")`: a tools file in verl's format, an interaction
config, the rewards of a run, the tool server's app):

- verl's rule names (``data.reward: verl_gsm8k`` ...) and its rule for the sources verl's
  ``default_compute_score`` knows (`jax_agent_rl.rewards.hooks`): it scores those rows with
  ``data.reward`` unset, and their reward reads the whole response;
- verl's tools-file format, ``{tools: [{class_name, config, tool_schema}]}``
  (`jax_agent_rl.tools.registry.register_tool_format`);
- verl's interaction config, ``env.interaction_config`` (`jax_agent_rl.envs.
  register_interactions`);
- verl-tool's ``POST /get_observation`` on the tool server (`jax_agent_rl.tools.app.
  register_routes`).
"""

from __future__ import annotations

from collections.abc import Callable

from jax_agent_rl.compat.verl import rules
from jax_agent_rl.compat.verl.interaction import interaction_factory, load_interactions
from jax_agent_rl.compat.verl.tool_routes import add_verl_tool_routes
from jax_agent_rl.compat.verl.tools import verl_tool
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import NamedEnvironment, register_interactions
from jax_agent_rl.rewards.hooks import RewardFn, SourceRule, register_reward, register_source_rule
from jax_agent_rl.tools.app import register_routes
from jax_agent_rl.tools.registry import register_tool_format

RULE_NAMES: dict[str, RewardFn] = {
    "verl_gsm8k": rules.gsm8k_score,
    "verl_math": rules.math_score,
    "verl_dapo": rules.dapo_score,
    "verl_qa_em": rules.qa_em_score,
}


def read_interactions(path: str) -> Callable[[Sample], NamedEnvironment]:
    """``env.interaction_config``'s interactions, each row's picked by its
    ``interaction_kwargs.name``."""
    return interaction_factory(load_interactions(path))


for _name, _fn in RULE_NAMES.items():
    register_reward(_name, _fn)
register_source_rule(SourceRule("verl's rule", rules.knows_source, rules.default_compute_score))
register_tool_format("tools", verl_tool)
register_interactions(read_interactions)
register_routes(add_verl_tool_routes)
