"""The jarl command line: help that explains, errors that name the problem."""

import subprocess
import sys
from pathlib import Path

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.models.hf_local import TINY, write_hf_checkpoint


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jax_agent_rl.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for command in ("demo", "config", "inspect"):
        assert command in out


def test_config_reports_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "model.path=/x", "model.dtyp=bfloat16"]) == 2
    assert "unknown config key 'model.dtyp'" in capsys.readouterr().err
    assert main(["config", "model.path=/x", "data.train=t.jsonl"]) == 0
    assert "path: /x" in capsys.readouterr().out


def test_inspect_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_hf_checkpoint(tmp_path / "q3", TINY["qwen3"])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "qk_norm: True" in out
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    """The make-demo job itself: parity, greedy KV-cache decoding and export all hold."""
    assert main(["demo", "--run-dir", str(tmp_path)]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()
