"""Text that comes into a run (a data row, an SFT demonstration, an environment's messages, a
tool's text, a call's arguments, an endpoint request, the traces a step writes) holding a lone
surrogate (half an emoji, ``"\\ud83d"`` in JSON; an undecodable byte of a file name as
``Path.iterdir`` gives it): one helper (`visible.lone_surrogate`) finds it wherever it comes
in, each refusal naming the character and where it is.

- Writing a step's traces with one in a trajectory's messages (a data file's, an
  environment's observation, which ends the episode unrendered when it says done) raised
  UnicodeEncodeError and ended the run. It is written as its JSON escape (read back the same),
  and `visible` shows it as one (a console cannot print it). At its sources it is refused: a
  data file's prompt holding one is a DatasetError naming the row (each of its episodes failed
  in the tokenizer, "TextInputSequence must be str"), an environment's observation or prompt
  an EnvError naming the environment.
- A tool's text holding one reached the loop as it was, and the tokenizer rendering the
  observation raised, ending the episode with ``agent_error``. It is now the call's error
  result, naming the tool and the character, and the episode goes on; a tool's error whose
  words hold one (``ValueError(f"no file {name}")``) is written escaped. A data row's
  ``data_source`` holding one (it names the row's episodes) is a DatasetError.
- A data row's prompt message holding one outside its content (an assistant turn's
  ``tool_calls``, a message's ``name``: the chat template writes them): every episode of the
  row failed in the tokenizer, and ``jarl train``'s check ended in that TypeError's
  traceback. It is now the DatasetError naming the row, the message and the field."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.console.visible import lone_surrogate, visible
from jax_agent_rl.data.datasets import DatasetError, load_samples
from jax_agent_rl.envs import EnvError
from jax_agent_rl.envs.base import checked_messages
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.traces import append_traces, read_traces, trace_record


def test_a_lone_surrogate_in_a_trajectory_is_traced_and_shown(tmp_path: Path) -> None:
    backend = train_bpe(["plain text"] * 8, 300, CHATML_SPECIAL_TOKENS)
    folder = save_tokenizer(tmp_path / "tok", backend, chat_template("chatml_tools"))
    tokenizer = Tokenizer.from_pretrained(Path(folder))
    traj = Trajectory(uid="r/0", group_id="r", prompt_ids=tokenizer.encode("plain"))
    traj.messages = [
        {"role": "user", "content": "What is 2+2? \ud83d"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "\\\udc80 (an observation)"},
    ]
    traj.end("env_done")
    path = tmp_path / "traces.jsonl"
    append_traces(path, [trace_record(Episode(traj), tokenizer, 1)])
    assert read_traces(path)[0]["messages"] == traj.messages
    shown = visible(traj.messages[0]["content"])
    assert shown == "What is 2+2? \\ud83d"
    shown.encode("utf-8")  # (a console writing the old text raised here)


def test_a_lone_surrogate_is_refused_where_it_comes_in(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        '{"prompt": [{"role": "user", "content": "ok"}], "reward_model": {"ground_truth": "4"}}\n'
        '{"prompt": [{"role": "user", "content": "2+2? \\ud83d"}], '
        '"reward_model": {"ground_truth": "4"}}\n'
    )
    with pytest.raises(DatasetError, match=r"row 1 .*prompt message 0 \(user\) holds a lone"):
        load_samples(data, agents=["tool_agent"], default_agent="tool_agent")
    for prompt in (True, False):
        with pytest.raises(EnvError, match=r"^mine: .* message 1 holds a lone surrogate"):
            checked_messages(
                [{"role": "user", "content": "a"}, {"role": "user", "content": "b\udc80"}],
                "mine",
                prompt,
            )


@tool
def listing(folder: str) -> str:
    """Lists a folder's entries, one a line.

    Args:
        folder: the folder to list
    """
    return "\n".join(sorted(p.name for p in Path(folder).iterdir()))


def test_a_tool_text_holding_a_lone_surrogate_is_the_calls_error(tmp_path: Path) -> None:
    (tmp_path / "plain").touch()
    tools = LocalTools(ToolRegistry([listing]))
    fine = asyncio.run(tools.call("t/0", "listing", {"folder": str(tmp_path)}))
    assert fine.text == "plain" and not fine.error
    (tmp_path / os.fsdecode(b"caf\xe9")).touch()  # (a name no UTF-8 decoder reads)
    result = asyncio.run(tools.call("t/1", "listing", {"folder": str(tmp_path)}))
    assert result.error
    assert result.text == (
        "error: listing returned text holding a lone surrogate at character 3 ('\\udce9'): not text"
    )
    result.text.encode("utf-8")  # (the tokenizer takes it)


_USER = {"role": "user", "content": "2+2?"}


def _called(name: str, arguments: object) -> dict[str, object]:
    """An assistant turn calling ``name`` with ``arguments``."""
    function = {"name": name, "arguments": arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": function}]}


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        (
            [_USER, _called("f\ud83d", "{}")],
            "message 1 (assistant) holds a lone surrogate at character 1 ('\\ud83d') in "
            "'tool_calls'",
        ),
        (
            [_USER, _called("f", '{"x": "\udc80"}')],
            "message 1 (assistant) holds a lone surrogate at character 7 ('\\udc80') in "
            "'tool_calls'",
        ),
        (
            [_USER, _called("f", {"x": "\udc80"})],
            "message 1 (assistant) holds a lone surrogate at character 0 ('\\udc80') in "
            "'tool_calls'",
        ),
        (
            [_USER, _called("f", "{}"), {"role": "tool", "content": "4", "name": "f\ud83d"}],
            "message 2 (tool) holds a lone surrogate at character 1 ('\\ud83d') in 'name'",
        ),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_prompt_message_is_refused(
    tmp_path: Path, prompt: list[dict[str, object]], problem: str
) -> None:
    path = tmp_path / "rows.jsonl"
    fine = [_USER, _called("f", '{"x": "\\ud83d is the escape"}'), {"role": "tool", "content": "4"}]
    rows = [{"prompt": p, "reward_model": {"ground_truth": "4"}} for p in (fine, prompt)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(load_samples(path, agents=["tool_agent"], default_agent="tool_agent", limit=1)) == 1
    with pytest.raises(DatasetError) as refused:
        load_samples(path, agents=["tool_agent"], default_agent="tool_agent")
    assert str(refused.value) == (
        f"{path}: row 1 (line 2): prompt {problem} (half of a JSON \\ud83d\\ude00 pair): not text"
    )


@tool
def opening(name: str) -> str:
    """Reads a file of the folder the model listed.

    Args:
        name: the file's name, as listed
    """
    listed = os.fsdecode(b"caf\xe9")  # (an undecodable byte of a name, as a listing gives it)
    raise ValueError(f"no file {listed} beside {name}")


def test_a_tool_error_holding_a_lone_surrogate_is_written_escaped(tmp_path: Path) -> None:
    result = asyncio.run(LocalTools(ToolRegistry([opening])).call("t/0", "opening", {"name": "x"}))
    assert result.error
    assert result.text == "error: opening failed: ValueError: no file caf\\udce9 beside x"
    path = tmp_path / "rows.jsonl"
    row = {"data_source": "math\ud83d", "prompt": [_USER], "reward_model": {"ground_truth": "4"}}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"row 0 .*: data_source holds a lone surrogate"):
        load_samples(path, agents=["tool_agent"], default_agent="tool_agent")


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


def test_a_lone_surrogate_nested_past_the_recursion_limit_is_found() -> None:
    deep: list[object] = ["x\ud83d"]
    for _ in range(100_000):  # (past the recursion limit: walked without recursion)
        deep = [deep]
    assert lone_surrogate(deep) == "at character 1 ('\\ud83d')"
