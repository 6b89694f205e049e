"""The tool server's Unix-socket transport (`jarl serve-tools --socket`), a real server process
with the real sandbox: the same calls answer the same over HTTP and the socket, the token is
checked on both, and the socket's bounds (private directory, frame size, frame time) hold."""

import asyncio
import json
import socket
import stat
import struct
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.tools.registry import ToolRegistry, ToolTransportError
from jax_agent_rl.tools.server import HttpTools, serve
from tests.tools.test_server import TOOLS_YAML, start_server

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
    body = json.dumps(obj).encode()
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
            assert hello == {"ok": True} and "over the cap of 1000 bytes" in refused["error"]
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
    proc, _, unix = _serve(tmp_path)
    tools = HttpTools(unix, retries=2, backoff_s=0.05)

    async def scenario() -> list[Any]:
        calls = [
            asyncio.create_task(tools.call(f"k{i}", "slow", {"seconds": 0.8})) for i in range(4)
        ]
        await asyncio.sleep(0.3)
        proc.kill()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.to_thread(proc.wait)
        results += await asyncio.gather(tools.call("k9", "count", {}), return_exceptions=True)
        await tools.release("k0")  # releasing against a dead server is not an error
        return results

    results = asyncio.run(scenario())
    assert all(isinstance(r, ToolTransportError) for r in results)
    assert "unreachable" in str(results[4])
