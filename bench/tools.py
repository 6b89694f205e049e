"""Sandboxed python executions per second: our tool server against a fresh interpreter per call.

Same snippets, same concurrency, one run. Ours: `jarl serve-tools` with the ``python`` tool
(a warm pool of bubblewrap sandboxes with fork servers), called with `HttpTools` over its
Unix socket (``--socket``: every call one frame on a shared connection) and over HTTP on
loopback; the same pool called directly in process is reported too, to show what each
transport costs. The alternative existing RL tool servers use: a fresh ``python -c``
subprocess per call, bare and under bubblewrap with the same isolation flags. The ratios are
the Unix-socket path's. Every output is checked. Ends with one JSON line.

    .venv/bin/python bench/tools.py [--calls 400] [--concurrency 8] [--smoke]

``--smoke``: the smallest run that goes through every part (4 calls each way, 2 at a time):
it checks the bench works, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox, bwrap_command, seccomp_fd

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "/usr/bin/python3"
SNIPPETS = [
    ("print(sum(i * i for i in range(1000)))", "332833500"),
    ("import math\nprint(round(math.sqrt(2) * 1000))", "1414"),
    ("s = 'agentic rl'\nprint(s.upper()[::-1])", "LR CITNEGA"),
    ("from fractions import Fraction\nprint(Fraction(3, 4) + Fraction(1, 6))", "11/12"),
    ("print(sorted([5, 3, 9, 1])[-2:])", "[5, 9]"),
]


async def _bounded(n: int, concurrency: int, one: Callable[[str], Awaitable[str]]) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> None:
        async with gate:
            code, want = SNIPPETS[i % len(SNIPPETS)]
            got = await one(code)
            if got.strip() != want:
                raise AssertionError(f"snippet {i}: expected {want!r}, got {got!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def fresh_process(argv_prefix: list[str], code: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv_prefix, code, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return out.decode()


async def fresh_bwrap_process(code: str) -> str:
    """``python -c`` under the sandbox's own bubblewrap flags and seccomp filter."""
    filt = seccomp_fd()
    cmd = bwrap_command(shutil.which("bwrap") or "bwrap", PYTHON, Limits(), filt)
    argv = [*cmd[: cmd.index(PYTHON)], PYTHON, "-I", "-S", "-c", code]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(filt,), env={}
        )
        out, _ = await proc.communicate()
    finally:
        os.close(filt)
    return out.decode()


def start_server(pool: int) -> tuple[subprocess.Popen[bytes], str, str]:
    """The server, its HTTP URL and its Unix socket's (in a private temporary directory)."""
    tmp = tempfile.mkdtemp()
    tools = Path(tmp) / "tools.yaml"
    tools.write_text(
        "- class: jax_agent_rl.tools.sandbox:PythonTool\n"
        f"  config: {{pool_size: {pool}, timeout_s: 10.0}}\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jax_agent_rl.cli", "serve-tools", "--tools", str(tools)]
    cmd += ["--port", str(port), "--socket", f"{tmp}/tools.sock"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, f"unix:{tmp}/tools.sock"
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("tool server did not start")


async def through_server(url: str, calls: int, concurrency: int) -> float:
    tools = HttpTools(url)

    async def one(code: str) -> str:
        result = await tools.call(f"bench-{os.urandom(4).hex()}", "python", {"code": code})
        if result.error:
            raise AssertionError(result.text)
        return result.text

    await _bounded(concurrency * 4, concurrency, one)  # warm-up
    rate = await _bounded(calls, concurrency, one)
    await tools.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    n, c = (4, 2) if args.smoke else (args.calls, args.concurrency)
    fresh_n = n if args.smoke else max(n // 4, 40)  # the slow side needs fewer calls

    proc, url, unix = start_server(pool=c)
    try:
        ours = asyncio.run(through_server(unix, n, c))
        http_rate = asyncio.run(through_server(url, n, c))
    finally:
        proc.kill()
        proc.wait()

    async def bare(code: str) -> str:
        return await fresh_process([PYTHON, "-c"], code)

    async def direct() -> float:  # the sandbox pool alone, without HTTP: where the time goes
        sandbox = PythonSandbox(size=c)

        async def one(code: str) -> str:
            return (await sandbox.run(code)).stdout

        await _bounded(c * 4, c, one)
        rate = await _bounded(n, c, one)
        sandbox.close()
        return rate

    direct_rate = asyncio.run(direct())
    bare_rate = asyncio.run(_bounded(fresh_n, c, bare))
    bwrap_rate = asyncio.run(_bounded(fresh_n, c, fresh_bwrap_process))
    print(
        json.dumps(
            {
                "bench": "tools",
                "concurrency": c,
                "server_unix_exec_s": round(ours, 1),
                "server_http_exec_s": round(http_rate, 1),
                "direct_sandbox_exec_s": round(direct_rate, 1),
                "fresh_python_exec_s": round(bare_rate, 1),
                "fresh_bwrap_python_exec_s": round(bwrap_rate, 1),
                "ratio_vs_fresh_python": round(ours / bare_rate, 2),
                "ratio_vs_fresh_bwrap": round(ours / bwrap_rate, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
