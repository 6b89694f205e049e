"""The tool server against hostile or careless clients: trajectories never released, more
trajectories than the server holds, request bodies too large, bodies sent too slowly, more
connections than the server serves, another client's trajectory ids, ids and batches too
large, actions of too many calls, a guessed token, and the routes that answer without one.
Beside each attack, a normal client's calls stay exact.

Expiry runs on a fake clock (and a sweep woken by the test), so no test waits on real time;
the slow-body test only waits for the server's verdict.

Calls made in one event-loop tick share one ``/execute_batch`` request, and what one call
brought into it broke its siblings' calls: a tool's result whose reward or flags were NumPy's
(``np.float32(...)``, the ``bool_`` of ``np.isclose``: a careful user's grader) did not
serialize, and the answer to the batch broke off at it; ten calls of 1 MB each (a file a tool
writes), each well within the server's bound on a body (8 MiB), made a body over it, which
the server cut off as it came, and the client read a broken connection, not the 413 it splits
a batch on. Either way every call of the batch, siblings' too, raised `ToolTransportError`
(``tool_error``). The executor now hands on plain values (a float reward, bool flags), a
result that is no `ToolResult`, or whose text is no string, is the call's error result, and a
batch carries at most `BATCH_BYTES` (1 MiB) of calls, a longer call going alone."""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.cli.commands import build_parser
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.base import Tool, ToolResult, tool
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.client import BATCH_BYTES, HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry, ToolTransportError
from tests.tools.test_server import loaded_tokenizer, serving, start_server
from tests.tools.test_tools import Counter
from tests.tools.test_verl_tools import sandbox_processes


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Held(Tool):
    """A stateful tool whose calls wait until the test opens ``gate``; records releases."""

    def __init__(self) -> None:
        self.name = "held"
        self.schema = {
            "type": "function",
            "function": {
                "name": "held",
                "description": "Wait for the gate.",
                "parameters": {"type": "object", "properties": {}, "required": []},
            },
        }
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.released: list[str] = []

    async def create(self, trajectory_id: str) -> str:
        return trajectory_id

    async def execute(self, state: str, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        self.entered.set()
        await self.gate.wait()
        return ToolResult(f"held {state}")

    async def release(self, state: str) -> None:
        self.released.append(state)


def released_ids(counter: Counter) -> list[str]:
    return sorted(s["id"] for s in counter.released)


def test_idle_trajectories_expire_through_their_tools_release() -> None:
    clock, counter = FakeClock(), Counter()
    tools = LocalTools(ToolRegistry([counter]), idle_timeout_s=60.0, clock=clock)

    async def scenario() -> None:
        for i in range(5):
            await tools.call(f"t{i}", "count", {})
        clock.now = 30.0
        assert (await tools.call("t0", "count", {})).text == "2"  # t0's last call ends at 30
        assert tools.open_trajectories == 5 and counter.released == []
        clock.now = 60.0  # t1..t4 idle for 60 s: expired by the next call, whoever makes it
        await tools.call("fresh", "count", {})
        assert released_ids(counter) == ["t1", "t2", "t3", "t4"]
        assert tools.open_trajectories == 2 and tools.expired == 4
        # an expired trajectory that calls again starts from fresh state
        assert (await tools.call("t1", "count", {})).text == "1"
        clock.now = 200.0  # everything idle: expire_idle (the server's sweep) frees it all
        await tools.expire_idle()
        assert released_ids(counter) == ["fresh", "t0", "t1", "t1", "t2", "t3", "t4"]
        assert tools.open_trajectories == 0 and tools.expired == 7

    asyncio.run(scenario())


def test_a_trajectory_with_a_call_in_flight_is_never_expired() -> None:
    clock, counter, held = FakeClock(), Counter(), Held()
    tools = LocalTools(ToolRegistry([counter, held]), idle_timeout_s=60.0, clock=clock)

    async def scenario() -> None:
        await tools.call("busy", "count", {})
        call = asyncio.create_task(tools.call("busy", "held", {}))
        await held.entered.wait()
        clock.now = 1000.0  # far past the timeout, but busy's call has not ended
        await tools.expire_idle()
        await tools.call("other", "count", {})
        assert counter.released == [] and held.released == []
        assert tools.open_trajectories == 2 and tools.expired == 0
        held.gate.set()
        assert (await call).text == "held busy"  # the call ends at 1000: idle from then on
        assert (await tools.call("busy", "count", {})).text == "2"  # its state lived on
        clock.now = 1060.0
        await tools.expire_idle()
        assert released_ids(counter) == ["busy", "other"] and held.released == ["busy"]
        assert tools.open_trajectories == 0 and tools.expired == 2

    asyncio.run(scenario())


def test_the_trajectory_cap_expires_idle_ones_then_refuses_new_ones() -> None:
    clock, counter = FakeClock(), Counter()
    tools = LocalTools(
        ToolRegistry([counter]), idle_timeout_s=60.0, max_trajectories=2, clock=clock
    )

    async def scenario() -> None:
        await tools.call("a", "count", {})
        clock.now = 30.0
        await tools.call("b", "count", {})
        refused = await tools.call("c", "count", {})
        assert refused.error and "max_trajectories=2" in refused.text
        assert counter.created == ["a", "b"] and tools.open_trajectories == 2
        assert (await tools.call("a", "count", {})).text == "2"  # open ones go on as before
        clock.now = 90.0  # b idle for 60 s: expired to make room; a (idle 60 s too) as well
        assert (await tools.call("c", "count", {})).text == "1"
        assert released_ids(counter) == ["a", "b"] and tools.expired == 2
        await tools.call("d", "count", {})
        assert (await tools.call("e", "count", {})).error  # full again, nothing idle long
        await tools.release("c")  # a finished trajectory frees its slot at once
        assert (await tools.call("e", "count", {})).text == "1"

    asyncio.run(scenario())


def test_the_server_sweep_frees_idle_state_with_no_traffic() -> None:
    """The app's lifespan runs a sweep; the test wakes it instead of letting time pass."""
    clock, counter = FakeClock(), Counter()
    asleep: asyncio.Queue[float] = asyncio.Queue()
    wake: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(seconds: float) -> None:
        await asleep.put(seconds)
        await wake.get()

    app = create_app(ToolRegistry([counter]), idle_timeout_s=60.0, clock=clock, sleep=sleep)

    async def scenario() -> dict[str, Any]:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http,
        ):
            assert await asleep.get() == 30.0  # it sweeps every idle_timeout_s / 2
            for i in range(3):
                body = {"trajectory_id": f"t{i}", "name": "count", "arguments": {}}
                assert (await http.post("/execute", json=body)).json()["text"] == "1"
            clock.now = 60.0
            assert counter.released == []  # nothing happens without the sweep or a call
            await wake.put(None)
            await asleep.get()  # one sweep done; it sleeps again
            # (keyed in the unnamed namespace, as the server keys them: "/" + id)
            assert released_ids(counter) == ["/t0", "/t1", "/t2"]
            return dict((await http.get("/metrics")).json())

    metrics = asyncio.run(scenario())
    assert metrics["expired"] == 3 and metrics["open_trajectories"] == 0


