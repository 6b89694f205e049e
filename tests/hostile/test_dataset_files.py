"""A prompt file a careful user got wrong (a line nested past what JSON reads, a number of more
digits than Python reads, bytes that are not UTF-8) is a `DatasetError` naming the file and the
row, which the pre-run check writes as one line; each was a traceback out of `jarl train
--dry-run` naming no row.

An SFT demonstration (``sft.data``) holding a lone surrogate, a content that is no string
(null, a number), a message with no role, or nested past the recursion limit raised the
tokenizer's TypeError ("TextInputSequence must be str") or a RecursionError, naming no file
or line, out of ``jarl train``'s check or, on a row past those it reads, out of the run's SFT
stage after the model loaded. Each is now the ValueError naming the file, the line and the
message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_agent_rl.data.datasets import DatasetError, load_samples
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.train.sft import load_demonstrations

GOOD = b'{"prompt": [{"role": "user", "content": "2 + 2?"}], "reward_model": {"ground_truth": 4}}\n'


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nested too deep"),
        (b'{"prompt": [], "x": ' + b"9" * 5000 + b"}\n", "not valid JSON"),  # int() refuses
        (b'{"prompt": "caf\xe9"}\n', "not UTF-8 text: byte 0xe9 at offset 15 of the line"),
    ],
    ids=["deep", "digits", "latin-1"],
)
def test_a_row_no_json_reader_takes_is_an_error_naming_it(
    tmp_path: Path, line: bytes, problem: str
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(GOOD + line + GOOD)
    with pytest.raises(DatasetError, match=f"^{path}: row 1 \\(line 2\\): .*{problem}"):
        load_samples(path, agents=["tool_agent"], default_agent="tool_agent")


_USER = {"role": "user", "content": "2+2?"}


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        (
            [_USER, {"role": "assistant", "content": "4 \ud83d"}],
            "message 1 (assistant) holds a lone surrogate at character 2",
        ),
        (
            [_USER, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "\udc80"}],
            "message 2 (tool) holds a lone surrogate at character 0",
        ),
        ([_USER, {"role": "assistant", "content": None}], "message 1 (assistant) has no string"),
        ([_USER, {"role": "assistant", "content": 4}], "message 1 (assistant) has no string"),
        ([_USER, {"content": "4"}], "message 1 must be an object with a role among"),
        ("DEEP", "nested too deep"),
    ],
)
def test_a_demonstration_the_tokenizer_cannot_take_is_named(
    tmp_path: Path, messages: object, problem: str
) -> None:
    backend = train_bpe(["plain text"] * 8, 300, CHATML_SPECIAL_TOKENS)
    folder = save_tokenizer(tmp_path / "tok", backend, chat_template("chatml_tools"))
    builder = TurnBuilder(Tokenizer.from_pretrained(Path(folder)), None)
    path = tmp_path / "sft.jsonl"
    fine = json.dumps({"messages": [_USER, {"role": "assistant", "content": "4"}]})
    row = json.dumps({"messages": messages}).replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
    path.write_text(f"{fine}\n{row}\n")
    assert len(load_demonstrations(path, builder, limit=1)) == 1
    with pytest.raises(ValueError) as refused:
        load_demonstrations(path, builder)
    assert str(refused.value).startswith(f"{path}: line 2: not a demonstration ({problem}")
