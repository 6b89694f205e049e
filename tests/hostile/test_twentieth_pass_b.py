"""The twentieth adversarial pass, second half (eval, view, configs, the console).

- ``jarl traces RUN`` printed a traceback (KeyError, TypeError) for a traces file whose
  record misses a field or whose steps are of different types (text and whole numbers have
  no order), where ``jarl view`` of the same file named it; it now names the file, skips
  records whose step is not a whole number as ``jarl view`` does, and prints nothing of a
  step until every record shown is read.
- A traces line holding a number of more digits than ``int()`` reads (Python's 4300) was
  refused by ``jarl view`` and ``jarl traces`` naming neither the file nor the line.
- ``jarl eval --out`` naming a FIFO passed its check (not a folder): the JSON's write, once
  every prompt was evaluated, waited for a reader for ever; a FIFO, socket or block device
  there (or as the default file) is refused before the weights load, and a write that fails
  at the end (a full disk) is one line, the table already printed.
- ``jarl train CONFIG --dry-run key=value``: argparse ended the overrides at the flag and
  refused the rest as "unrecognized arguments"; key=value words after a flag are overrides.
- A setting of ``engine.vllm`` or ``engine.jetstream`` beside another ``engine.backend``
  was read by nothing, with no word (``engine.vllm.replicas=3``: one embedded engine ran);
  the pre-run check notes each.
- A run whose every episode failed stopped with a traceback of ~90 lines (jarl's frames, then
  the first error's); ``jarl train`` and ``jarl eval`` print its two lines: the stop reason's
  share, and what failed, where, on which row.
- A step whose episodes mostly ended in a reward error showed the error's last line
  ("ZeroDivisionError: boom"): its headline, naming data.reward, the function and the row,
  is shown now.
- An ``agent.harness`` of another signature than one argument passed ``--dry-run`` (every
  episode then failed): tests/train/test_check.py."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli import main
from jax_agent_rl.config import EngineSection
from jax_agent_rl.config.rollout import JetStreamSection, VLLMSection
from jax_agent_rl.rollout.registry import unread_sections
from jax_agent_rl.train.episodes import (
    RolloutFailedError,
    all_failed_error,
    episode_metrics,
    episode_totals,
    first_error,
    stop_warning,
)
from jax_agent_rl.train.evaluation import EvalInputError, eval_target
from jax_agent_rl.train.traces import TRACES_FILE

BAD_TRACES = {
    "a record missing its fields": '{"step": 1, "uid": "u"}\n',
    "steps of text and of whole numbers": '{"step": "a"}\n{"step": 1}\n',
    "a field of another type": '{"step": 1, "uid": "u", "reward": 0, "stop_reason": "eos", '
    '"num_turns": 1, "tool_calls": 0, "malformed_calls": 0, "weight_versions": ["x", 1]}\n',
}


@pytest.mark.parametrize("text", BAD_TRACES.values(), ids=BAD_TRACES.keys())
def test_traces_of_a_malformed_file_name_it(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text(text)
    assert main(["traces", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a trace record" in err and TRACES_FILE in err
    assert "Traceback" not in err


def test_traces_skip_records_whose_step_is_not_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text('{"step": [1]}\n{"step": 2.5}\n')
    assert main(["traces", str(tmp_path)]) == 0
    assert "holds no traces yet" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["traces", "view"])
def test_a_number_past_int_digits_names_the_file_and_line(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text('{"step": 1}\n{"step": ' + "1" * 5000 + "}\n")
    out = ["--out", str(tmp_path / "page")] if command == "view" else []
    assert main([command, str(tmp_path), *out]) == 2
    err = " ".join(capsys.readouterr().err.split())  # (rich wraps no path: soft_wrap)
    assert f"{TRACES_FILE}: line 2 is not valid JSON" in err


def test_eval_refuses_a_fifo_as_its_out_file_before_the_weights_load(tmp_path: Path) -> None:
    """``jarl eval`` writes its JSON once every prompt is evaluated: a FIFO named by ``--out``
    passed the check (not a folder) and the write then waited for a reader for ever."""
    val = tmp_path / "val.jsonl"
    row = {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2"}
    val.write_text(json.dumps(row) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}\ndata:\n  train: {val}\n  val: {val}\n")
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(EvalInputError, match=r"--out .*out\.json is not a regular file"):
        eval_target(str(config), out=str(fifo))


def test_overrides_after_a_flag_are_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl train CONFIG --dry-run key=value`` ended in argparse's "unrecognized arguments":
    a command's overrides stopped at its first flag. The override is read now (here refused
    by name), and a word after a flag that is no override is still refused."""
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  steps: 1\n")
    assert main(["train", str(config), "--dry-run", "trainer.stepz=2"]) == 2
    assert "unknown config key 'trainer.stepz'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(config), "--dry-run", "stray"])