@pytest.fixture
def capped_server(tmp_path: Path) -> Iterator[str]:
    proc, url = start_server(tmp_path, "--max-body-bytes", "4096", "--body-timeout", "1")
    yield url
    proc.kill()
    proc.wait()


def test_a_body_over_the_cap_gets_413(capped_server: str) -> None:
    call = b'{"trajectory_id": "t", "name": "calculator", "arguments": {"expression": "1+1"}}'
    headers = {"content-type": "application/json"}
    ok = httpx.post(capped_server + "/execute", content=call, headers=headers)
    assert ok.status_code == 200 and ok.json()["text"] == "2"
    declared = httpx.post(capped_server + "/execute", content=b" " * 5000, headers=headers)
    assert declared.status_code == 413 and "4096" in declared.text
    chunks = (b" " * 1000 for _ in range(6))  # no Content-Length: sent chunked
    streamed = httpx.post(capped_server + "/execute", content=chunks, headers=headers)
    assert streamed.status_code == 413 and "4096" in streamed.text
    assert httpx.get(capped_server + "/health").status_code == 200


def test_a_body_sent_too_slowly_gets_408_and_the_connection_closes(capped_server: str) -> None:
    port = int(capped_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"traj'
        )
        answer = b""
        while chunk := s.recv(4096):  # blocks until the server answers and closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in answer.lower()
    assert httpx.get(capped_server + "/health").status_code == 200


@pytest.mark.parametrize("head", ["count", "bytes"])
def test_a_request_with_too_many_headers_gets_431(capped_server: str, head: str) -> None:
    """5,000 one-byte headers (FastAPI scans all of them once per header a route declares)
    held the server's one event loop 2.3 s, 16,000 for 27 s, without a token; 17 KB of one
    header was served too."""
    port = int(capped_server.rsplit(":", 1)[1])
    lines = [b"X-A: b"] * 5000 if head == "count" else [b"X-A: " + b"b" * 17_000]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET /tools HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"\r\n".join(lines) + b"\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):  # the answer closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request headers over 100 or 16384 bytes" in answer
    assert httpx.get(capped_server + "/health").status_code == 200


@pytest.mark.parametrize("where", ["a header", "trailers"])
def test_a_head_past_the_parser_s_bound_closes_the_connection(
    capped_server: str, where: str
) -> None:
    """What `BodyLimit` counts had been parsed whole first: one 64 MB header sent in 64 KB
    pieces cost httptools 8 s of the one event loop (each piece copied the value so far), and
    16,000 trailers sent after a chunked body joined the headers after the count (10 s of
    FastAPI's scans). The parser stops at 64 KiB of an unfinished head or trailer block: 400,
    and the connection closed, before the app runs."""
    port = int(capped_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        if where == "a header":
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
            pieces = (b"b" * 65536 for _ in range(16))  # 1 MB, never ended
        else:
            s.sendall(
                b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: application/json\r\n\r\n2\r\n{}\r\n0\r\n"
            )
            pieces = (b"X-T: b\r\n" * 1000 for _ in range(16))  # 16,000 trailers
        try:
            for piece in pieces:
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection while the client wrote
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 400 ") or answer == b"", answer[:200]
    assert httpx.get(capped_server + "/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"zz\r\n{}\r\n0\r\n\r\n", b"illegal chunk header"),
        (b"5\r\n{}\r\n0\r\n\r\n", b"illegal chunk header"),  # a chunk shorter than said
        (b"2\r\n{}XX0\r\n\r\n", b"malformed chunk footer"),
    ],
)
def test_a_malformed_chunked_body_is_told_what_is_wrong(
    capped_server: str, body: bytes, why: bytes
) -> None:
    """uvicorn answered every request h11 refused with "Invalid HTTP request received.", a
    malformed chunked body as a malformed head: the 400 now names what h11 found, and the
    connection closes; the server serves on."""
    port = int(capped_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\n\r\n" + body
        )
        answer = b""
        while chunk := s.recv(4096):  # the answer closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"Invalid HTTP request received: " + why in answer, answer
    assert httpx.get(capped_server + "/health").status_code == 200


