"""The tool server's Unix-socket transport (`jarl serve-tools --socket`), a real server process
with the real sandbox: the same calls answer the same over HTTP and the socket, the token is
checked on both, and the socket's bounds (private directory, frame size, frame time) hold."""

import asyncio
import contextlib
import json
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import ToolRegistry, ToolTransportError
from jax_agent_rl.tools.server import serve
from tests.tools.test_server import TOOLS_YAML, killed_mid_call, start_server

WITH_PYTHON = TOOLS_YAML + (
    "- class: jax_agent_rl.tools.sandbox:PythonTool\n  config: {pool_size: 2, timeout_s: 5.0}\n"
)


def _serve(tmp_path: Path, *extra: str) -> tuple[Any, str, str]:
    sock = tmp_path / "tools.sock"
    proc, url = start_server(tmp_path, "--socket", str(sock), *extra, tools_yaml=WITH_PYTHON)
    return proc, url, f"unix:{sock}"


async def _scenario(tools: HttpTools, prefix: str) -> list[Any]:
    """Calls of every kind; trajectory ids carry ``prefix`` so each transport starts fresh."""
    out: list[Any] = [[s["function"]["name"] for s in await tools.schemas()]]
    out.append(await tools.call(f"{prefix}1", "calculator", {"expression": "6 * 7"}))
    out += [await tools.call(f"{prefix}1", "count", {}) for _ in range(3)]  # sticky state
    out.append(await tools.call(f"{prefix}2", "count", {}))
    out.append(await tools.call(f"{prefix}1", "crash", {"x": 1}))
    code = "import fractions\nprint(fractions.Fraction(3, 4) + fractions.Fraction(1, 6))"
    out.append(await tools.call(f"{prefix}3", "python", {"code": code}))
    # a forked process fails too: the child's traceback, then the parent's (it waits first,
    # so that the two never interleave)
    fork = "import os\npid = os.fork()\nif pid:\n    os.waitpid(pid, 0)\n1/0"
    out.append(await tools.call(f"{prefix}3", "python", {"code": fork}))
    # a hanging call does not hold back the calls behind it on the same connection
    hang = asyncio.create_task(tools.call(f"{prefix}4", "slow", {"seconds": 30.0}))
    await asyncio.sleep(0)
    out += await asyncio.gather(
        *(tools.call(f"{prefix}5", "calculator", {"expression": f"{i} + 1"}) for i in range(8))
    )
    assert not hang.done()
    out.append(await hang)
    for t in range(1, 6):
        await tools.release(f"{prefix}{t}")
    metrics = await tools.metrics()
    out.append(metrics["open_trajectories"])
    await tools.close()
    return out


def test_same_answers_over_http_and_socket(tmp_path: Path) -> None:
    proc, url, unix = _serve(tmp_path)
    try:
        assert stat.S_IMODE(Path(unix.removeprefix("unix:")).stat().st_mode) == 0o600
        over_http = asyncio.run(_scenario(HttpTools(url), "h"))
        over_unix = asyncio.run(_scenario(HttpTools(unix), "u"))
    finally:
        proc.kill()
        proc.wait()
    assert over_unix == over_http
    assert over_unix[1].text == "42" and [r.text for r in over_unix[2:5]] == ["1", "2", "3"]
    assert over_unix[7].text == "11/12" and not over_unix[7].error
    assert over_unix[8].error and "ZeroDivisionError" in over_unix[8].text
    assert "timed out after 3s" in over_unix[-2].text and over_unix[-1] == 0


def test_token_checked_on_both(tmp_path: Path) -> None:
    proc, url, unix = _serve(tmp_path, "--token", "s3cret")

    async def calls(target: str, token: str | None) -> Any:
        tools = HttpTools(target, token=token, retries=0)
        try:
            return await tools.call("t", "calculator", {"expression": "1 + 1"})
        finally:
            await tools.close()

    try:
        for target in (url, unix):
            assert asyncio.run(calls(target, "s3cret")).text == "2"
            for wrong in ("nope", None):
                with pytest.raises(ToolTransportError, match=r"401|token"):
                    asyncio.run(calls(target, wrong))
    finally:
        proc.kill()
        proc.wait()


