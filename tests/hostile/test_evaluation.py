"""``jarl eval`` against held-out data and settings that made its report wrong or its run
useless.

- Held-out rows whose data_source is ``all``, the name of the report's line of every source
  together: their prompts counted twice in that line, their own line lost.
- ``jarl eval --help`` said a success is "a reward above 0": a user reading it took a judge's
  1/10 for a solved task. It says what counts: ``data.success_reward`` (or the environment).
- data.val prompts longer than engine.max_model_len: ``jarl eval`` ran every episode to
  ``max_model_len`` before its first token and printed a pass table of wrong answers, with no
  word (``jarl train --dry-run`` checked data.train's prompts only); both now refuse it,
  naming data.val, before the weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import make_checkpoint
from jax_agent_rl.config import load_config
from jax_agent_rl.train.check import check_run
from jax_agent_rl.train.evaluation import EvalInputError, eval_target


def test_a_held_out_source_named_all_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    """``jarl eval``'s report has one line per data source and one, ``all``, of every source
    together: the rows of a source named ``all`` were counted in that line twice (once as
    their source's, once as every source's), and their own line was lost. Two prompts of
    ``all`` failing and two of ``b`` succeeding reported 6 prompts and pass@1 = 1/3 over all,
    not 4 and 1/2. Now such a source is refused, naming the row, before anything loads."""
    val = tmp_path / "val.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2", "data_source": s}
        for s in ("b", "all")
    ]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}\ndata:\n  train: {val}\n  val: {val}\n")
    with pytest.raises(EvalInputError, match=r"data\.val row 'all-1' has data_source 'all'"):
        eval_target(str(config))


def test_jarl_eval_says_what_a_success_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "a success is an outcome reward of at least data.success_reward" in said
    assert "above 0" not in said


def test_held_out_prompts_that_leave_no_room_are_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "ckpt", "tiny", 0)
    short = {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2"}
    long = {"prompt": [{"role": "user", "content": "1 + 1? " * 200}], "ground_truth": "2"}
    (tmp_path / "train.jsonl").write_text(json.dumps(short) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model:\n  path: {tmp_path / 'ckpt'}\nengine:\n  max_model_len: 512\n"
        f"data:\n  train: {tmp_path / 'train.jsonl'}\n  val: {tmp_path / 'val.jsonl'}\n"
    )
    no_room = r"engine.max_model_len=512 leaves no room .* a prompt of data.val is \d+ tokens"
    with pytest.raises(EvalInputError, match=no_room):
        eval_target(str(config))
    problems = check_run(load_config(config))
    assert [p for p in problems if "leaves no room" in p and "data.val" in p], problems
    assert not [p for p in problems if "data.train is" in p], problems
