"""The tiny demo run that several modules of tests/train read (training it takes a minute or
more): made once for the suite's run, whichever test process asks first (before, once per
package scope, which ends whenever the files a process takes leave tests/train: up to four
times a run, 100 s each)."""

import contextlib
import io
from pathlib import Path

import pytest
from rich.console import Console

from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.train import train
from tests.conftest import made_once
from tests.train.test_trainer import _command

STEPS = 2


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    """The demo's task at the size tests/train/test_trainer.py runs it."""
    return made_once(
        tmp_path_factory,
        "train-task",
        lambda folder: prepare(folder, ArithmeticTask(), n_train=200, n_val=16, n_sft=300),
    )


@pytest.fixture(scope="session")
def run(task: TaskFiles, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny run (SFT warm start, two GRPO steps, a checkpoint each, the held-out prompts
    evaluated before the first step and after the last), its console a log file, made once for
    the test processes (its readers write only new folders beside its own: exports, evals).
    It runs in the task's folder, given data.val relative to it, as a user in their project
    would: the readers of the run (export, eval) then run from elsewhere."""

    def make(run_dir: Path) -> tuple[Path, str]:
        args = [
            *_command(task, run_dir)[5:],
            f"trainer.steps={STEPS}",
            f"data.val={task.val.name}",
            "trainer.traces_per_step=16",  # every episode: whole groups for `jarl view`
        ]
        log = io.StringIO()
        with contextlib.chdir(task.val.parent):
            train(load_config(DEMO_CONFIG, args), Console(file=log, force_terminal=False))
        return run_dir, log.getvalue()

    return made_once(tmp_path_factory, "train-run", make)
