"""A setting naming a registry entry that does not exist, where the registry imports without
JAX: refused as the config loads, naming the key and the registered names. ``agent.parser``
was checked only by ``jarl train``'s pre-run check: ``jarl eval`` loaded the policy's weights
and only then failed building the parser, with a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.config import load_config
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.tokenization.tool_calls import PARSERS

REQUIRED = ["data.train=train.jsonl", "model.path=model"]
REFUSAL = (
    f"agent.parser='hermez' is not a registered tool-call parser: use one of {sorted(PARSERS)}"
)


def test_an_unknown_parser_is_refused_at_load() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["agent.parser=hermez", *REQUIRED])
    assert str(e.value) == REFUSAL


def test_every_registered_parser_loads() -> None:
    for name in PARSERS:
        assert load_config(None, [f"agent.parser={name}", *REQUIRED]).agent.parser == name


def test_eval_refuses_an_unknown_parser_before_loading_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train: train.jsonl\n  val: val.jsonl\nmodel:\n  path: model\n")
    assert main(["eval", str(config), "agent.parser=hermez"]) == 2
    assert capsys.readouterr().err == f"jarl: {REFUSAL}\n"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.reward=maths", "data.reward='maths' is not a reward"),
        ("engine.backend=vlm", "engine.backend='vlm': expected one of"),
        ("agent.filters=[overlng]", "agent.filters"),
    ],
)
def test_eval_checks_the_other_registries_before_loading_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, named: str
) -> None:
    """The registries that import JAX are checked by ``jarl eval`` as by ``jarl train
    --dry-run``, before the weights load: ``model.path`` here does not exist, and the name is
    still what is refused."""
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train: train.jsonl\n  val: val.jsonl\nmodel:\n  path: model\n")
    assert main(["eval", str(config), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jarl: {named}"), err


def test_eval_refuses_an_out_file_it_cannot_write_before_evaluating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON is written once every prompt is evaluated: an --out that is a folder, or
    under a file, was a traceback after the whole evaluation (IsADirectoryError,
    NotADirectoryError)."""
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train: train.jsonl\n  val: val.jsonl\nmodel:\n  path: model\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, problem in ((tmp_path, "is a folder"), (a_file / "x.json", "cannot be made")):
        assert main(["eval", str(config), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jarl: --out {out}") and problem in err and err.count("\n") == 1
