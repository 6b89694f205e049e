"""A python sandbox: Linux namespaces (bubblewrap), rlimits, and a warm pool of fork servers.

Each pool worker is one bubblewrap sandbox started as its own unprivileged uid: new user,
pid, network, ipc, uts and cgroup namespaces (no network at all), a read-only view of ``/usr``
and nothing else of the host (no home, no ``/etc``, an empty environment), and writable
tmpfs ``/work`` and ``/tmp``. Inside, a fork server (`sandbox_zygote`) forks one child per
execution with limits on CPU seconds, address space, processes (per worker uid), file size,
open files and output bytes, plus a wall-clock timeout; afterwards it kills whatever the code
left running and wipes ``/work`` and ``/tmp``. Forking a ready interpreter instead of starting
a fresh one per call is what makes executions fast; the sweep is what keeps them independent.
A worker that dies (the code killed it, say) is restarted; the call that lost it gets an
error result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

from jax_agent_rl.tools.base import Tool, ToolResult, function_schema


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 32
    file_size_mb: int = 16
    output_bytes: int = 16384


@dataclasses.dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    wall_s: float

    def as_text(self) -> str:
        """What the model reads."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append("error: execution timed out")
        elif self.exit_code < 0 and not self.truncated:
            reason = _SIGNALS.get(-self.exit_code, f"killed by signal {-self.exit_code}")
            parts.append(f"error: {reason}")
        if self.truncated:
            parts.append("error: output limit reached; output truncated")
        return "\n".join(parts) if parts else "(no output)"


_SIGNALS: dict[int, str] = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGKILL: "killed",
    signal.SIGSEGV: "segmentation fault",
}


class SandboxUnavailableError(RuntimeError):
    pass


def bwrap_command(interpreter: str) -> list[str]:
    zygote = resources.files("jax_agent_rl.tools").joinpath("sandbox_zygote.py").read_text()
    return [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc",
        "--dev", "/dev",
        "--tmpfs", "/tmp",
        "--tmpfs", "/work",
        "--remount-ro", "/",
        "--chdir", "/work",
        "--clearenv",
        "--setenv", "PATH", "/usr/bin",
        "--setenv", "HOME", "/work",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        interpreter, "-I", "-S", "-c", zygote,
    ]  # fmt: skip


class _Worker:
    """One sandbox with its fork server; used by one call at a time."""

    def __init__(self, uid: int, interpreter: str) -> None:
        self.uid, self.interpreter = uid, interpreter
        self.proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        # No preexec_fn (unsafe in a multithreaded process such as one running JAX): the
        # zygote gets its pipe fds as arguments, and Popen itself switches to the worker's
        # uid (one unprivileged uid per worker: RLIMIT_NPROC counts processes per uid).
        as_root = os.getuid() == 0
        self.proc = subprocess.Popen(
            [*bwrap_command(self.interpreter), str(req_r), str(rep_w)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(req_r, rep_w),
            user=self.uid if as_root else None,
            group=self.uid if as_root else None,
            extra_groups=[] if as_root else None,
        )
        os.close(req_r)
        os.close(rep_w)
        self._req, self._rep = req_w, rep_r
        ready = self._recv()
        if ready is None or not ready.get("ready"):
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise SandboxUnavailableError(f"the sandbox did not start: {err.strip()}")

    def _recv(self) -> dict[str, Any] | None:
        head = self._read(4)
        if head is None:
            return None
        body = self._read(struct.unpack(">I", head)[0])
        return None if body is None else json.loads(body)

    def _read(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = os.read(self._rep, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def execute(self, code: str, timeout_s: float, limits: Limits) -> dict[str, Any] | None:
        """The zygote's reply, or None if the worker died (it is restarted)."""
        frame = json.dumps(
            {"code": code, "timeout_s": timeout_s, "limits": dataclasses.asdict(limits)}
        ).encode()
        try:
            os.write(self._req, struct.pack(">I", len(frame)) + frame)
            reply = self._recv()
        except OSError:
            reply = None
        if reply is None:
            self.close()
            self._start()
        return reply

    def close(self) -> None:
        for fd in (self._req, self._rep):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stderr:
                self.proc.stderr.close()


class PythonSandbox:
    """A pool of ``size`` sandboxes; ``run`` executes code in the next free one."""

    def __init__(
        self,
        size: int = 4,
        limits: Limits = Limits(),
        timeout_s: float = 10.0,
        interpreter: str = "/usr/bin/python3",
        first_uid: int = 61000,
    ) -> None:
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError("bubblewrap (bwrap) is not installed; run make setup")
        if not Path(interpreter).exists():
            raise SandboxUnavailableError(f"sandbox interpreter {interpreter} does not exist")
        self.limits, self.timeout_s = limits, timeout_s
        self._workers = [_Worker(first_uid + i, interpreter) for i in range(size)]
        self._busy: set[_Worker] = set()
        self._free: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # blocking pipe I/O runs here, never on the event loop nor in its shared default pool
        self._threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="sandbox")
        self.restarts = 0

    def _queue(self) -> asyncio.Queue[_Worker]:
        """The idle workers, as a queue of the running event loop (rebuilt if the loop changes)."""
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            self._loop, self._free = loop, asyncio.Queue()
            for w in self._workers:
                if w not in self._busy:
                    self._free.put_nowait(w)
        return self._free

    async def run(self, code: str, timeout_s: float | None = None) -> ExecResult:
        free = self._queue()
        worker = await free.get()
        self._busy.add(worker)
        try:
            reply = await asyncio.get_running_loop().run_in_executor(
                self._threads, worker.execute, code, timeout_s or self.timeout_s, self.limits
            )
        finally:
            self._busy.discard(worker)
            free.put_nowait(worker)
        if reply is None:
            self.restarts += 1
            return ExecResult(
                "", "error: the sandbox process died; it was restarted", -9, False, False, 0.0
            )
        return ExecResult(
            reply["stdout"], reply["stderr"], reply["exit_code"], reply["timed_out"],
            reply["truncated"], reply["wall_s"],
        )  # fmt: skip

    def close(self) -> None:
        for w in self._workers:
            w.close()
        self._threads.shutdown(wait=False)


class PythonTool(Tool):
    """The ``python`` tool: runs code in the sandbox; what it prints is the result. Give it a
    sandbox, or the pool size and limits to build one (the form a tools YAML uses)."""

    def __init__(
        self,
        sandbox: PythonSandbox | None = None,
        pool_size: int = 4,
        timeout_s: float = 10.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
    ) -> None:
        self.sandbox = sandbox or PythonSandbox(
            pool_size, Limits(cpu_s=cpu_s, memory_mb=memory_mb), timeout_s
        )

        def python(code: str) -> str:
            """Run Python code in an isolated sandbox (no network, no files kept) and return
            what it prints.

            Args:
                code: Python source; print what you want to see.
            """
            return code

        self.schema = function_schema(python)
        self.name = "python"

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del state
        result = await self.sandbox.run(arguments["code"])
        error = result.exit_code != 0 or result.timed_out or result.truncated
        return ToolResult(result.as_text(), error=error)