def test_a_backend_section_no_backend_reads_is_noted() -> None:
    """``engine.vllm.replicas=3`` (or ``engine.jetstream.chips``) beside another backend
    passed the pre-run check with no word: one embedded engine ran."""
    engine = EngineSection(vllm=VLLMSection(replicas=3), jetstream=JetStreamSection(chips="0,1"))
    notes = unread_sections(engine)
    assert [n.split(" is read")[0] for n in notes] == [
        "engine.vllm.replicas=3",
        "engine.jetstream.chips='0,1'",
    ]
    on_vllm = unread_sections(dataclasses.replace(engine, backend="vllm"))
    assert [n.split(" is read")[0] for n in on_vllm] == ["engine.jetstream.chips='0,1'"]


def test_a_rollout_whose_every_episode_failed_is_two_lines_of_the_cli() -> None:
    """A run whose every episode failed (a reward raising on every row) ended in a traceback
    of ~90 lines, jarl's own frames first; `jarl train` and `jarl eval` now catch the
    `RolloutFailedError` and print its first two lines: the stop reason's share and what failed,
    where, on which row."""
    first = (
        "reward error: the reward function (data.reward) raised KeyError: 'nope' in always "
        "(/u/my.py:6) on row 'a-2'\nTraceback (most recent call last):\n  ...\nKeyError: 'nope'"
    )
    trajs = [Trajectory(f"a-2/s{i}", "a-2", [1, 2]) for i in range(4)]
    for traj in trajs:
        traj.end("reward_error", first)
    episodes = [Episode(t) for t in trajs]
    error = all_failed_error(episode_totals(episodes), first_error(episodes))
    assert isinstance(error, RolloutFailedError)
    headline, what = str(error).splitlines()[:2]
    assert headline.startswith("all 4 trajectories of the rollout failed (WARNING: 100%")
    assert what == first.splitlines()[0]


def test_a_step_of_reward_errors_names_the_setting_and_the_row() -> None:
    """A step whose episodes mostly ended in a reward error said "(e.g. ZeroDivisionError:
    boom)", the error's last line: neither data.reward, nor the function, nor the row; the
    headline the error leads with names all three."""
    error = (
        "reward error: the reward function (data.reward, or data.rewards_by_source.a) raised "
        "ZeroDivisionError: boom in score (/u/my.py:3) on row 'a-2' (episode 'a-2/s0', "
        "data_source 'a')\nTraceback (most recent call last):\n  ...\nZeroDivisionError: boom"
    )
    trajs = [Trajectory(f"a-2/s{i}", "a-2", [1, 2]) for i in range(2)]
    trajs[0].end("reward_error", error)
    trajs[1].end("reward_error", error)
    episodes = [Episode(t) for t in trajs]
    line = stop_warning(episode_metrics(episodes), episodes)
    assert line == f"WARNING: 100% of episodes ended reward_error (e.g. {error.splitlines()[0]})"
