"""The tool server against hostile or careless clients: trajectories never released, more
trajectories than the server holds, request bodies too large, bodies sent too slowly, and
more connections than the server serves.

Expiry runs on a fake clock (and a sweep woken by the test), so no test waits on real time;
the slow-body test only waits for the server's verdict."""

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jax_agent_rl.tools.base import Tool, ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.server import create_app
from tests.tools.test_server import start_server
from tests.tools.test_tools import Counter


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
            assert released_ids(counter) == ["t0", "t1", "t2"]
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
