"""The twenty-first adversarial pass (the merged result of the rollout section's split, the
learner's TrainSequence and verl's wing).

- A config's bare ``rollout:`` (every line under it commented out, ``rollout: {}``, or the
  override ``rollout=...``) was refused as an unknown key, naming none of the sections its
  keys moved to; it names engine, group and sampling now, as ``rollout.n`` names group.n."""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.errors import ConfigError

REQUIRED = "model:\n  path: /m\ndata:\n  train: /d\n"


@pytest.mark.parametrize("section", ["rollout:\n", "rollout: {}\n", "rollout: 5\n"])
def test_the_split_rollout_section_names_where_its_keys_went(tmp_path: Path, section: str) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + section)
    with pytest.raises(ConfigError, match=r"'rollout' split.*engine, group, sampling"):
        load_config(tmp_path / "run.yaml")


def test_an_empty_section_that_still_exists_loads(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + "agent: {}\n")
    assert load_config(tmp_path / "run.yaml").group.n == 8
