"""One prompt of a dataset, as the agent loop plays it (`Sample`), and the error a dataset that
cannot give one raises (`DatasetError`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_agent_rl.tokenization import Message


class DatasetError(ValueError):
    """A dataset file that is missing, of an unknown kind, or has a malformed row."""


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
    # the row's columns that no field above holds, as its file has them (with those fields,
    # what SkyRL's dataset hands an environment as env_extras: reward_spec, db_id, data, ...)
    columns: dict[str, Any] = dataclasses.field(default_factory=dict)