def test_requests_past_the_connection_limit_get_503(tmp_path: Path) -> None:
    proc, url = start_server(tmp_path, "--max-connections", "2")
    port = int(url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as held:
            held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert held.recv(4096).startswith(b"HTTP/1.1 200 ")  # answered, and kept open
            assert httpx.get(url + "/health").status_code == 503  # a second connection: full
    finally:
        proc.kill()
        proc.wait()


def test_an_http_client_that_takes_no_answer_loses_its_connection() -> None:
    """A client that sent calls with large answers and read none of them held its connection
    for good (uvicorn waits on a paused write with no deadline): such clients filled the
    connection limit, and /health answered 503 for as long as they stayed. Writes paused past
    the body timeout drop the connection (the server as `jarl serve-tools` configures it),
    and the slot is free again."""
    import uvicorn

    from jax_agent_rl.tools.server import server_config

    async def big() -> str:
        """A large answer."""
        return "x" * 2_000_000

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        hog = socket.socket()
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting)
        hog.bind(("127.0.0.1", 0))
        hog.setblocking(False)
        hog_port = hog.getsockname()[1]
        made, lost = asyncio.Event(), asyncio.Event()
        app = create_app(ToolRegistry([tool(big)]), max_connections=2, body_timeout_s=1.0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = server_config(app, "127.0.0.1", port, max_connections=2, write_timeout_s=1.0)
        served = cast(Any, config.http)

        class Watched(served):  # type: ignore[misc,valid-type]
            """The server's protocol, telling when the hog's connection comes and goes."""

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                if transport.get_extra_info("peername")[1] == hog_port:
                    made.set()

            def connection_lost(self, exc: Exception | None) -> None:
                if self.client and self.client[1] == hog_port:
                    lost.set()
                super().connection_lost(exc)

        config.http = Watched
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await loop.sock_connect(hog, ("127.0.0.1", port))
            call = json.dumps({"trajectory_id": "t", "name": "big", "arguments": {}})
            request = (
                "POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(call)}\r\n\r\n{call}"
            ).encode()
            await loop.sock_sendall(hog, request * 8)  # 16 MB of answers, none read
            await asyncio.wait_for(made.wait(), 60)
            await asyncio.wait_for(lost.wait(), 60)  # dropped by the server (the bound: 60 s)
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://127.0.0.1:{port}/health")).status_code
        finally:
            hog.close()
            server.should_exit = True
            await task
            sock.close()

    assert asyncio.run(scenario()) == 200


# ----------------------------------------------------------------------------- other clients

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One server (with a token, and its Unix socket) that the tests below share, as runs
    share one; their trajectory ids never repeat across tests, and they count by differences.
    Yields its HTTP URL and its ``unix:`` address."""
    where = tmp_path_factory.mktemp("shared")
    sock = where / "tools.sock"
    proc, url = start_server(where, "--token", TOKEN, "--socket", str(sock))
    yield url, f"unix:{sock}"
    proc.kill()
    proc.wait()


async def _counts(tools: HttpTools, trajectory_id: str, n: int) -> list[str]:
    return [(await tools.call(trajectory_id, "count", {})).text for _ in range(n)]


def _metrics(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/metrics", headers=AUTH).json())


def test_another_client_never_reaches_a_trajectorys_state(shared_server: tuple[str, str]) -> None:
    """A second run on the same server, its trajectory ids the same as the first's (over HTTP
    and the socket), a client calling the routes by hand, and verl-tool's client: each has
    its own state, and none of their releases touches the first run's."""
    url, unix = shared_server
    verl_finish = {"trajectory_ids": ["t"], "actions": [""], "finish": [True]}

    async def scenario() -> list[Any]:
        run, second, over_socket = (HttpTools(a, token=TOKEN) for a in (url, url, unix))
        out: list[Any] = [await _counts(run, "t", 2)]
        out.append(await _counts(second, "t", 1) + await _counts(over_socket, "t", 1))
        await second.release("t")
        await over_socket.release("t")
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:  # no namespace
            body = {"trajectory_id": "t", "name": "count", "arguments": {}}
            out.append((await raw.post("/execute", json=body)).json()["text"])
            await raw.post("/release", json={"trajectory_id": "t"})
            await raw.post("/get_observation", json=verl_finish)
            for namespace in ("other-run", "x" * 64):  # a proxy naming a verl-tool client's
                headers = {"X-Tool-Namespace": namespace}
                await raw.post("/get_observation", json=verl_finish, headers=headers)
            out.append(await _counts(run, "t", 1))  # the first run's state lived on
        await run.release("t")
        for tools in (run, second, over_socket):
            await tools.close()
        return out

    assert asyncio.run(scenario()) == [["1", "2"], ["1", "1"], "1", ["3"]]


