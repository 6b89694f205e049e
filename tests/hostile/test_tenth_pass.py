"""Tenth pass: attacks on what a policy or a user controls, kept as regression tests.

- A tool whose text holds a lone surrogate (a file-listing tool's: ``Path.iterdir`` gives an
  undecodable byte of a file name as one, and the policy's own code can make such a name):
  the result reached the loop as it was, and the tokenizer rendering the observation raised
  ("TextInputSequence must be str"), ending the episode with ``agent_error``. It is now the
  call's error result, naming the tool and the character, and the episode goes on; a tool's
  error whose words hold one (``ValueError(f"no file {name}")``) is written escaped. A data
  row's ``data_source`` holding one (it names the row's episodes) is a DatasetError.
- A config override OmegaConf's reader refuses though the check's parser took it (a duplicate
  key, a recursive alias, a tag with no constructor, a lone surrogate's ``"\\ud83d"``), and an
  interpolation naming no key or itself (``data.reward=${foo}``, in an override or in the
  file): ``jarl train`` ended in a YAML or OmegaConf traceback. Each is a `ConfigError` line
  naming the key.
- A tools file's python sandbox set past what its waits and limits take (``timeout_s: 1e300``,
  ``.inf``, ``.nan``; ``cpu_s: 2.5``; ``memory_mb: 1e13``): taken, then every execution
  failed, each the model's error naming no setting (a poll's OverflowError, the zygote's
  TypeError traceback) or the sandbox did not start; ``pool_size: 0`` was concurrent.futures'
  error. Each is now a ValueError naming the file, the entry and the setting.
- An SFT demonstration (``sft.data``) holding a lone surrogate, a content that is no string
  (null, a number), a message with no role, or nested past the recursion limit: the
  tokenizer's TypeError ("TextInputSequence must be str") or a RecursionError, naming no file
  or line, out of ``jarl train``'s check (which catches the ValueErrors that name them) or, on
  a row past those it reads, out of the run's SFT stage after the model loaded. Each is now
  the ValueError naming the file, the line and the message.
- A data row's prompt message holding a lone surrogate outside its content (an assistant
  turn's ``tool_calls``, a message's ``name``: the chat template writes them): every episode
  of the row failed in the tokenizer ("TextInputSequence must be str"), and ``jarl train``'s
  check ended in that TypeError's traceback; the ninth pass refused one in ``content`` only.
  It is now the DatasetError naming the row, the message and the field.
- A user's reward that runs the policy's code in a subprocess, the code leaving the worker's
  process group (``os.setsid()``, as a daemon does): killed with its worker's group past the
  timeout and at close, it was not in the group, and ran on, adopted by init. A worker is now
  its descendants' subreaper, and killing it kills every descendant first.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.config import ConfigError, load_config, preview_config
from jax_agent_rl.data.datasets import DatasetError, load_samples
from jax_agent_rl.rewards import RewardError, make_reward
from jax_agent_rl.rewards.registry import Answer
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.sft import load_demonstrations
from tests.hostile.test_skyrl_isolation import _gone

HERE = "tests.hostile.test_tenth_pass"


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


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("agent.stop={a: 1, a: 2}", "found duplicate key a"),
        ("data.rewards_by_source={a: x, a: y}", "found duplicate key a"),
        ("agent.stop=[&a [*a]]", "YAML recursive aliases are not supported"),
        ("agent.stop=!!python/object:os.system x", "could not determine a constructor"),
        ('agent.stop=["\\ud83d"]', "found invalid Unicode character escape code"),
    ],
)
def test_an_override_omegaconfs_reader_refuses_is_a_config_error(
    override: str, problem: str
) -> None:
    key = override.partition("=")[0]
    with pytest.raises(
        ConfigError, match=rf"^override {key}: invalid YAML at line 1, column \d+: {problem}"
    ):
        load_config(None, ["model.path=m", "data.train=t.jsonl", override])


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("data.reward=${foo}", "Interpolation key 'foo' not found"),
        ("trainer.run_dir=${trainer.run_dir}", "Recursive interpolation detected"),
    ],
)
def test_an_interpolation_that_resolves_to_nothing_is_a_config_error(
    tmp_path: Path, setting: str, problem: str
) -> None:
    key, _, value = setting.partition("=")
    match = rf"^config key '{key}': {problem}$"
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=m", "data.train=t.jsonl", setting])
    with pytest.raises(ConfigError, match=match):
        preview_config(None, [setting])
    section, _, name = key.partition(".")
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(path, ["model.path=m", "data.train=t.jsonl"])
    assert load_config(None, ["model.path=m", "data.train=t.jsonl", f"{key}=${{model.path}}"])


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("timeout_s: 1.0e300", "timeout_s=1e+300: expected in (0, 1e+06]"),
        ("timeout_s: .inf", "timeout_s=inf: expected in (0, 1e+06]"),
        ("timeout_s: .nan", "timeout_s=nan: expected in (0, 1e+06]"),
        ("timeout_s: x", "timeout_s='x': expected in (0, 1e+06]"),
        ("cpu_s: 2.5", "cpu_s=2.5: expected a whole number in [1, 1e9]"),
        ("cpu_s: 0", "cpu_s=0: expected a whole number in [1, 1e9]"),
        ("memory_mb: 10000000000000", "memory_mb=10000000000000: expected a whole number in"),
        ("pool_size: 0", "pool_size=0: expected a whole number >= 1"),
    ],
)
def test_a_sandbox_set_past_what_it_takes_is_refused_naming_the_setting(
    tmp_path: Path, setting: str, problem: str
) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(f"- class: jax_agent_rl.tools.sandbox:PythonTool\n  config:\n    {setting}\n")
    with pytest.raises(ValueError) as refused:
        ToolRegistry.from_yaml(path)
    assert str(refused.value).startswith(f"{path}: entry 0: config: the python sandbox's {problem}")


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


def leaving_code(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """A reward that runs the policy's code in a subprocess that starts a session of its own
    (out of the worker's group), writes its pid to the file ``ground_truth`` names, and waits
    on it ("wait") or returns at once ("return")."""
    del data_source, extra_info
    code = subprocess.Popen(["sleep", "100000"], start_new_session=True)
    Path(ground_truth).write_text(str(code.pid))
    return 1.0 if solution_str == "return" else float(code.wait() == 0)


def test_what_a_reward_started_in_a_session_of_its_own_goes_with_its_worker(
    tmp_path: Path,
) -> None:
    spec = f"data.reward={HERE}:leaving_code"
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", spec, "data.reward_timeout_s=2"])
    with make_reward(cfg.data) as score:
        with pytest.raises(RewardError, match="reward_timeout_s=2s"):  # (its worker killed)
            asyncio.run(score(Answer("x", "", "wait", str(tmp_path / "wait"), {})))
        assert asyncio.run(score(Answer("x", "", "return", str(tmp_path / "return"), {}))) == 1.0
    for answer in ("wait", "return"):  # (the second, at the pool's close)
        pid = int((tmp_path / answer).read_text())
        assert _gone(pid), f"the reward's subprocess {pid} ({answer}) outlived its worker"