def test_socket_only_in_a_private_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="closed to others"):
        serve(ToolRegistry(), port=0, socket_path=str(shared / "tools.sock"))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "tools.sock").write_text("not a socket")
    with pytest.raises(ValueError, match="something else is there"):
        serve(ToolRegistry(), port=0, socket_path=str(private / "tools.sock"))


def _frame(obj: Any) -> bytes:
    """A frame of ``obj`` as JSON, or of ``obj`` itself if bytes (a frame that is not JSON)."""
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _answers(conn: socket.socket) -> list[Any]:
    """Every frame the server sends until it closes the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    out = []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        out.append(json.loads(data[4 : 4 + n]))
        data = data[4 + n :]
    return out


def test_socket_bounds(tmp_path: Path) -> None:
    proc, _, unix = _serve(tmp_path, "--max-body-bytes", "1000", "--body-timeout", "1")
    path = unix.removeprefix("unix:")
    try:
        with socket.socket(socket.AF_UNIX) as conn:  # a frame over the cap
            conn.connect(path)
            conn.sendall(_frame({"token": None}) + struct.pack(">I", 5000))
            hello, refused = _answers(conn)
            assert hello == {"ok": True, "max_frame_bytes": 1000}
            assert "over the cap of 1000 bytes" in refused["error"]
        with socket.socket(socket.AF_UNIX) as conn:  # a frame that never ends
            conn.connect(path)
            conn.sendall(_frame({"token": None}) + struct.pack(">I", 100) + b"{")
            hello, late = _answers(conn)
            assert "not received within 1s" in late["error"]
        with socket.socket(socket.AF_UNIX) as conn:  # a request of the wrong shape
            conn.connect(path)
            conn.sendall(_frame({"token": None}) + _frame({"op": "execute"}))
            hello, wrong = _answers(conn)
            assert '{"id": int' in wrong["error"]
        with socket.socket(socket.AF_UNIX) as conn:  # a bad call fails alone
            conn.connect(path)
            bad = {"id": 1, "op": "execute", "body": {"name": "calculator"}}
            good = {"id": 2, "op": "tools", "body": {}}
            conn.sendall(_frame({"token": None}) + _frame(bad) + _frame(good))
            conn.shutdown(socket.SHUT_WR)
            hello, *answers = _answers(conn)
            by_id = {a["id"]: a for a in answers}
            assert "ValidationError" in by_id[1]["error"] and len(by_id[2]["result"]) == 5
    finally:
        proc.kill()
        proc.wait()


def test_server_killed_mid_call_over_socket(tmp_path: Path) -> None:
    proc, _, unix = _serve(tmp_path, "--timeout", "3600")
    results = asyncio.run(killed_mid_call(proc, unix))
    assert all(isinstance(r, ToolTransportError) for r in results)
    assert "unreachable" in str(results[4])


def _hello(conn: socket.socket) -> Any:
    """The first frame answering ``conn``'s hello (None if the server closes first)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused at once
        conn.sendall(_frame({"token": None}))
    head = conn.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return json.loads(conn.recv(n, socket.MSG_WAITALL))


