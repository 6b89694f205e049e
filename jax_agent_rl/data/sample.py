"""One prompt of a dataset, as the agent loop plays it: `Sample`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_agent_rl.tokenization import Message


@dataclasses.dataclass
class Sample:
    """One prompt of a dataset, in verl's column layout."""

    uid: str
    messages: list[Message]
    ground_truth: Any = None
    data_source: str = ""
    agent_name: str = "tool_agent"
    env_class: str = ""  # the environment that plays it (SkyRL's column; jax_agent_rl.envs)
    group_id: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
