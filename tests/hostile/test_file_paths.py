"""Paths a user names that are not what the run needs there: a FIFO where a file is read, a
folder a command writes that cannot be made. Each is refused before anything runs, in one
line naming the key or flag, never a read or write that blocks for ever or a traceback.

- A FIFO named as a verl interaction config (``env.interaction_config``), as the search
  tool's corpus, or as ``data.train`` under verl's ``trainer.total_epochs`` (its rows are
  counted as the config loads) was read as a file: the read blocked the run's start for ever
  (the config file, tokenizers, checkpoints and the datasets' own loading were already
  checked). Now each is refused as not a regular file.
- A folder a command writes that cannot be made (``trainer.run_dir``, ``jarl checkpoint make
  --out``, ``jarl demo --run-dir``, under a file or on a read-only file system) is one line
  naming the key or flag, and ``--seed`` past what ``jax.random.key`` takes is argparse's
  error, never a traceback.
- ``jarl eval --out`` naming a FIFO passed its check (not a folder): the JSON's write, once
  every prompt was evaluated, waited for a reader for ever; a FIFO, socket or block device
  there (or as the default file) is refused before the weights load, and a write that fails
  at the end (a full disk) is one line, the table already printed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from jax_agent_rl.cli import main
from jax_agent_rl.compat.verl.interaction import load_interactions
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train.build import build_run
from jax_agent_rl.train.evaluation import EvalInputError, eval_target
from tests.hostile.test_checkpoint import _unblocked


def test_a_fifo_named_as_the_interaction_config_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "interactions.yaml"
    os.mkfifo(fifo)
    with _unblocked(fifo), pytest.raises(ConfigError, match="not a regular file"):
        load_interactions(str(fifo))


def test_a_fifo_named_as_the_search_corpus_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        f"- class: jax_agent_rl.tools.search:SearchTool\n  config:\n    corpus: {fifo}\n"
    )
    with _unblocked(fifo), pytest.raises(ValueError, match=r"corpus .* is not a regular file"):
        ToolRegistry.from_yaml(tools)


def test_a_fifo_as_the_data_whose_rows_verl_epochs_count_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    overrides = [f"data.train={fifo}", "trainer.total_epochs=2", "model.path=x"]
    with _unblocked(fifo), pytest.raises(ConfigError, match="rows could not be counted"):
        load_config(None, overrides)


ROOT = Path(__file__).resolve().parents[2]


def test_a_run_folder_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    """``trainer.run_dir`` under a file: every check of ``jarl train`` passed, then making the
    folder raised NotADirectoryError (a traceback); now a `ConfigError` naming the key, which
    ``jarl train`` prints as one line."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    run_dir = a_file / "run"
    config = ROOT / "configs" / "demo_calculator_cpu.yaml"
    given = ["model.path=ckpt", "data.train=t.jsonl", "data.val=t.jsonl", "sft.data=x.jsonl"]
    cfg = load_config(str(config), [*given, f"trainer.run_dir={run_dir}"])
    want = f"trainer.run_dir={str(run_dir)!r}: cannot make the folder: Not a directory"
    with pytest.raises(ConfigError, match=f"^{re.escape(want)}$"):
        build_run(cfg, Console(quiet=True))


def test_checkpoint_make_refuses_a_folder_it_cannot_make_and_a_seed_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` under a file (NotADirectoryError) and ``--seed`` past an int64 (OverflowError
    in ``jax.random.key``) were tracebacks; now one line each, before anything is made."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    out = a_file / "ckpt"
    assert main(["checkpoint", "make", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jarl: --out {out}: cannot make the folder: ") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["checkpoint", "make", "--out", str(tmp_path / "c"), "--seed", str(2**64)])
    assert f"argument --seed: {2**64} is not in [0, " in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_demo_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl demo --run-dir`` under a file: NotADirectoryError out of writing the task (a
    traceback); now one line naming the flag, before anything is written."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    run_dir = a_file / "run"
    assert main(["demo", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err == f"jarl: --run-dir {run_dir}: cannot make the folder: Not a directory\n"


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
