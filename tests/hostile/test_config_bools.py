"""A true/false setting given anything but a YAML boolean: OmegaConf took ``2``, ``0``, ``0.5``
or the quoted string ``"yes"`` as a boolean, so a typo or a number meant for another key
switched a setting silently. Each is refused at load naming the key; YAML's booleans (``true``,
``False``, and ``yes``/``on``, which YAML reads as booleans) keep working, in a file and as
overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.config.errors import ConfigError

REQUIRED = ["data.train=train.jsonl", "model.path=model"]


@pytest.mark.parametrize("value", ["2", "0", "0.5", '"yes"', "'true'", "maybe"])
def test_a_non_boolean_override_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^trainer\.resume=.*: expected true or false$"):
        load_config(None, [f"trainer.resume={value}", *REQUIRED])


@pytest.mark.parametrize("value", ["2", '"no"'])
def test_a_non_boolean_in_a_file_is_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"learner:\n  packing: {value}\n")
    with pytest.raises(ConfigError, match=r"^learner\.packing=.*: expected true or false$"):
        load_config(path, REQUIRED)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ("True", True), ("FALSE", False), ("on", True)],
)
def test_yaml_booleans_keep_working(tmp_path: Path, value: str, expected: bool) -> None:
    assert load_config(None, [f"trainer.resume={value}", *REQUIRED]).trainer.resume is expected
    path = tmp_path / "run.yaml"
    path.write_text(f"learner:\n  packing: {value}\n")
    assert load_config(path, REQUIRED).learner.packing is expected
