"""The python sandbox contains hostile code within its limits, and the pool stays healthy."""

import asyncio
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from jax_agent_rl.cli.serve_tools import announcement
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.tools.sandbox import (
    Limits,
    MemoryCgroup,
    PythonSandbox,
    PythonTool,
    memory_cgroup,
)


@pytest.fixture(scope="module")
def sandbox(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    """Under each memory bound: a cgroup per execution, and the fork server's accounting."""
    limits = Limits(cpu_s=2, memory_mb=256, processes=16)
    sb = PythonSandbox(size=2, limits=limits, timeout_s=3.0, cgroup=sandbox_cgroup)
    yield sb
    sb.close()


def run(sb: PythonSandbox, code: str) -> str:
    return asyncio.run(sb.run(code)).as_text()


def _healthy(sb: PythonSandbox) -> None:
    async def many() -> list[str]:
        return [
            r.stdout for r in await asyncio.gather(*(sb.run(f"print({i} * 2)") for i in range(6)))
        ]

    assert asyncio.run(many()) == [f"{i * 2}\n" for i in range(6)]


def test_runs_code_and_reports_errors(sandbox: PythonSandbox) -> None:
    assert run(sandbox, "print(sum(range(10)))") == "45"
    assert "ZeroDivisionError" in run(sandbox, "1 / 0")


def test_preloaded_modules_are_per_execution(sandbox: PythonSandbox) -> None:
    """The fork server's preloaded modules are ready in every execution, a change to one is
    gone in the next, and ``random`` draws differ between executions."""
    ready = "import sys\nprint(all(m in sys.modules for m in ('fractions', 'statistics', 're')))"
    assert run(sandbox, ready) == "True"
    for _ in range(2):  # both workers
        assert run(sandbox, "import math\nmath.pi = 3\nprint(math.pi)") == "3"
    assert run(sandbox, "import math\nprint(math.pi)") == "3.141592653589793"
    draws = {run(sandbox, "import random\nprint(random.random())") for _ in range(4)}
    assert len(draws) == 4


def test_no_network(sandbox: PythonSandbox) -> None:
    """No inet socket opens (`seccomp`), not even to the sandbox's own loopback; the host's
    loopback is another network namespace's anyway."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    threading.Thread(target=server.accept, daemon=True).start()
    out = run(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert "Address family not supported" in out
    out = run(sandbox, "import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)")
    assert "Address family not supported" in out
    server.close()


def test_filesystem_is_private(sandbox: PythonSandbox, tmp_path: Path) -> None:
    assert "Read-only file system" in run(sandbox, "open('/usr/evil', 'w')")
    assert "Read-only file system" in run(sandbox, "open('/evil', 'w')")
    secret = Path.home() / ".jarl-sandbox-test-secret"
    secret.write_text("token")
    try:
        assert "No such file" in run(sandbox, f"print(open({str(secret)!r}).read())")
    finally:
        secret.unlink()
    assert "No such file" in run(sandbox, f"open({str(tmp_path / 'x')!r}, 'w')")
    os.environ["JARL_TEST_SECRET"] = "hunter2"
    try:
        assert "hunter2" not in run(sandbox, "import os; print(dict(os.environ))")
    finally:
        del os.environ["JARL_TEST_SECRET"]
    # files written in one execution are gone in the next
    run(sandbox, "open('/work/a', 'w').write('x'); open('/tmp/b', 'w').write('y')")
    assert run(sandbox, "import os; print(os.listdir('/work'), os.listdir('/tmp'))") == "[] []"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import os\nwhile True:\n    os.fork()", "BlockingIOError"),  # fork bomb
        ("x = bytearray(1024 ** 3)", "MemoryError"),  # memory bomb
        # infinite loop: the CPU limit (2 s), under a wall timeout no loaded machine reaches
        ("while True:\n    pass", "CPU time limit exceeded"),
        ("import time\ntime.sleep(60)", "timed out"),  # wall clock
        ("print('x' * 10 ** 6)", "output limit"),
        ("open('/work/big', 'wb').write(b'0' * (64 * 1024 * 1024))", "File too large"),
    ],
    ids=["fork-bomb", "memory-bomb", "infinite-loop", "sleep", "output-flood", "file-size"],
)
def test_bombs_are_contained(sandbox: PythonSandbox, code: str, expected: str) -> None:
    timeout_s = 300.0 if expected.startswith("CPU") else None
    result = asyncio.run(sandbox.run(code, timeout_s))
    assert expected in result.as_text()
    _healthy(sandbox)


def test_background_processes_do_not_outlive_their_execution(sandbox: PythonSandbox) -> None:
    run(sandbox, "import subprocess\nsubprocess.Popen(['sleep', '30'])")
    # what is left: the fork server (pid 1) and this execution's own process
    pids = "import os\nps = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
    pids += "print(min(ps), len(ps))"
    assert run(sandbox, pids) == "1 2"
    _healthy(sandbox)


def test_python_tool(sandbox: PythonSandbox) -> None:
    t = PythonTool(sandbox)
    assert t.schema["function"]["parameters"]["required"] == ["code"]
    ok = asyncio.run(t.execute(None, {"code": "print(6 * 7)"}))
    assert ok.text == "42" and not ok.error
    bad = asyncio.run(t.execute(None, {"code": "raise ValueError('no')"}))
    assert bad.error and "ValueError: no" in bad.text


def test_a_worker_outliving_its_event_loop_returns_to_the_pool() -> None:
    """A call that gives up ends its event loop (``asyncio.run``) while its worker still runs
    the code; the worker's thread gives it back when done, so the next loop's call runs."""
    sb = PythonSandbox(size=1, limits=Limits(cpu_s=2, memory_mb=256, processes=16), timeout_s=5)

    async def gives_up() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sb.run("import time; time.sleep(1); print(1)"), 0.2)

    async def next_call() -> str:
        return (await asyncio.wait_for(sb.run("print(2)"), 60)).stdout

    try:
        asyncio.run(gives_up())
        assert asyncio.run(next_call()) == "2\n"
    finally:
        sb.close()


def test_the_tool_server_says_which_memory_bound_is_in_force(sandbox: PythonSandbox) -> None:
    """``jarl serve-tools`` says at start what bounds a python execution's memory: a cgroup
    per execution, or the fork server's accounting where none can be made (or it is off)."""
    registry = ToolRegistry([PythonTool(sandbox)])
    said = announcement(registry, "http://127.0.0.1:1").splitlines()
    assert said[0] == "serving ['python'] on http://127.0.0.1:1"
    if sandbox.cgroup is not None:
        assert said[1].startswith("python: memory bounded by a memory cgroup per execution")
    else:
        assert said[1].startswith("python: memory bounded by the fork server's accounting")
        assert "memory cgroups are turned off" in said[1]


def test_groups_a_killed_host_left_are_removed() -> None:
    """A host killed (SIGKILL: a tool server stopped so) removed none of its workers' memory
    groups; the next sandbox started beside it removes those whose host is gone."""
    found = memory_cgroup()
    if not isinstance(found, MemoryCgroup):
        pytest.skip(found)
    dead = subprocess.Popen(["true"])  # (its pid: no process's once it is reaped)
    dead.wait()
    stale = found.path / f"jarl-sandbox-{dead.pid}-0123456789abcdef"
    (stale / "server").mkdir(parents=True)
    ours = lambda: set(found.path.glob(f"jarl-sandbox-{os.getpid()}-*"))  # noqa: E731
    before = ours()  # (other sandboxes of this process: the module's)
    sb = PythonSandbox(size=1, limits=Limits(cpu_s=2, memory_mb=64, processes=16), timeout_s=5)
    try:
        assert not stale.exists()
        (live,) = ours() - before
        assert (live / "server").is_dir()
    finally:
        sb.close()
    assert not live.exists()
