"""`jarl view` fed by an attacker: a traces file whose ``step`` is markup or not a number,
model text hiding characters a reader cannot see, and a web page elsewhere reaching the served
view through a DNS name rebound to 127.0.0.1 (its requests carry that name as Host).

``jarl view`` on a traces file of 100,000 one-character tool messages in one span took
minutes to mark the tool tokens (each was tested against every tool text found: quadratic);
on a record nested past what the JSON reader reads, or just within it in a count passed
through into the page, it ended in a RecursionError traceback. A traces or metrics file
holding an infinite weight version or a step that is NaN or infinite: the page's JSON refused
it and the view ended with "Out of range float values are not JSON compliant", naming no
file; now the record is named as not the trainer's.

``jarl traces RUN`` printed a traceback (KeyError, TypeError) for a traces file whose record
misses a field or whose steps are of different types (text and whole numbers have no order),
where ``jarl view`` of the same file named it; it now names the file, skips records whose step
is not a whole number as ``jarl view`` does, and prints nothing of a step until every record
shown is read. A traces line holding a number of more digits than ``int()`` reads (Python's
4300) was refused by ``jarl view`` and ``jarl traces`` naming neither the file nor the line."""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import sys
import threading
import unicodedata
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.cli import main
from jax_agent_rl.cli.commands import build_parser
from jax_agent_rl.console.visible import visible
from jax_agent_rl.train.traces import TRACES_FILE, read_traces
from jax_agent_rl.view.command import PAGE, view_server
from jax_agent_rl.view.data import METRICS_FILE, roles
from tests.train.test_view import hostile_record

MARKUP_STEP = "<img src=x onerror=\"document.title='img'\"><script>document.title='s'</script>"


def test_a_step_that_is_not_a_whole_number_is_skipped_counted_and_never_markup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Markup as a step, a list as a step, a float, a bool: each record is skipped, and the
    warning counts them; the page holds the good record and only its own two scripts."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    bad_steps: list[object] = [MARKUP_STEP, [1, 2], 1.5, True]
    records = [hostile_record("h/0", None)]
    records += [{**hostile_record(f"b/{i}", None), "step": s} for i, s in enumerate(bad_steps)]
    (run_dir / TRACES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) == 0
    err = capsys.readouterr().err
    assert "4 trace records skipped: their step is not a whole number" in err
    html = (tmp_path / "page" / PAGE).read_text()
    assert "<img" not in html and html.count("<script") == 2
    assert "traces of step 1 (1 traced;" in html
    data = json.loads(re.search(r'id="data">(.*?)</script>', html, re.S)[1])  # type: ignore[index]
    assert [t["uid"] for t in data["trajectories"]] == ["h/0"]


# what a reader sees nothing of: tag characters, zero-width space, non-joiner and joiner,
# word joiner, byte-order mark, soft hyphen, Hangul fillers, variation selectors
HIDDEN = [
    0xE0001, 0xE0041, 0xE007F, 0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, 0x00AD, 0x115F, 0x1160,
    0x3164, 0xFFA0, 0xFE00, 0xFE0F, 0xE0100, 0xE01EF, 0x034F, 0x180E,
]  # fmt: skip


def test_characters_a_reader_cannot_see_are_shown_as_escapes() -> None:
    for code in HIDDEN:
        shown = visible(f"a{chr(code)}b")
        escape = f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
        assert shown == f"a{escape}b", hex(code)
    # every format character Unicode knows (category Cf), by Python's own table
    formats = [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]
    assert len(formats) > 150
    assert all(visible(chr(c)) != chr(c) for c in formats)
    assert visible("plain text, tabs\tand\nnewlines, ünïcödé, 中文") == (
        "plain text, tabs\tand\nnewlines, ünïcödé, 中文"
    )


