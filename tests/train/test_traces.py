"""Rollout traces: records from real token ids, JSONL round trip, rendering by token origin."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.text import Text

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.train.traces import (
    GIVEN_STYLE,
    MODEL_STYLE,
    append_traces,
    read_traces,
    render_run,
    render_trace,
    response_text,
    token_pieces,
    trace_record,
    traces_command,
)

CORPUS = [
    "What is 7 * 6? The calculator says 42, so the answer is <answer>42</answer>.\n",
    '{"name": "calculator", "arguments": {"expression": "7 * 6"}}\n',
    "Zürich, naïve café — unicode must survive byte-level BPE. 日本語も。\n",
] * 30

MESSAGES = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 7 * 6?"},
]
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 6"}}\n</tool_call>'
)
TOOL_TEXT = (
    "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
ANSWER_TEXT = "The answer is <answer>42</answer> — 日本語"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path, train_bpe(CORPUS, vocab_size=400), chat_template("chatml_tools"))
    return Tokenizer.from_pretrained(path)


def episode(tok: Tokenizer, uid: str = "arith-0", reward: float = 1.0) -> Episode:
    traj = Trajectory(
        uid=uid,
        group_id="g0",
        prompt_ids=tok.encode_chat(MESSAGES, add_generation_prompt=True),
        messages=[dict(m) for m in MESSAGES],
        num_turns=2,
        tool_calls=1,
        stop_reason="eos",
        weight_versions=[3, 4],
    )
    call = [*tok.encode(CALL_TEXT), tok.token_id("<|im_end|>")]
    traj.append(call, model=True, logprobs=[-0.01] * len(call))
    traj.append(tok.encode(TOOL_TEXT), model=False)
    answer = [*tok.encode(ANSWER_TEXT), tok.token_id("<|im_end|>")]
    traj.append(answer, model=True, logprobs=[-3.0] * len(answer))
    traj.messages.append({"role": "assistant", "content": CALL_TEXT})
    traj.messages.append({"role": "tool", "content": "42", "name": "calculator"})
    traj.messages.append({"role": "assistant", "content": ANSWER_TEXT})
    return Episode(traj, reward=reward)


def test_record_is_json_and_complete(tokenizer: Tokenizer) -> None:
    ep = episode(tokenizer)
    traj = ep.traj
    record = json.loads(json.dumps(trace_record(ep, tokenizer, step=7)))
    assert record["step"] == 7
    assert record["uid"] == "arith-0"
    assert record["group_id"] == "g0"
    assert record["weight_versions"] == [3, 4]
    assert record["response_ids"] == traj.response_ids
    assert record["loss_mask"] == traj.loss_mask
    assert record["rollout_logprobs"] == traj.rollout_logprobs
    assert record["messages"] == traj.messages
    assert record["prompt_text"] == tokenizer.decode(traj.prompt_ids)
    assert record["prompt_text"].endswith("<|im_start|>assistant\n")
    pieces = record["response_pieces"]
    assert len(pieces) == len(traj.response_ids)
    assert "".join(pieces) == CALL_TEXT + "<|im_end|>" + TOOL_TEXT + ANSWER_TEXT + "<|im_end|>"


def test_pieces_are_single_token_text_except_split_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab 日本語")
    pieces = token_pieces(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == "ab 日本語"
    assert "" in pieces  # some token ends inside a character
    for token, piece in zip(ids, pieces, strict=True):
        alone = tokenizer.decode([token])
        assert piece == alone or "\ufffd" in alone


def test_append_and_read(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "run" / "traces.jsonl"
    step1 = [trace_record(episode(tokenizer, f"u{i}"), tokenizer, 1) for i in range(2)]
    step2 = [trace_record(episode(tokenizer, "u9"), tokenizer, 2)]
    append_traces(path, step1)
    append_traces(path, step2)
    assert read_traces(path) == step1 + step2
    assert read_traces(path, step=2) == step2
    assert read_traces(path, step=5) == []


def test_read_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.jsonl"
    with pytest.raises(FileNotFoundError, match=r"no traces file .*nothing\.jsonl"):
        read_traces(missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n{"step": 2, oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not valid JSON"):
        read_traces(bad)
    bad.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not a trace record"):
        read_traces(bad)


def runs(text: Text) -> list[tuple[str, str]]:
    """(style, text) of the spans of ``text``, in order, neighbours of one style merged."""
    merged: list[tuple[str, str]] = []
    for span in text.spans:
        style, piece = str(span.style), text.plain[span.start : span.end]
        if merged and merged[-1][0] == style:
            merged[-1] = (style, merged[-1][1] + piece)
        elif piece:
            merged.append((style, piece))
    return merged


def test_response_styles_model_and_tool_tokens_apart(tokenizer: Tokenizer) -> None:
    record = trace_record(episode(tokenizer), tokenizer, 0)
    text = response_text(record)
    assert text.plain == "".join(record["response_pieces"])
    assert runs(text) == [
        (MODEL_STYLE, CALL_TEXT + "<|im_end|>"),
        (GIVEN_STYLE, TOOL_TEXT),
        (MODEL_STYLE, ANSWER_TEXT + "<|im_end|>"),
    ]
    assert MODEL_STYLE != GIVEN_STYLE


def test_logprobs_colour_model_tokens_by_probability(tokenizer: Tokenizer) -> None:
    record = trace_record(episode(tokenizer), tokenizer, 0)
    text = response_text(record, show_logprobs=True)
    assert text.plain == "".join(record["response_pieces"])
    assert math.exp(-0.01) >= 0.9 and math.exp(-3.0) < 0.1
    assert runs(text) == [
        ("bold green", CALL_TEXT + "<|im_end|>"),  # logprob -0.01
        (GIVEN_STYLE, TOOL_TEXT),
        ("bold red", ANSWER_TEXT + "<|im_end|>"),  # logprob -3
    ]


def test_render_trace(tokenizer: Tokenizer) -> None:
    console = Console(record=True, width=100, color_system="standard")
    render_trace(trace_record(episode(tokenizer), tokenizer, 12), console)
    out = console.export_text(clear=False)
    assert "step 12" in out and "uid arith-0" in out and "reward 1" in out
    assert "stop eos" in out and "turns 2" in out and "tool calls 1" in out
    assert "weights v3-v4" in out
    assert "What is 7 * 6?" in out  # the prompt
    assert '{"name": "calculator", "arguments": {"expression": "7 * 6"}}' in out  # model text
    assert "<tool_response>\n42\n</tool_response>" in out  # tool text, kept verbatim
    assert "<answer>42</answer> — 日本語" in out
    assert "model tokens" in out and "tool results" in out  # the legend
    ansi = console.export_text(styles=True)
    assert "\x1b[2mWhat is 7 * 6?" in ansi  # prompt: dim
    assert "\x1b[1;32m<tool_call>" in ansi  # model: bold green (not dim)
    assert "\x1b[36m<tool_response>" in ansi  # tool: cyan


def test_render_run_picks_the_last_step(tokenizer: Tokenizer, tmp_path: Path) -> None:
    records = [
        trace_record(episode(tokenizer, f"s{step}-{i}", reward=i), tokenizer, step)
        for step in (1, 2)
        for i in range(6)
    ]
    append_traces(tmp_path / "traces.jsonl", records)
    console = Console(record=True, width=100)
    assert render_run(tmp_path, console) == 4
    out = console.export_text()
    assert "uid s2-3" in out and "uid s2-4" not in out and "uid s1-" not in out
    console = Console(record=True, width=100)
    assert render_run(tmp_path, console, step=1, limit=2, show_logprobs=True) == 2
    out = console.export_text()
    assert "uid s1-1" in out and "uid s1-2" not in out and "p>=0.9" in out
    with pytest.raises(ValueError, match=r"no traces of step 5; traced steps: 1 to 2 \(2 in all\)"):
        render_run(tmp_path, console, step=5)


def test_traces_command(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert traces_command(str(tmp_path / "absent"), None, 4, False) == 2
    assert "no run folder" in capsys.readouterr().err
    assert traces_command(str(tmp_path), None, 4, False) == 2
    assert "no traces.jsonl in" in capsys.readouterr().err
    append_traces(tmp_path / "traces.jsonl", [trace_record(episode(tokenizer), tokenizer, 3)])
    assert traces_command(str(tmp_path), None, 4, True) == 0
    assert "uid arith-0" in capsys.readouterr().out
    assert traces_command(str(tmp_path), 9, 4, False) == 2
    assert "no traces of step 9" in capsys.readouterr().err


HOSTILE = [
    "\x1b[2J\x1b[H",  # clear the screen
    "\x1b]52;c;cm0gLXJmIH4=\x07",  # set the clipboard (OSC 52)
    "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\",  # a forged link
    "\x9b31m",  # a C1 CSI
    "\u202egnp.exe",  # a bidi override
    "\x08\x7f\r",
]


def hostile_record(tokenizer: Tokenizer) -> dict[str, object]:
    """A trace of a diverged run whose model and tool wrote escape sequences."""
    record = trace_record(episode(tokenizer), tokenizer, 3)
    pieces = list(record["response_pieces"])
    for i, text in enumerate(HOSTILE):
        pieces[i] = text  # model tokens (the call)
        pieces[-1 - i] = text  # and the tool's / answer's
    record["response_pieces"] = pieces
    odd = [math.nan, math.inf, -math.inf, -800.0, 800.0, 1e308]
    record["rollout_logprobs"] = [odd[i % len(odd)] for i in range(len(pieces))]
    record["reward"] = math.nan
    record["prompt_text"] += "\x1b]0;title\x07"
    record["error"] = "Traceback\x1b[31m\x9d"
    return record


@pytest.mark.parametrize("show_logprobs", [False, True])
def test_jarl_traces_shows_escape_sequences_and_survives_non_finite_logprobs(
    tokenizer: Tokenizer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    show_logprobs: bool,
) -> None:
    append_traces(tmp_path / "traces.jsonl", [hostile_record(tokenizer)])
    assert traces_command(str(tmp_path), None, 4, show_logprobs) == 0
    out = capsys.readouterr().out
    assert "reward nan" in out
    assert "␛[2J␛[H" in out and "␛]52;c;cm0gLXJmIH4=␇" in out and "\\x9b31m" in out
    assert "\\u202egnp.exe" in out and "␈␡␍" in out and "\\x9d" in out
    # in a terminal: the only escape sequences are rich's own colours
    console = Console(record=True, force_terminal=True, width=100)
    with console.capture() as capture:
        render_run(tmp_path, console, show_logprobs=show_logprobs)
    raw = re.sub(r"\x1b\[[0-9;]*m", "", capture.get())
    for control in ("\x1b", "\x07", "\x9b", "\x9d", "\u202e", "\x08", "\r"):
        assert control not in raw, repr(control)
    assert "␛]8;;http://evil.example" in raw
