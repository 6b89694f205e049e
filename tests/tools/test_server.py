"""The tool server over real HTTP on loopback: sticky state, a hanging tool, a crashing tool,
auth, the request caps' flags, and a server killed mid-rollout."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from jax_agent_rl.cli import build_parser, main
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.protocol import RequestCaps
from jax_agent_rl.tools.registry import ToolRegistry, ToolTransportError
from jax_agent_rl.tools.server import serve

ROOT = Path(__file__).resolve().parents[2]
TOOLS_YAML = """
- class: jax_agent_rl.tools.calculator:calculator
- class: tests.tools.test_tools:Counter
- class: tests.tools.test_tools:crash
- class: tests.tools.test_tools:slow
"""


def policy_tokenizer(folder: Path) -> Path:
    """A small ChatML tokenizer saved in ``folder`` (the policy's, for verl-tool's route)."""
    backend = train_bpe(["The answer is 4."] * 8, 300, CHATML_SPECIAL_TOKENS)
    return Path(save_tokenizer(folder, backend, chat_template("chatml_tools")))


def loaded_tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(policy_tokenizer(folder))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    tmp_path: Path, *extra: str, tools_yaml: str = TOOLS_YAML
) -> tuple[subprocess.Popen[bytes], str]:
    """A real `jarl serve-tools` process on a free loopback port (with a policy's tokenizer,
    which verl-tool's route needs); returns it and its URL."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(tools_yaml)
    port = _free_port()
    tokenizer = policy_tokenizer(tmp_path / "tokenizer")
    cmd = [sys.executable, "-m", "jax_agent_rl.cli", "serve-tools", "--tools", str(tools)]
    cmd += ["--port", str(port), "--timeout", "3.0", "--tokenizer", str(tokenizer), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120  # a loaded machine imports slowly
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(
        f"tool server did not start: {proc.stderr.read().decode() if proc.stderr else ''}"
    )


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` on uvicorn in this event loop, on a loopback socket that listens before the
    server starts (so requests queue until it accepts them); stopped (its lifespan ended) on
    exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    proc, url = start_server(tmp_path)
    yield url
    proc.kill()
    proc.wait()


def test_calls_state_timeouts_and_crashes(server: str) -> None:
    tools = HttpTools(server)

    async def scenario() -> None:
        names = [s["function"]["name"] for s in await tools.schemas()]
        assert names == ["calculator", "count", "crash", "slow"]
        assert (await tools.call("t1", "calculator", {"expression": "6 * 7"})).text == "42"
        counts = [(await tools.call("t1", "count", {})).text for _ in range(3)]
        assert counts == ["1", "2", "3"]  # sticky per trajectory
        assert (await tools.call("t2", "count", {})).text == "1"
        # a hanging tool times out while the others proceed
        hang = asyncio.create_task(tools.call("t3", "slow", {"seconds": 30.0}))
        await asyncio.sleep(0)  # the hanging call is sent first
        fast = [await tools.call("t4", "calculator", {"expression": f"{i} + 1"}) for i in range(5)]
        assert [r.text for r in fast] == ["1", "2", "3", "4", "5"]
        assert not hang.done()  # the others finished while the hanging call was still running
        hung = await hang
        assert hung.error and "timed out after 3s" in hung.text
        crashed = await tools.call("t1", "crash", {"x": 1})
        assert crashed.error and "RuntimeError: boom" in crashed.text
        for t in ("t1", "t2", "t3", "t4"):
            await tools.release(t)
        metrics = await tools.metrics()
        assert metrics["open_trajectories"] == 0 and metrics["errors"] == 2
        await tools.close()

    asyncio.run(scenario())


async def killed_mid_call(proc: subprocess.Popen[bytes], address: str) -> list[object]:
    """Four calls of an hour-long tool to the server at ``address`` (HTTP or ``unix:``); once
    its metrics show all four running, its process is killed. Returns what the four calls and
    a call sent after the death raised (or returned). The server must run with a tool timeout
    longer than the test, so no call can end before the kill."""
    tools = HttpTools(address, retries=2, backoff_s=0.05)
    watch = HttpTools(address)  # its own connection: the calls' own may be busy
    calls = [
        asyncio.create_task(tools.call(f"k{i}", "slow", {"seconds": 3600.0})) for i in range(4)
    ]
    while (await watch.metrics())["in_flight"] < 4:  # a state: all four reached the tool
        await asyncio.sleep(0.01)
    proc.kill()
    results: list[object] = list(await asyncio.gather(*calls, return_exceptions=True))
    # a dying process may still hold its listening socket after its connections closed
    await asyncio.to_thread(proc.wait)
    results += await asyncio.gather(tools.call("k9", "count", {}), return_exceptions=True)
    await tools.release("k0")  # releasing against a dead server is not an error
    return results


def test_server_killed_mid_rollout(tmp_path: Path) -> None:
    proc, url = start_server(tmp_path, "--timeout", "3600")
    results = asyncio.run(killed_mid_call(proc, url))
    assert all(isinstance(r, ToolTransportError) for r in results)
    assert all("failed mid-call" in str(r) for r in results[:4])
    assert "unreachable" in str(results[4])


def test_auth_and_loopback_rule(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"non-loopback address 0\.0\.0\.0 without --token"):
        serve(ToolRegistry(), host="0.0.0.0")
    for host in ("127.0.0.1", "0.0.0.0"):  # an empty token (`--token "$UNSET"`) is no token
        with pytest.raises(ValueError, match="token is empty"):
            serve(ToolRegistry(), host=host, token="")
    with pytest.raises(ValueError, match="token is empty"):
        create_app(ToolRegistry(), token="")
    proc, url = start_server(tmp_path, "--token", "s3cret")
    try:
        with pytest.raises(ToolTransportError, match="401"):
            asyncio.run(HttpTools(url).schemas())
        assert len(asyncio.run(HttpTools(url, token="s3cret").schemas())) == 4
    finally:
        proc.kill()
        proc.wait()


def test_serve_tools_caps_reach_the_server(tmp_path: Path) -> None:
    """``--max-id-bytes``, ``--max-batch-calls`` and ``--max-action-calls`` are the server's
    caps (their defaults `RequestCaps`'s); a cap below 1 is refused."""
    defaults = build_parser().parse_args(["serve-tools"])
    caps = RequestCaps()
    assert (defaults.max_id_bytes, defaults.max_batch_calls, defaults.max_action_calls) == (
        caps.max_id_bytes,
        caps.max_batch_calls,
        caps.max_action_calls,
    )
    with pytest.raises(ValueError, match="max_batch_calls must be at least 1, got 0"):
        RequestCaps(max_batch_calls=0)
    flags = ["--max-id-bytes", "4", "--max-batch-calls", "2", "--max-action-calls", "1"]
    proc, url = start_server(tmp_path, *flags)
    call = {"trajectory_id": "abcd", "name": "calculator", "arguments": {"expression": "1"}}
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    try:
        long_id = httpx.post(url + "/execute", json={**call, "trajectory_id": "abcde"})
        batch = httpx.post(url + "/execute_batch", json={"calls": [call] * 3})
        ok = httpx.post(url + "/execute_batch", json={"calls": [call] * 2})
        action = {"trajectory_ids": ["abcd"], "actions": [one * 2]}
        observed = httpx.post(url + "/get_observation", json=action).json()
    finally:
        proc.kill()
        proc.wait()
    assert long_id.status_code == 422 and "cap of 4 bytes (max_id_bytes)" in long_id.text
    assert batch.status_code == 422 and "3 calls in one request, over the cap of 2" in batch.text
    assert [json.loads(line)["result"]["text"] for line in ok.text.splitlines()] == ["1", "1"]
    assert "over the cap of 1 (max_action_calls)" in observed["observations"][0]["invalid_reason"]


def test_a_server_answering_no_result_fails_the_calls_it_answered() -> None:
    """A server (or a proxy) that answers 200 with what is not a result, alone or in a batch:
    every call waiting on it raises `ToolTransportError`, none waits forever."""
    broken = FastAPI()

    @broken.post("/execute")
    async def execute() -> dict[str, Any]:
        return {"not": "a result"}

    @broken.post("/execute_batch")
    async def execute_batch() -> PlainTextResponse:
        return PlainTextResponse("not json\n")

    async def scenario() -> list[str]:
        async with serving(broken) as url:
            tools = HttpTools(url, retries=0)
            one = [tools.call("a", "calculator", {"expression": "1"})]
            two = [tools.call(t, "calculator", {"expression": "1"}) for t in ("a", "b")]
            out = []
            for calls in (one, two):
                # (a guard far above the milliseconds this takes: a hang fails, not stalls)
                results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
                out += [type(r).__name__ for r in results]
            await tools.close()
            return out

    assert asyncio.run(scenario()) == ["ToolTransportError"] * 3


def test_serve_tools_refuses_a_tokenizer_it_cannot_read_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tokenizer`` (what verl-tool's route writes special-token text with) naming a folder
    with no tokenizer, or a file, is one line naming the flag, exit 2, before any tool
    starts."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "empty", tmp_path / "file", tmp_path / "missing"):
        assert main(["serve-tools", "--tokenizer", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jarl: --tokenizer '{bad}': ") and err.count("\n") == 1, err