def _first_answer(path: str) -> Any:
    """A new connection's answer to its hello."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(path)
        return _hello(conn)


def _connect_when_free(path: str) -> socket.socket:
    """A connection the server took (answered its hello ok), once it has a place free: one
    just closed gives its place back when the server has seen it go."""
    deadline = time.monotonic() + 60  # a bound for failing, not a wait
    while True:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(path)
        if (answer := _hello(conn)).get("ok"):
            return conn
        conn.close()
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)


def test_a_connection_holds_its_place_until_it_is_gone(tmp_path: Path) -> None:
    """A client cannot leave calls queued, answers buffered or sockets open past
    ``max_connections`` by breaking the protocol (or dropping the connection) and coming back:
    the connection counts until its calls end and it is gone."""
    proc, url, unix = _serve(tmp_path, "--max-connections", "2", "--timeout", "600")
    path = unix.removeprefix("unix:")
    refused = {"error": "too many connections (max_connections)"}
    slow = {"trajectory_id": "s", "name": "slow", "arguments": {"seconds": 3600.0}}
    keeper = socket.socket(socket.AF_UNIX)  # one of the two places (HTTP needs 2 to answer)
    try:
        keeper.connect(path)  # a call in flight: never closed as idle
        keeper.sendall(_frame({"token": None}) + _frame({"id": 1, "op": "execute", "body": slow}))
        # deep nesting, before the token even: a protocol error like any other frame
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(path)
            conn.sendall(_frame(b"[" * 100_000 + b"]" * 100_000))
            [deep] = _answers(conn)
            assert "not JSON" in deep["error"]
        # a client that never reads its (large) answers, then breaks the protocol
        unread = _connect_when_free(path)
        big = {"trajectory_id": "u", "name": "n" * 2**22}  # answered with the name: 4 MiB
        for i in range(3):
            unread.sendall(_frame({"id": i, "op": "execute", "body": big}))
        unread.sendall(struct.pack(">I", 1) + b"x")
        # its place is held while it is open (the server cannot be done writing to it) ...
        # (the server may not have read the bad frame yet: the running call's case below is
        # the one that fails without the fix whatever the timing)
        assert _first_answer(path) == refused
        unread.close()
        # ... and given back once it is gone
        # a call still running, then the protocol broken: answered and closed at once, but
        # the place is held while the call runs (it ends as on HTTP: nothing stops it)
        with _connect_when_free(path) as conn:
            conn.sendall(_frame({"id": 1, "op": "execute", "body": slow}))
            conn.sendall(struct.pack(">I", 1) + b"x")
            [broken] = _answers(conn)
            assert "not JSON" in broken["error"]
        assert _first_answer(path) == refused
        assert httpx.get(url + "/metrics", timeout=10).json()["in_flight"] == 2
    finally:
        keeper.close()
        proc.kill()
        proc.wait()


GARBAGE = {  # what a broken or hostile server answers: (hello, answer to the call)
    "hello not an object": (_frame([1]), None),
    "hello nested too deep": (_frame(b"[" * 100_000 + b"]" * 100_000), None),
    "answer not an object": (_frame({"ok": True}), lambda rid: _frame([rid])),
    "answer id not an int": (_frame({"ok": True}), lambda rid: _frame({"id": [rid]})),
    "answer nested too deep": (
        _frame({"ok": True}),
        lambda rid: _frame(b'{"id": %d, "result": ' % rid + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ),
    "answer without a result": (_frame({"ok": True}), lambda rid: _frame({"id": rid})),
    "result not a result": (
        _frame({"ok": True}),
        lambda rid: _frame({"id": rid, "result": {"bogus": 1}}),
    ),
    "result a list": (_frame({"ok": True}), lambda rid: _frame({"id": rid, "result": [1]})),
}


@pytest.mark.parametrize("case", list(GARBAGE))
def test_client_against_a_broken_server(tmp_path: Path, case: str) -> None:
    """Whatever a server answers, a call fails only with `ToolTransportError` (what the agent
    loop ends a trajectory on) and closing the client raises nothing."""
    hello, answer = GARBAGE[case]
    path = str(tmp_path / "broken.sock")

    async def serve_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(n)
        writer.write(hello)
        if answer is not None:
            (n,) = struct.unpack(">I", await reader.readexactly(4))
            writer.write(answer(json.loads(await reader.readexactly(n))["id"]))
        await reader.read()  # until the client closes
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(serve_garbage, path=path)
        tools = HttpTools(f"unix:{path}", retries=0, timeout_s=60)
        try:
            with pytest.raises(ToolTransportError):
                await tools.call("t", "calculator", {"expression": "1"})
        finally:
            await tools.close()
            server.close()

    asyncio.run(scenario())