def _get(port: int, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", "/", skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_served_view_refuses_a_host_other_than_its_own_loopback_address(
    tmp_path: Path,
) -> None:
    (tmp_path / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    server = view_server(tmp_path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert _get(port, f"127.0.0.1:{port}") == 200
        assert _get(port, f"localhost:{port}") == 200
        for host in (
            f"attacker.example:{port}",  # a rebound name
            "attacker.example",
            f"127.0.0.1:{port + 1}",
            f"127.0.0.1.attacker.example:{port}",
            "",
        ):
            assert _get(port, host) == 400, host
    finally:
        server.shutdown()
        server.server_close()


def test_a_connection_that_sends_nothing_is_closed(tmp_path: Path) -> None:
    """Each connection holds a thread of the server: one that never sends its request is
    closed past the idle timeout (before: held for good, a thread each)."""
    (tmp_path / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    server = view_server(tmp_path, idle_timeout_s=0.05)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(server.server_address[:2]) as idle:
            idle.settimeout(60.0)  # a bound for a server that never closes it
            assert idle.recv(1) == b""  # closed by the server, nothing sent
    finally:
        server.shutdown()
        server.server_close()


GOOD_METRICS = {"phase": "train", "step": 1, "reward": 1.0}
MALFORMED = {  # (a field of the trace record, or None) -> (its value, a metrics line)
    "a message that is text": ("messages", ["hi"], None),
    "an error that is a list": ("error", ["x"], None),
    "a prompt that is a number": ("prompt_text", 5, None),
    "a reward past float's range": ("reward", 10**400, None),
    "a metric that is text": (None, None, {**GOOD_METRICS, "reward": "high"}),
    "a metrics step that is a list": (None, None, {**GOOD_METRICS, "step": [1]}),
    "metrics steps of two types": (None, None, {**GOOD_METRICS, "step": "a"}),
    "a metrics record without a step": (None, None, {"phase": "train", "reward": 1.0}),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_record_of_the_wrong_shape_is_an_error_naming_its_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each exits 2 with the file's name (before: a traceback out of `jarl view`)."""
    field, value, metrics = MALFORMED[case]
    record = hostile_record("h/0", None)
    if field is not None:
        record[field] = value
    (tmp_path / TRACES_FILE).write_text(json.dumps(record) + "\n")
    lines = [GOOD_METRICS] + ([metrics] if metrics is not None else [])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert main(["view", str(tmp_path), "--out", str(tmp_path / "page")]) == 2
    named = "metrics.jsonl" if field is None else TRACES_FILE
    assert f"{tmp_path / named}: a record is not a" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--last", "0", "0 is not >= 1"),  # steps[-0:]: every step, the page --last bounds
        ("--last", "-3", "-3 is not >= 1"),  # every step but the first three
        ("--port", "-1", "-1 is not in [0, 65535]"),
    ],
)
def test_a_view_flag_out_of_range_is_refused_naming_it(
    flag: str, value: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--last 0`` read as no steps gave every traced step of the run (before: accepted), the
    page too large to open that --last is there to prevent."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["view", "run", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {problem}" in capsys.readouterr().err
    assert build_parser().parse_args(["view", "run", flag, "1"]).func is not None


def test_an_out_folder_that_cannot_hold_the_page_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out naming a file, or a folder under one: a traceback (FileExistsError,
    NotADirectoryError); now one line saying where the page could not be written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out in (a_file, a_file / "page"):
        assert main(["view", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write the page into {out}: ") and err.count("\n") == 1


def test_a_port_taken_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--port naming a port another process listens on: a traceback (OSError: Address
    already in use); now one line naming the address."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(run_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve on 127.0.0.1:{port}: ") and err.count("\n") == 1


def _roles_by_scan(pieces: list[str], mask: list[int], tool_texts: list[str]) -> str:
    """The view's token roles by the direct reading of its rule (each tool text found in turn
    in a mask-0 span, each token overlapping it ``t``): every token of the span is tested
    against every hit, which is quadratic."""
    out = ["s" if m else "p" for m in mask]
    texts, start = list(tool_texts), 0
    while start < len(pieces):
        end = start
        while end < len(pieces) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            text, ends = "".join(pieces[start:end]), [0]
            for piece in pieces[start:end]:
                ends.append(ends[-1] + len(piece))
            at = 0
            while texts and texts[0] and (hit := text.find(texts[0], at)) >= 0:
                stop = hit + len(texts.pop(0))
                for i in range(start, end):
                    if ends[i - start] < stop and ends[i - start + 1] > hit:
                        out[i] = "t"
                at = stop
        start = end
    return "".join(out)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.sampled_from(["", "a", "b", "ab", "ba", "aab"]), st.integers(0, 1))),
    st.lists(st.sampled_from(["", "a", "b", "ab", "aa", "bab"]), max_size=8),
)
def test_token_roles_are_those_of_the_rule_read_directly(
    tokens: list[tuple[str, int]], tool_texts: list[str]
) -> None:
    pieces, mask = [p for p, _ in tokens], [m for _, m in tokens]
    messages = [{"role": "tool", "content": t} for t in tool_texts]
    assert roles(pieces, mask, messages) == _roles_by_scan(pieces, mask, tool_texts)


@pytest.mark.timeout(60)  # a bound on a hang: the walk takes a fraction of a second
def test_many_tool_messages_in_one_span_are_shown_in_linear_time() -> None:
    """A traces file of 100,000 one-character tool messages in one span of as many tokens (3
    MB): every token was tested against every tool text found, minutes before the page was
    written (4,000 of them: a second)."""
    n = 100_000
    messages = [{"role": "tool", "content": "a"}] * n
    assert roles(["a"] * n, [0] * n, messages) == "t" * n
    assert roles(["a"] * n + ["b"], [0] * n + [1], messages[:10]) == "t" * 10 + "p" * (n - 10) + "s"


def _nested_record(field: str, depth: int) -> str:
    """A trace record whose ``field`` (``tool_calls`` of its assistant message when the field
    is ``message_calls``) is a list nested ``depth`` deep."""
    record = hostile_record("h/0", None)
    deep = "[" * depth + "]" * depth
    if field == "message_calls":
        record["messages"][1]["tool_calls"] = "DEEP"  # type: ignore[index]
    else:
        record[field] = "DEEP"
    return json.dumps(record).replace('"DEEP"', deep) + "\n"


@pytest.mark.parametrize(
    "field", ["num_turns", "tool_calls", "token_versions", "uid", "message_calls"]
)
def test_a_trace_record_nested_as_deep_as_the_reader_reads_is_a_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """``jarl view`` on a traces file whose record nests a value ever deeper: past what the
    reader reads, the RecursionError of reading it; just within it, the RecursionError of
    writing it out deeper (a count passed through into the page's JSON, a uid written as
    text, a message's calls written as JSON), a traceback either way. Each is refused naming
    the file (exit 2)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    traces = run_dir / TRACES_FILE
    lo, hi = 100, 5000  # the reader reads lo deep here, not hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        traces.write_text(_nested_record(field, mid))
        try:
            read_traces(traces)
            lo = mid
        except (RecursionError, ValueError):  # (before the fix; after it)
            hi = mid
    for depth in range(lo - 20, lo + 3):  # jarl view reads a few calls deeper than here
        traces.write_text(_nested_record(field, depth))
        assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) in (0, 2), depth
        err = capsys.readouterr().err
        assert not err or str(traces) in err, err


@pytest.mark.parametrize("versions", [[math.inf], [0, math.inf]])
def test_an_infinite_weight_version_is_a_trace_record_error_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], versions: list[float]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {**hostile_record("h/0", None), "weight_versions": versions}
    (run_dir / TRACES_FILE).write_text(json.dumps(record) + "\n")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / TRACES_FILE}: a record is not a trace record" in err


@pytest.mark.parametrize("step", [math.nan, math.inf, 1.5, "<b>", True])
def test_a_metrics_step_that_is_not_a_whole_number_is_an_error_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: object
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    metrics = {"phase": "train", "step": step, "reward": 1.0}
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics) + "\n")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / METRICS_FILE}: a record is not a metrics record" in err


BAD_TRACES = {
    "a record missing its fields": '{"step": 1, "uid": "u"}\n',
    "steps of text and of whole numbers": '{"step": "a"}\n{"step": 1}\n',
    "a field of another type": '{"step": 1, "uid": "u", "reward": 0, "stop_reason": "eos", '
    '"num_turns": 1, "tool_calls": 0, "malformed_calls": 0, "weight_versions": ["x", 1]}\n',
}


@pytest.mark.parametrize("text", BAD_TRACES.values(), ids=BAD_TRACES.keys())
def test_traces_of_a_malformed_file_name_it(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text(text)
    assert main(["traces", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a trace record" in err and TRACES_FILE in err
    assert "Traceback" not in err


def test_traces_skip_records_whose_step_is_not_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text('{"step": [1]}\n{"step": 2.5}\n')
    assert main(["traces", str(tmp_path)]) == 0
    assert "holds no traces yet" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["traces", "view"])
def test_a_number_past_int_digits_names_the_file_and_line(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / TRACES_FILE).write_text('{"step": 1}\n{"step": ' + "1" * 5000 + "}\n")
    out = ["--out", str(tmp_path / "page")] if command == "view" else []
    assert main([command, str(tmp_path), *out]) == 2
    err = " ".join(capsys.readouterr().err.split())  # (rich wraps no path: soft_wrap)
    assert f"{TRACES_FILE}: line 2 is not valid JSON" in err
