"""Eleventh pass: attacks on what a policy or a user controls, kept as regression tests.

- A lone surrogate is found by one helper (`visible.lone_surrogate`) wherever text comes in (a
  data row, an SFT demonstration, an environment's messages, a tool's text, a call's
  arguments, an endpoint request), each refusal naming the character and where it is.
"""

from __future__ import annotations

import json

import pytest

from jax_agent_rl.visible import lone_surrogate


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("2+2 is 4 \ud83d", "at character 9 ('\\ud83d')"),
        ("\udc80", "at character 0 ('\\udc80')"),
        (["fine", {"name": "f", "arguments": {"x\udfff": 1}}], "at character 1 ('\\udfff')"),
        (("a", ["b", ["c\ud800"]]), "at character 1 ('\\ud800')"),
        ("a pair, read as JSON writes it: " + json.loads('"\\ud83d\\ude00"'), None),
        ("\U0001f600 and \ue000 (private use, not a surrogate)", None),
        ({"n": 1, "x": [1.5, None, True]}, None),
        (b"\xed\xa0\x80", None),  # (bytes are no text it checks)
    ],
)
def test_one_helper_finds_a_lone_surrogate_in_text_and_json_values(
    value: object, where: str | None
) -> None:
    assert lone_surrogate(value) == where
    deep: list[object] = ["x\ud83d"]
    for _ in range(100_000):  # (past the recursion limit: walked without recursion)
        deep = [deep]
    assert lone_surrogate(deep) == "at character 1 ('\\ud83d')"