def test_a_malformed_namespace_is_refused(shared_server: tuple[str, str]) -> None:
    url, unix = shared_server
    body = {"trajectory_id": "ns", "name": "count", "arguments": {}}
    for namespace in ("a/b", "x" * 65, "a.b"):
        headers = {**AUTH, "X-Tool-Namespace": namespace}
        refused = httpx.post(url + "/execute", json=body, headers=headers)
        assert refused.status_code == 422 and "0-64 characters" in refused.text
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(unix.removeprefix("unix:"))
        conn.sendall(_frame({"token": TOKEN, "namespace": "a/b"}))
        assert "0-64 characters" in _read_frame(conn)["error"]
        assert conn.recv(1) == b""  # and closed


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _read_frame(conn: socket.socket) -> Any:
    (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
    return json.loads(conn.recv(n, socket.MSG_WAITALL))


# ----------------------------------------------------------------------------- request caps

MAX_ID_BYTES, MAX_BATCH_CALLS, MAX_ACTION_CALLS = 256, 1024, 32  # serve-tools' defaults


def test_trajectory_ids_over_the_cap_are_refused(shared_server: tuple[str, str]) -> None:
    """Ids of 2 MB (each would be held as long as its state) are refused on every route that
    takes one, over HTTP and the socket; an id of the cap's bytes is served."""
    url, unix = shared_server
    cap = f"over the cap of {MAX_ID_BYTES} bytes (max_id_bytes)"
    big = "x" * 2**21
    routes = {
        "/execute": {"trajectory_id": big, "name": "count", "arguments": {}},
        "/release": {"trajectory_id": big},
        "/execute_batch": {
            "calls": [
                {"trajectory_id": "fine", "name": "count", "arguments": {}},
                {"trajectory_id": big, "name": "count", "arguments": {}},
            ]
        },
        "/get_observation": {"trajectory_ids": ["fine", big], "actions": ["", ""]},
    }

    async def scenario() -> list[Any]:
        run = HttpTools(url, token=TOKEN)
        out: list[Any] = [await _counts(run, "ids", 1)]
        before = _metrics(url)
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
            for route, body in routes.items():
                refused = await raw.post(route, json=body)
                assert refused.status_code == 422 and cap in refused.text, route
        for address in (url, unix):
            attacker = HttpTools(address, token=TOKEN, retries=0)
            for trajectory_id in (big, "é" * (MAX_ID_BYTES // 2 + 1)):  # bytes, not characters
                with pytest.raises(ToolTransportError, match=r"max_id_bytes"):
                    await attacker.call(trajectory_id, "count", {})
            assert (await attacker.call("y" * MAX_ID_BYTES, "count", {})).text == "1"
            await attacker.release("y" * MAX_ID_BYTES)
            await attacker.close()
        after = _metrics(url)
        out.append(after["open_trajectories"] - before["open_trajectories"])
        out.append(after["calls"] - before["calls"])  # the two at the cap: nothing else ran
        out.append(await _counts(run, "ids", 1))
        await run.release("ids")
        await run.close()
        return out

    assert asyncio.run(scenario()) == [["1"], 0, 2, ["2"]]


def test_an_empty_trajectory_id_is_refused(shared_server: tuple[str, str]) -> None:
    """An empty id was served, so every client that sent one (a harness that lost its ids)
    shared one state: one's counter, files and interpreter were the other's. Refused on every
    route that takes an id, over HTTP and the socket, before any call runs."""
    url, unix = shared_server
    routes = {
        "/execute": {"trajectory_id": "", "name": "count", "arguments": {}},
        "/release": {"trajectory_id": ""},
        "/execute_batch": {
            "calls": [
                {"trajectory_id": "fine", "name": "count", "arguments": {}},
                {"trajectory_id": "", "name": "count", "arguments": {}},
            ]
        },
        "/get_observation": {"trajectory_ids": ["fine", ""], "actions": ["", ""]},
    }

    async def scenario() -> float:
        before = _metrics(url)
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
            for route, body in routes.items():
                refused = await raw.post(route, json=body)
                assert refused.status_code == 422, route
                assert "an empty trajectory id" in refused.text, route
        for address in (url, unix):
            client = HttpTools(address, token=TOKEN, retries=0)
            with pytest.raises(ToolTransportError, match="an empty trajectory id"):
                await client.call("", "count", {})
            await client.close()
        return _metrics(url)["calls"] - before["calls"]

    assert asyncio.run(scenario()) == 0


def test_calls_per_request_and_per_action_are_capped(shared_server: tuple[str, str]) -> None:
    """A batch of more calls than the cap, or a verl-tool request of more trajectories, is
    refused whole before any call runs; an action of more calls than its cap runs none of them
    and reads as an error, while the request's other actions are answered."""
    url, _ = shared_server
    call = {"trajectory_id": "flood", "name": "calculator", "arguments": {"expression": "1+1"}}
    flood = {"calls": [call] * (MAX_BATCH_CALLS + 1)}
    n = MAX_BATCH_CALLS + 1
    many = {"trajectory_ids": [f"v{i}" for i in range(n)], "actions": [""] * n}
    one = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    action = {"trajectory_ids": ["long", "short"], "actions": [one * (MAX_ACTION_CALLS + 1), one]}

    async def scenario() -> list[Any]:
        run = HttpTools(url, token=TOKEN)
        out: list[Any] = [await _counts(run, "calls", 1)]
        before = _metrics(url)["calls"]
        refused = httpx.post(url + "/execute_batch", json=flood, headers=AUTH)
        assert refused.status_code == 422
        assert (
            f"{MAX_BATCH_CALLS + 1} calls in one request, over the cap of {MAX_BATCH_CALLS} "
            "(max_batch_calls)"
        ) in refused.text
        refused = httpx.post(url + "/get_observation", json=many, headers=AUTH)
        assert refused.status_code == 422 and "(max_batch_calls)" in refused.text
        assert _metrics(url)["calls"] == before  # nothing ran
        answer = httpx.post(url + "/get_observation", json=action, headers=AUTH).json()
        out.append(_metrics(url)["calls"] - before)  # the short action's one call
        out.append(answer)
        out.append(await _counts(run, "calls", 1))
        # a normal client's batches (calls of one event-loop tick) are served as ever
        texts = await asyncio.gather(
            *(run.call(f"b{i}", "calculator", {"expression": f"{i}+1"}) for i in range(40))
        )
        out.append([r.text for r in texts])
        for trajectory_id in ("calls", *(f"b{i}" for i in range(40))):
            await run.release(trajectory_id)
        await run.close()
        return out

    why = (
        f"{MAX_ACTION_CALLS + 1} tool calls in one action, over the cap of {MAX_ACTION_CALLS} "
        "(max_action_calls); none ran"
    )
    assert asyncio.run(scenario()) == [
        ["1"],
        1,
        {
            "observations": [
                {
                    "obs": f"<tool_response>\nerror: {why}\n</tool_response>",
                    "reward": None,
                    "invalid_reason": why,
                },
                {"obs": "<tool_response>\n6\n</tool_response>", "reward": 0.0},
            ],
            "dones": [False, False],
            "valids": [False, True],
        },
        ["2"],
        [str(i + 1) for i in range(40)],
    ]


def test_arguments_no_json_writer_takes_fail_only_their_own_call(tmp_path: Path) -> None:
    """Arguments a strict JSON writer refuses (NaN, a lone surrogate: a custom loop's, or a
    parser's that let them through) are that call's error result, on both transports; the
    calls batched with it in one HTTP request are answered. (They once failed the batch's
    encoding, and every call of the batch, other trajectories' included, waited forever.)"""
    sock = tmp_path / "tools.sock"
    app = create_app(ToolRegistry([calculator]), socket_path=str(sock))

    async def scenario() -> list[Any]:
        out: list[Any] = []
        async with serving(app) as url:
            for address in (url, f"unix:{sock}"):
                tools = HttpTools(address)
                for bad in (float("nan"), "\ud800"):
                    calls = [
                        tools.call("bad", "calculator", {"expression": bad}),
                        tools.call("sibling", "calculator", {"expression": "1+1"}),
                    ]
                    # (a guard far above the milliseconds this takes: a hang fails, not stalls)
                    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
                    out.append([(r.error, r.text.split(": ")[:2]) for r in results])
                for trajectory_id in ("bad", "sibling"):
                    await tools.release(trajectory_id)
                await tools.close()
        return out

    refused = (True, ["error", "the arguments of calculator are not JSON"])
    assert asyncio.run(scenario()) == [[refused, (False, ["2"])]] * 4


# ----------------------------------------------------------------------------- the token


def test_routes_answer_nothing_without_the_token(shared_server: tuple[str, str]) -> None:
    """Only ``/health`` answers without the token, and it says ok and nothing more: no tool
    names, no version, no metrics, no API description; the docs routes are not served."""
    url, _ = shared_server
    health = httpx.get(url + "/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    for route in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        for headers in ({}, AUTH):
            assert httpx.get(url + route, headers=headers).status_code == 404, route
    for route in ("/tools", "/metrics"):
        assert httpx.get(url + route).status_code == 401
        assert httpx.get(url + route, headers={"Authorization": "Bearer s3creT"}).status_code == 401
    assert len(httpx.get(url + "/tools", headers=AUTH).json()) == 4
    # two of one (the first one was read; a proxy in front may have checked the other)
    for twice in (
        [("Authorization", "Bearer nope"), *AUTH.items()],
        [*AUTH.items(), ("X-Tool-Namespace", "a"), ("X-Tool-Namespace", "b")],
    ):
        refused = httpx.get(url + "/tools", headers=twice)
        assert refused.status_code == 400 and "given more than once" in refused.text


def test_both_transports_compare_the_token_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token guessed a character at a time would be found from how long a refusal takes
    unless the comparison takes the same time wherever the guess differs: both transports
    compare with ``hmac.compare_digest`` (watched here; its timing is the library's)."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def watched(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", watched)
    sock = tmp_path / "tools.sock"
    app = create_app(ToolRegistry([Counter()]), token=TOKEN, socket_path=str(sock))

    async def scenario() -> list[Any]:
        out: list[Any] = []
        async with serving(app) as url:
            for address in (url, f"unix:{sock}"):
                compared.clear()
                guess = HttpTools(address, token="s3creX", retries=0)
                with pytest.raises(ToolTransportError, match=r"401|token"):
                    await guess.call("g", "count", {})
                await guess.close()
                out.append(compared.copy())
                run = HttpTools(address, token=TOKEN)
                out.append(await _counts(run, "g", 2))
                await run.release("g")
                await run.close()
        return out

    guessed = (b"s3creX", TOKEN.encode())
    http_compared, http_counts, unix_compared, unix_counts = asyncio.run(scenario())
    assert guessed in http_compared and guessed in unix_compared
    assert http_counts == unix_counts == ["1", "2"]


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--max-concurrency", "0", "0 is not >= 1"),  # every call waited for good
        ("--max-concurrency", "-1", "-1 is not >= 1"),
        ("--timeout", "nan", "nan is not a finite number"),
        ("--timeout", "1e309", "1e309 is not a finite number"),  # a float's inf
        ("--timeout", "0", "0 is not in (0, 1e+06]"),  # every call an error
        ("--idle-timeout", "0", "0 is not in (0, 1e+06]"),  # the idle sweep ran without pause
        ("--idle-timeout", "inf", "inf is not a finite number"),
        ("--body-timeout", "-1", "-1 is not in (0, 1e+06]"),
        ("--body-timeout", "1e300", "1e300 is not in (0, 1e+06]"),  # overflowed a wait
        ("--max-trajectories", "0", "0 is not >= 1"),
        ("--max-body-bytes", "1e6", "'1e6' is not a whole number"),
        ("--max-connections", "0", "0 is not >= 1"),
        ("--port", "65536", "65536 is not in [0, 65535]"),
    ],
)
def test_serve_tools_refuses_flags_that_would_hang_or_fail_every_call(
    flag: str, value: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bound the server cannot work with is refused naming the flag, before it serves
    (before: --max-concurrency 0 served, and every call waited for a slot for good)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve-tools", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {problem}" in capsys.readouterr().err
    assert build_parser().parse_args(["serve-tools", flag, "1"]).func is not None


class _UnprintableError(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("cannot format the value")


class Unprintable(Counter):
    """A tool whose call raises an exception that cannot be written (its __str__ fails)."""

    async def execute(self, state: dict[str, Any], arguments: dict[str, Any]) -> ToolResult:
        del state, arguments
        raise _UnprintableError


def test_a_tool_error_that_cannot_be_written_is_still_the_models_observation() -> None:
    """Writing the tool's error called the exception's __str__, whose own error left the call:
    the episode ended as an agent error instead of the model reading that its call failed."""
    tools = LocalTools(ToolRegistry([Unprintable()]))
    result = asyncio.run(tools.call("t", "count", {}))
    assert result.error
    assert result.text == "error: count failed: _UnprintableError (its message cannot be written)"


def test_calls_batched_past_the_body_cap_still_each_get_their_own_result() -> None:
    """Calls made in one event-loop tick share one /execute_batch request, so calls that each
    fit the server's body cap could together pass it: the 413 failed every call of the batch
    (a ToolTransportError: each episode ended as tool_error, out of training), so a policy
    writing long arguments ended its siblings' episodes. A request refused for its size ran
    nothing: its calls are sent again in halves, and a call over the cap on its own is that
    call's error result, which its model reads."""
    cap = 100_000
    long = "1+" * 20_000 + "1"  # 40 kB: three of them pass the cap together

    async def scenario() -> list[ToolResult]:
        async with serving(create_app(ToolRegistry([calculator]), max_body_bytes=cap)) as url:
            tools = HttpTools(url)
            try:
                calls = [tools.call("t0", "calculator", {"expression": "6 * 7"})]
                calls += [
                    tools.call(f"t{i}", "calculator", {"expression": long}) for i in (1, 2, 3)
                ]
                calls.append(tools.call("t4", "calculator", {"expression": "1+" * cap + "1"}))
                return list(await asyncio.gather(*calls))
            finally:
                await tools.close()

    small, *longer, over = asyncio.run(scenario())
    assert small == ToolResult("42")
    assert [r.text for r in longer] == ["error: expression longer than 1000 characters"] * 3
    assert over.error and "over the tool server's cap on a request" in over.text
    assert f"the cap of {cap} bytes" in over.text


def test_a_call_over_the_frame_cap_on_the_socket_fails_alone(tmp_path: Path) -> None:
    """Over the Unix socket every call of a client is a frame on one shared connection, and a
    frame over the server's cap closed it: each call in flight on it (other trajectories')
    failed as a transport error, their episodes ended tool_error, so a policy's long
    arguments ended its siblings' episodes. The server says its cap in its hello, and a call
    over it is not sent: it is its model's error result, and the calls beside it run on."""
    cap = 100_000
    started, opened = asyncio.Event(), asyncio.Event()

    async def gate() -> str:
        """Wait until the test opens the gate."""
        started.set()
        await opened.wait()
        return "passed"

    async def scenario() -> tuple[ToolResult, ToolResult]:
        socket_path = str(tmp_path / "tools.sock")
        tmp_path.chmod(0o700)
        app = create_app(
            ToolRegistry([calculator, tool(gate)]), max_body_bytes=cap, socket_path=socket_path
        )
        async with serving(app):
            tools = HttpTools(f"unix:{socket_path}")
            try:
                sibling = asyncio.ensure_future(tools.call("t0", "gate", {}))
                await started.wait()
                long = {"expression": "1+" * cap + "1"}
                over = await tools.call("t1", "calculator", long)
                opened.set()
                return over, await sibling
            finally:
                await tools.close()

    over, sibling = asyncio.run(scenario())
    assert over.error and "over the tool server's cap on a request" in over.text, over
    assert sibling == ToolResult("passed")


def test_a_socket_client_that_takes_no_answer_loses_its_connection(tmp_path: Path) -> None:
    """A client that sent calls with large answers and never read them held its connection for
    good (the answer's write waited with no deadline, and the read loop behind it): 8 such
    connections left every other client 'too many connections' past 60 s. An answer not taken
    within the frame timeout drops the connection."""

    async def big() -> str:
        """A large answer."""
        return "x" * 2_000_000

    async def hello(socket_path: str, rcvbuf: int | None = None) -> tuple[Any, Any, Any]:
        sock = socket.socket(socket.AF_UNIX)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(socket_path)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        writer.write(_frame({"token": None}))
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        return reader, writer, json.loads(await reader.readexactly(n))

    async def scenario() -> Any:
        socket_path = str(tmp_path / "tools.sock")
        tmp_path.chmod(0o700)
        app = create_app(
            ToolRegistry([tool(big)]),
            socket_path=socket_path,
            max_connections=1,
            body_timeout_s=1.0,
        )
        async with serving(app) as url:
            async with httpx.AsyncClient() as http:  # (answered once the lifespan started)
                assert (await http.get(url + "/health")).status_code == 200
            _, hog, said = await hello(socket_path, rcvbuf=4096)
            assert said["ok"], said
            for i in range(8):  # 16 MB of answers, none read
                hog.write(
                    _frame(
                        {
                            "id": i,
                            "op": "execute",
                            "body": {"trajectory_id": "t", "name": "big", "arguments": {}},
                        }
                    )
                )
            await hog.drain()
            for _ in range(600):  # until the server dropped it (a bound, not a wait)
                _, writer, said = await hello(socket_path)
                writer.close()
                if said.get("ok"):
                    break
                await asyncio.sleep(0.05)
            hog.close()
            return said

    said = asyncio.run(scenario())
    assert said.get("ok"), said


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--tools", "{dir}/none.yaml"], "--tools '{dir}/none.yaml' does not exist"),
        (["--tools", "{dir}/broken.yaml"], "--tools '{dir}/broken.yaml': "),
        (["--tools", "{dir}/wrong.yaml"], "--tools '{dir}/wrong.yaml': "),
        (["--socket", "{dir}/none/tools.sock"], "its directory {dir}/none does not exist"),
        (["--host", "0.0.0.0"], "non-loopback address 0.0.0.0 without --token"),
    ],
    ids=["missing", "not-yaml", "no-such-class", "socket-folder-missing", "open-without-token"],
)
def test_serve_tools_refuses_files_it_cannot_use_in_one_line(
    flags: list[str], problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tools file that is not there, not YAML or names no class, and a socket in a folder
    that is not there: each was a traceback (FileNotFoundError, a YAML scanner error, an
    import error) out of jarl serve-tools; now one line naming the flag, exit 2, nothing
    served, and nothing announced (the socket's and the token's refusals once came after a
    line saying the tools were being served)."""
    (tmp_path / "broken.yaml").write_text("- class: [unclosed\n")
    (tmp_path / "wrong.yaml").write_text("- class: no_such_module:tool\n")
    tmp_path.chmod(0o700)
    argv = ["serve-tools", "--port", "0", *(f.format(dir=tmp_path) for f in flags)]
    before = set(sandbox_processes())
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("jarl: ") and problem.format(dir=tmp_path) in err, err
    assert "serving" not in out, out
    assert set(sandbox_processes()) <= before  # the refused tools' sandboxes were stopped


def test_a_call_past_the_clients_timeout_is_the_models_error_while_the_server_answers(
    tmp_path: Path,
) -> None:
    """A call the server runs longer than the client waits (here the server allows 60 s, the
    client 0.5 s: a call's cost grows with its arguments, a queue ahead of it) got no answer
    in time, and the episode ended tool_error, untrained: a policy that wrote such calls
    escaped a wrong answer's penalty (rerunning it replays the same tokens). Now, on both
    transports, the client asks the server for a cheap answer (/health; on the socket, its tool
    list): the server answers, so the call is its model's error result, trained on. A server
    that answers nothing (a listener that never replies: stuck) is still a transport error."""
    opened = asyncio.Event()

    async def slow() -> str:
        """Run until the test opens the gate."""
        await opened.wait()
        return "done"

    async def scenario() -> list[ToolResult]:
        socket_path = str(tmp_path / "tools.sock")
        tmp_path.chmod(0o700)
        app = create_app(
            ToolRegistry([calculator, tool(slow)]), timeout_s=60.0, socket_path=socket_path
        )
        out = []
        async with serving(app) as url:
            for address in (url, f"unix:{socket_path}"):
                tools = HttpTools(address, timeout_s=0.5)
                try:
                    out.append(await tools.call(f"slow-{address[:4]}", "slow", {}))
                    out.append(await tools.call("after", "calculator", {"expression": "1+1"}))
                finally:
                    await tools.close()
            opened.set()
        return out

    results = asyncio.run(scenario())
    late = [r for r in results if r.error]
    assert len(late) == 2 and all("ran past the client's timeout" in r.text for r in late)
    assert [r.text for r in results if not r.error] == ["2", "2"]

    stuck = socket.socket()
    stuck.bind(("127.0.0.1", 0))
    stuck.listen()  # accepts connections (the kernel's backlog), never answers

    async def on_stuck() -> None:
        tools = HttpTools(f"http://127.0.0.1:{stuck.getsockname()[1]}", timeout_s=0.5)
        try:
            await tools.call("t", "calculator", {"expression": "1+1"})
        finally:
            await tools.close()

    with stuck, pytest.raises(ToolTransportError, match="no answer in time, and then"):
        asyncio.run(on_stuck())


class Holding:
    """A tool whose calls run until ``opened`` is set, counting those cancelled."""

    def __init__(self) -> None:
        self.opened, self.cancelled = asyncio.Event(), 0

    def tool(self) -> Tool:
        async def hold() -> str:
            """Run until the test opens the gate."""
            try:
                await self.opened.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return "done"

        return tool(hold)


async def _left_by_its_client(
    app: Any, route: str, body: dict[str, Any], held: Holding, running: int
) -> dict[str, Any]:
    """``body`` posted to ``route`` of ``app`` by a client that closes its connection once
    ``running`` of its calls hold the server's slots; then, once the server cancelled them
    (a bound, not a wait), another client's call and the server's metrics."""
    async with serving(app) as url:
        raw = json.dumps(body).encode()
        _reader, writer = await asyncio.open_connection(*url[7:].split(":"))
        writer.write(
            f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(600):  # until its calls hold the slots
                if (await http.get("/metrics")).json()["in_flight"] == running:
                    break
                await asyncio.sleep(0.05)
            writer.close()
            for _ in range(600):  # until the server saw the disconnect
                if held.cancelled == running:
                    break
                await asyncio.sleep(0.05)
            call = {"trajectory_id": "u", "name": "calculator", "arguments": {"expression": "2+2"}}
            async with asyncio.timeout(120):  # (a bound: before, it waited for the gate)
                answer = (await http.post("/execute", json=call)).json()
            metrics = dict((await http.get("/metrics")).json())
        held.opened.set()
    return {"answer": answer["text"], **metrics}


def test_a_batch_whose_client_went_away_frees_its_slots() -> None:
    """/execute_batch ran every call of a client that closed the connection as soon as the
    answer's headers came (40 calls of 1.5 s held the slots: another namespace's call waited
    28 s, and requests repeated so queue without bound). The calls are cancelled; the slots
    are free for the next client."""
    held = Holding()
    app = create_app(ToolRegistry([calculator, held.tool()]), max_concurrency=2)
    calls = [{"trajectory_id": f"t{i}", "name": "hold", "arguments": {}} for i in range(6)]
    out = asyncio.run(_left_by_its_client(app, "/execute_batch", {"calls": calls}, held, 2))
    assert held.cancelled == 2  # the two running; the four waiting for a slot never started
    assert out["answer"] == "4" and out["in_flight"] == 0


def test_a_verl_tool_observation_whose_client_went_away_frees_its_slots(tmp_path: Path) -> None:
    """/get_observation (verl-tool's route) ran every call of a client that had closed the
    connection: 64 trajectories x 4 calls of a 20 s tool kept 64 calls in flight and ran all
    256 with nobody listening (up to max_batch_calls x max_action_calls, 32,768). Its calls
    are cancelled when the client goes."""
    held = Holding()
    registry = ToolRegistry([calculator, held.tool()])
    app = create_app(registry, max_concurrency=2, tokenizer=loaded_tokenizer(tmp_path))
    action = '<tool_call>{"name": "hold", "arguments": {}}</tool_call>' * 2
    body = {"trajectory_ids": ["a", "b"], "actions": [action] * 2}
    out = asyncio.run(_left_by_its_client(app, "/get_observation", body, held, 2))
    assert held.cancelled == 2  # the two running; the two waiting for a slot never started
    assert out["answer"] == "4" and out["in_flight"] == 0


@tool
def grade(answer: str) -> Any:
    """Grades an answer with NumPy, as a careful user's grader does; other answers name a
    malformed result.

    Args:
        answer: the answer.
    """
    malformed = {"bytes": ToolResult(b"graded"), "text-reward": ToolResult("graded", "1"),
                 "string-flag": ToolResult("graded", done="yes")}  # type: ignore[arg-type]  # fmt: skip
    if answer in malformed:
        return malformed[answer]
    right = np.isclose(float(answer), 4.0)
    return ToolResult("graded", reward=np.float32(right), done=right)


@tool
def echo(text: str) -> str:
    """Echoes the text.

    Args:
        text: what to echo.
    """
    return text


def test_a_tools_numpy_result_leaves_its_batchs_sibling_calls_alone() -> None:
    async def go() -> list[ToolResult]:
        async with serving(create_app(ToolRegistry([grade, echo]), token="t")) as url:
            client = HttpTools(url, token="t")
            try:  # (made in one tick: one /execute_batch request)
                return list(
                    await asyncio.gather(
                        client.call("graded/s1a0/0", "grade", {"answer": "4"}),
                        *(client.call(f"sib/s1a0/{i}", "echo", {"text": "hi"}) for i in (1, 2)),
                    )
                )
            finally:
                await client.close()

    graded, *siblings = asyncio.run(go())  # (before: ToolTransportError, every one)
    assert graded == ToolResult("graded", 1.0, True, False)
    assert type(graded.reward) is float and type(graded.done) is bool
    assert siblings == [ToolResult("hi")] * 2


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ("bytes", "text that is a bytes, not a string"),
        ("text-reward", "a reward that is a str, not a number"),
        ("string-flag", "done and error flags of types ['str', 'bool'], not bools"),
    ],
)
def test_a_malformed_tool_result_is_the_calls_error(answer: str, said: str) -> None:
    tools = LocalTools(ToolRegistry([grade]))
    result = asyncio.run(tools.call("t", "grade", {"answer": answer}))
    assert result == ToolResult(f"error: grade returned {said}", error=True)


def test_long_calls_made_together_are_not_sent_as_one_body_over_the_servers_bound() -> None:
    long_text = "a" * 1_000_000  # (10 of them: 10 MB, over the server's 8 MiB bound)
    assert len(long_text) < BATCH_BYTES  # (a batch holds each: they go one a batch)

    async def go() -> list[ToolResult]:
        async with serving(create_app(ToolRegistry([echo]), token="t")) as url:
            client = HttpTools(url, token="t")
            try:  # (made in one tick)
                return list(
                    await asyncio.gather(
                        *(client.call(f"w/{i}", "echo", {"text": long_text}) for i in range(10)),
                        *(client.call(f"sib/s1a0/{i}", "echo", {"text": "hi"}) for i in range(2)),
                    )
                )
            finally:
                await client.close()

    results = asyncio.run(go())  # (before: ToolTransportError, every one)
    assert results == [ToolResult(long_text)] * 10 + [ToolResult("hi")] * 2
