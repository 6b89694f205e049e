"""Paths a user names that are not what the run needs there: a FIFO where a file is read, a
folder a command writes that cannot be made. Each is refused before anything runs, in one
line naming the key or flag, never a read or write that blocks for ever or a traceback.

- A FIFO named as a verl interaction config (``env.interaction_config``), as the search
  tool's corpus, or as ``data.train`` under verl's ``trainer.total_epochs`` (its rows are
  counted as the config loads) was read as a file: the read blocked the run's start for ever
  (the config file, tokenizers, checkpoints and the datasets' own loading were already
  checked). Now each is refused as not a regular file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jax_agent_rl.compat.verl.interaction import load_interactions
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.tools.registry import ToolRegistry
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
