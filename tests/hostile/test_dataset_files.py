"""A prompt file a careful user got wrong (a line nested past what JSON reads, a number of more
digits than Python reads, bytes that are not UTF-8) is a `DatasetError` naming the file and the
row, which the pre-run check writes as one line; each was a traceback out of `jarl train
--dry-run` naming no row."""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_agent_rl.data.datasets import DatasetError, load_samples

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
