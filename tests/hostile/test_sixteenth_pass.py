"""The sixteenth adversarial pass: `jarl view` fed a traces or metrics file holding a value
JSON cannot carry into the page (an infinite weight version, a step that is NaN or infinite).
Before, the page's JSON refused it and the view ended with "Out of range float values are not
JSON compliant", naming no file; now the record is named as not one the trainer wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.train.traces import TRACES_FILE
from jax_agent_rl.view.data import METRICS_FILE
from tests.train.test_view import hostile_record


@pytest.mark.parametrize("versions", [[math.inf], [0, math.inf]])
def test_an_infinite_weight_version_is_a_trace_record_error_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], versions: list[float]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {**hostile_record("h/0", None), "weight_versions": versions}
    (run_dir / TRACES_FILE).write_text(json.dumps(record) + "\n")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / TRACES_FILE}: a record is not a trace record" in err


@pytest.mark.parametrize("step", [math.nan, math.inf, 1.5, "<b>", True])
def test_a_metrics_step_that_is_not_a_whole_number_is_an_error_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: object
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    metrics = {"phase": "train", "step": step, "reward": 1.0}
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics) + "\n")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / METRICS_FILE}: a record is not a metrics record" in err


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.reward=judge", "data.success_reward=0"],
        ["data.reward=judge", "data.success_reward=-0.5", "data.judge.fallback=-0.5"],
        ["data.rewards_by_source={qa: judge}", "data.success_reward=-1"],
    ],
)
def test_a_success_threshold_a_failed_judge_call_reaches_is_refused(
    overrides: list[str],
) -> None:
    """A judge call that fails (no score in the judge's answer, an error, a timeout) scores
    ``data.judge.fallback``; a success threshold at or below it made every answer that broke
    the judge a success in ``jarl eval``'s figures."""
    with pytest.raises(ConfigError, match=r"data\.success_reward=.* at most data\.judge"):
        load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])


def test_a_success_threshold_below_the_fallback_is_kept_without_a_judge() -> None:
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "data.success_reward=0"])
    assert cfg.data.success_reward == 0
