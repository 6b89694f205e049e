"""A python sandbox: Linux namespaces (bubblewrap), a seccomp filter, execution-wide limits,
and a warm pool of fork servers.

Each pool worker is one bubblewrap sandbox, started with an empty environment as its own
unprivileged uid (when the host runs as root): new user, pid, network, ipc, uts and cgroup
namespaces (no network at all, no nested user namespaces), a read-only view of ``/usr`` and
nothing else of the host (no home, no ``/etc``), a read-only ``/dev``, and size-bounded tmpfs
``/work``, ``/tmp`` and ``/dev/shm``. The seccomp filter (`jax_agent_rl.tools.seccomp`) denies
ptrace, other processes' memory, namespaces, System V IPC and kernel surface an interpreter
never needs. Inside, the fork server (`sandbox_zygote`, the namespace's pid 1, not dumpable, so
code cannot signal, trace or write it) forks one child per execution under rlimits, bounds
memory, CPU and files over every process of the execution, and afterwards kills whatever the
code left running and wipes the writable places; a sandbox it cannot prove clean is replaced.
An execution's memory is bounded by a memory cgroup of its own where the host can make one
(`memory_cgroup`: the kernel then charges it every byte the execution causes, kernel memory
included), and otherwise by the fork server's accounting of what it can see (resident sets,
tmpfs usage, socket queues); ``PythonSandbox.memory_bound`` says which.

The host owns every deadline: a worker that does not answer within the execution's timeout
plus a grace is killed and restarted, and a worker goes back to the pool only when nothing
waits on it any more, also when the caller gave up. Forking a ready interpreter instead of
starting one per call is what makes executions fast; the sweep is what keeps them independent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import secrets
import select
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Hashable
from importlib import resources
from pathlib import Path
from typing import Any

from jax_agent_rl.config.ranges import TIMEOUT
from jax_agent_rl.tools.base import FairPool, Tool, ToolResult, function_schema
from jax_agent_rl.tools.seccomp import execution_filter, filter_program

REPLY_GRACE_S = 5.0  # beyond the execution's timeout: the zygote's own kill and sweep
MAX_CODE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds of one execution. ``memory_mb``, ``cpu_s`` and ``files`` hold for the whole
    execution (every process it starts, plus what it writes to the tmpfs mounts); ``memory_mb``
    and ``cpu_s`` also bound each process alone (rlimits), ``processes`` the processes alive at
    once, ``file_size_mb`` any one file."""

    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 32
    files: int = 10000
    file_size_mb: int = 16
    output_bytes: int = 16384

    def __post_init__(self) -> None:
        """Each a whole number in [1, 1e9]: a fraction failed every execution in the zygote
        (setrlimit takes none), and so did a bound past what it takes."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or not 1 <= value <= 10**9:
                raise ValueError(
                    f"the python sandbox's {field.name}={value!r}: expected a whole number in "
                    "[1, 1e9]"
                )


@dataclasses.dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    wall_s: float
    limit: str | None = None  # the execution-wide bound that ended it ("memory", ...)

    def as_text(self) -> str:
        """What the model reads."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append("error: execution timed out")
        elif self.limit is not None:
            parts.append(f"error: {self.limit} limit exceeded; execution killed")
        elif self.exit_code < 0 and not self.truncated:
            reason = _SIGNALS.get(-self.exit_code, f"killed by signal {-self.exit_code}")
            parts.append(f"error: {reason}")
        if self.truncated:
            parts.append("error: output limit reached; output truncated")
        return "\n".join(parts) if parts else "(no output)"

    @classmethod
    def failure(cls, message: str) -> ExecResult:
        return cls("", f"error: {message}", -9, False, False, 0.0)


_SIGNALS: dict[int, str] = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGKILL: "killed",
    signal.SIGSEGV: "segmentation fault",
}


class SandboxUnavailableError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class MemoryCgroup:
    """Where the sandbox makes its memory cgroups: a folder of this process's own group in the
    memory controller's hierarchy (cgroup ``version`` 1 or 2). Each worker gets a group of its
    own in it (`_Worker`), and its fork server a fresh group in that one per execution."""

    path: Path
    version: int


def _own_memory_group() -> MemoryCgroup:
    """This process's group in the memory controller's hierarchy, from ``/proc/self/cgroup``
    and the mount table; raises OSError naming what is missing."""
    groups = {}  # controller: path in its hierarchy ("" for the unified one, v2)
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        root, mount = fields[3], fields[4]
        fstype, options = fields[-3], fields[-1].split(",")
        if fstype == "cgroup" and "memory" in options and "memory" in groups:
            version, group = 1, groups["memory"]
        elif fstype == "cgroup2" and "" in groups and "memory" not in groups:
            version, group = 2, groups[""]
            if "memory" not in (Path(mount) / "cgroup.controllers").read_text().split():
                continue
        else:
            continue
        if not (group + "/").startswith(root.rstrip("/") + "/"):
            raise OSError(f"this process's memory group {group} is outside the mount of {root}")
        return MemoryCgroup(Path(mount) / group[len(root.rstrip("/")) :].lstrip("/"), version)
    raise OSError("no memory controller is mounted")


def memory_cgroup() -> MemoryCgroup | str:
    """Where the memory groups of executions can be made, or why they cannot (then the fork
    server's accounting is the memory bound): checked by making a group with a limit and
    removing it. Needs the right to make groups under this process's own (root, or a group
    delegated to its user); on cgroup v2 that group must also hand the memory and pids
    controllers to its children, which it can only when it holds no process itself."""
    try:
        cgroup = _own_memory_group()
        probe = cgroup.path / f"jarl-probe-{os.getpid()}-{threading.get_ident()}"
        if cgroup.version == 2:
            _enable_controllers(cgroup.path)
        probe.mkdir()
        try:
            limit = "memory.limit_in_bytes" if cgroup.version == 1 else "memory.max"
            (probe / limit).write_text(str(1 << 30))
        finally:
            probe.rmdir()
    except OSError as e:
        return f"no memory cgroup can be made here ({e})"
    return cgroup


def remove_stale_groups(cgroup: MemoryCgroup) -> None:
    """Removes the worker groups a host that is gone left (killed, it removed none): those of
    ``cgroup`` named for a pid no process has, and their empty subgroups."""
    for group in cgroup.path.glob("jarl-sandbox-*-*"):
        pid = group.name.split("-")[2]
        try:
            os.kill(int(pid), 0)
            continue  # (alive, or another user's)
        except ProcessLookupError:
            pass
        except (PermissionError, ValueError):
            continue
        for path in [*(p for p in group.iterdir() if p.is_dir()), group]:
            with contextlib.suppress(OSError):
                path.rmdir()


def _enable_controllers(group: Path) -> None:
    """cgroup v2: hands the memory and pids controllers to ``group``'s children."""
    control = group / "cgroup.subtree_control"
    if not {"memory", "pids"} <= set(control.read_text().split()):
        control.write_text("+memory +pids")


# /dev: the device nodes --dev binds (but no pseudo-terminals, and no /dev/zero, whose shared
# mappings are memory the execution's accounting cannot see: `seccomp`) and its links
_DEVICES = [
    *(a for node in ("null", "full", "random", "urandom", "tty")
      for a in ("--dev-bind", f"/dev/{node}", f"/dev/{node}")),
    *(a for fd, name in enumerate(("stdin", "stdout", "stderr"))
      for a in ("--symlink", f"/proc/self/fd/{fd}", f"/dev/{name}")),
    "--symlink", "/proc/self/fd", "/dev/fd",
]  # fmt: skip


def zygote_script() -> str:
    """The fork server as one ``python -I -S -c`` script. The sandbox has no jax_agent_rl to
    import from, so `sandbox_reset` is run first into a module of its name in ``sys.modules``,
    where the zygote's import of it finds it."""
    files = resources.files("jax_agent_rl.tools")
    reset = files.joinpath("sandbox_reset.py").read_text()
    name = "jax_agent_rl.tools.sandbox_reset"
    return (
        "import sys, types\n"
        f"sys.modules[{name!r}] = reset = types.ModuleType({name!r})\n"
        f"exec(compile({reset!r}, 'sandbox_reset.py', 'exec'), reset.__dict__)\n"
        "del reset\n" + files.joinpath("sandbox_zygote.py").read_text()
    )


def bwrap_command(bwrap: str, interpreter: str, limits: Limits, seccomp_fd: int) -> list[str]:
    """The bubblewrap command line of one worker's fork server (its pipe fds follow);
    ``seccomp_fd`` holds the filter program."""
    zygote = zygote_script()
    size = str(limits.memory_mb * 1024 * 1024)
    return [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        # for the fork server, in the sandbox's user namespace (see sandbox_zygote); it closes
        # user namespaces itself, as --disable-userns would from a nested one
        "--cap-add", "CAP_SYS_ADMIN",
        "--cap-add", "CAP_SYS_RESOURCE",
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc",
        # not --dev: its devpts needs a nested user namespace, whose capabilities would own none
        # of the sandbox's mounts
        "--tmpfs", "/dev",
        *_DEVICES,
        "--size", size, "--tmpfs", "/dev/shm",
        "--size", size, "--tmpfs", "/tmp",
        "--size", size, "--tmpfs", "/work",
        "--remount-ro", "/dev",
        "--remount-ro", "/",
        "--chdir", "/work",
        "--clearenv",
        "--setenv", "PATH", "/usr/bin",
        "--setenv", "HOME", "/work",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--seccomp", str(seccomp_fd),
        interpreter, "-I", "-S", "-c", zygote,
    ]  # fmt: skip


def seccomp_fd() -> int:
    """A fresh memory file holding the filter, positioned at its start (bubblewrap reads it
    once, so each sandbox gets its own)."""
    fd = os.memfd_create("jarl-seccomp")
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Worker:
    """One sandbox with its fork server; used by one call at a time. With a ``cgroup``, the
    worker has a memory group of its own in it, made afresh at each start and removed when it
    closes, in which the fork server makes each execution's group (`sandbox_zygote`); the fork
    server gets an open folder descriptor of it (it sees no cgroup file system) and is its
    owner there, as in a delegation: the worker group's own files (its limits) stay root's."""

    def __init__(
        self, uid: int, interpreter: str, bwrap: str, limits: Limits, cgroup: MemoryCgroup | None
    ) -> None:
        self.uid, self.interpreter, self.bwrap, self.limits = uid, interpreter, bwrap, limits
        self.cgroup = cgroup
        self.proc: subprocess.Popen[bytes] | None = None
        self._req = self._rep = -1
        self._group: Path | None = None
        self.restarts = 0
        self._start()

    def _make_group(self) -> int:
        """The worker's memory group, made and handed to its uid; an open descriptor of it, or
        -1 without a cgroup."""
        if self.cgroup is None:
            return -1
        # the host's pid (`remove_stale_groups`) and a random part: executions read the name in
        # /proc/self/cgroup, and a counter would tell them how many sandboxes came before
        self._group = self.cgroup.path / f"jarl-sandbox-{os.getpid()}-{secrets.token_hex(8)}"
        self._group.mkdir()
        if self.cgroup.version == 2:
            _enable_controllers(self._group)
            os.chown(self._group / "cgroup.procs", self.uid, self.uid)
        os.chown(self._group, self.uid, self.uid)
        return os.open(self._group, os.O_RDONLY | os.O_DIRECTORY)

    def _remove_group(self) -> None:
        """Removes the worker's group and what its fork server left in it. Called once the
        sandbox's processes are dead: the kernel may still be taking the last of them out of
        a group, so a busy group is tried again for a moment, then left."""
        group, self._group = self._group, None
        if group is None:
            return
        deadline = time.monotonic() + 5.0
        for path in [*(p for p in group.iterdir() if p.is_dir()), group]:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.01)

    def _start(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        # with a cgroup: bubblewrap says the fork server's pid (info) and waits (block) while
        # the host puts it in the worker's group, before it runs
        info_r, info_w = os.pipe() if self.cgroup else (-1, -1)
        block_r, block_w = os.pipe() if self.cgroup else (-1, -1)
        filt, group = seccomp_fd(), -1
        # No preexec_fn (unsafe in a multithreaded process such as one running JAX): the
        # zygote gets its pipe fds as arguments, and Popen itself switches to the worker's
        # uid (one unprivileged uid per worker: RLIMIT_NPROC counts processes per uid).
        # env={}: bubblewrap's own processes are visible inside (/proc/*/environ) and must
        # carry none of the host's secrets.
        as_root = os.getuid() == 0
        try:
            group = self._make_group()
            command = bwrap_command(self.bwrap, self.interpreter, self.limits, filt)
            if self.cgroup:
                at = command.index("--seccomp")
                command[at:at] = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
            self.proc = subprocess.Popen(
                [
                    *command,
                    str(req_r),
                    str(rep_w),
                    execution_filter().hex(),
                    str(group),
                    str(self.cgroup.version if self.cgroup else 0),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=[fd for fd in (req_r, rep_w, filt, group, info_w, block_r) if fd >= 0],
                env={},
                user=self.uid if as_root else None,
                group=self.uid if as_root else None,
                extra_groups=[] if as_root else None,
            )
        except BaseException:
            for fd in (req_w, rep_r, info_r, block_w):
                if fd >= 0:
                    os.close(fd)
            self._remove_group()
            raise
        finally:
            for fd in (req_r, rep_w, filt, group, info_w, block_r):
                if fd >= 0:
                    os.close(fd)
        os.set_blocking(req_w, False)
        self._req, self._rep = req_w, rep_r
        try:
            if self.cgroup:
                self._place_fork_server(info_r, block_w)
            if self._recv(time.monotonic() + 60.0) != {"ready": True}:
                self.proc.kill()
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise SandboxUnavailableError(f"the sandbox did not start: {err.strip()}")
        except BaseException:
            self.close()  # whatever failed, bubblewrap (and the sandbox with it) goes
            raise
        # Only start-up errors come on stderr (the zygote's own is /dev/null once it is
        # ready): the pipe is closed rather than left unread to fill.
        if self.proc.stderr:
            self.proc.stderr.close()

    def _place_fork_server(self, info_r: int, block_w: int) -> None:
        """Puts the fork server, which bubblewrap holds until then, in the worker group's
        ``server`` group: on cgroup v2 a process may move itself only between groups below a
        common one whose ``cgroup.procs`` it may write, so the executions' groups and the fork
        server's must share the worker's. Closes both descriptors."""
        try:
            info = b""
            while not info.rstrip().endswith(b"}"):  # bubblewrap's JSON: {"child-pid": N}
                if not _ready(info_r, select.POLLIN, time.monotonic() + 60.0):
                    raise SandboxUnavailableError("bubblewrap did not say the sandbox's pid")
                chunk = os.read(info_r, 4096)
                if not chunk:
                    raise SandboxUnavailableError("bubblewrap did not say the sandbox's pid")
                info += chunk
            assert self._group is not None
            server = self._group / "server"
            server.mkdir()
            (server / "cgroup.procs").write_text(str(json.loads(info)["child-pid"]))
            os.write(block_w, b"go")
        finally:
            os.close(info_r)
            os.close(block_w)

    def _recv(self, deadline: float) -> dict[str, Any] | None:
        head = self._read(4, deadline)
        if head is None:
            return None
        body = self._read(struct.unpack(">I", head)[0], deadline)
        return None if body is None else json.loads(body)

    def _read(self, n: int, deadline: float) -> bytes | None:
        """``n`` bytes of the reply pipe, or None at end of file or past the deadline."""
        buf = b""
        while len(buf) < n:
            if not _ready(self._rep, select.POLLIN, deadline):
                return None
            chunk = os.read(self._rep, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def _write(self, data: bytes, deadline: float) -> bool:
        view = memoryview(data)
        while view:
            if not _ready(self._req, select.POLLOUT, deadline):
                return False
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(self._req, view) :]
        return True

    def execute(self, code: str, timeout_s: float) -> ExecResult:
        """Runs ``code``; a worker that dies, stops answering or comes back dirty is replaced."""
        frame = json.dumps(
            {"code": code, "timeout_s": timeout_s, "limits": dataclasses.asdict(self.limits)}
        ).encode()
        deadline = time.monotonic() + timeout_s + REPLY_GRACE_S
        try:
            reply = self._recv(deadline) if self._write(_frame(frame), deadline) else None
        except OSError:
            reply = None
        if reply is None or reply["dirty"]:
            self.restart()
        if reply is None:
            return ExecResult.failure("the sandbox stopped answering or died; it was replaced")
        return ExecResult(
            reply["stdout"], reply["stderr"], reply["exit_code"], reply["timed_out"],
            reply["truncated"], reply["wall_s"], reply["limit"],
        )  # fmt: skip

    def restart(self) -> None:
        self.restarts += 1
        self.close()
        self._start()

    def close(self) -> None:
        for fd in (self._req, self._rep):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._req = self._rep = -1  # never write to a closed (and maybe reused) fd number
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()  # --die-with-parent takes the whole sandbox with it
            self.proc.wait()
            if self.proc.stderr:
                self.proc.stderr.close()
        self._remove_group()


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _ready(fd: int, events: int, deadline: float) -> bool:
    """Whether ``fd`` is ready for ``events`` (or closed at the other end) before ``deadline``.
    poll, not select: select cannot watch fds numbered 1024 or more, which a host holding
    many files hands out."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(left * 1000))


class PythonSandbox:
    """A pool of ``size`` sandboxes; ``run`` executes code in a free one. When none is free,
    calls wait their turn by key (`FairPool`; `PythonTool` keys them by trajectory), so one
    trajectory's backlog of calls does not hold up another trajectory's call."""

    def __init__(
        self,
        size: int = 4,
        limits: Limits = Limits(),
        timeout_s: float = 10.0,
        interpreter: str = "/usr/bin/python3",
        first_uid: int = 61000,
        cgroup: bool = True,
    ) -> None:
        """``cgroup=False`` keeps the sandbox off memory cgroups even where they can be made:
        the fork server's accounting is then the memory bound, as it is where none can be."""
        if type(size) is not int or size < 1:
            raise ValueError(
                f"the python sandbox's pool_size={size!r}: expected a whole number >= 1"
            )
        if type(timeout_s) not in (int, float) or not TIMEOUT.ok(timeout_s):
            raise ValueError(  # (past 24.8 days, or not a number: every execution failed)
                f"the python sandbox's timeout_s={timeout_s!r}: expected {TIMEOUT.accepted}"
            )
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailableError("bubblewrap (bwrap) is not installed; run make setup")
        if not Path(interpreter).exists():
            raise SandboxUnavailableError(f"sandbox interpreter {interpreter} does not exist")
        self.limits, self.timeout_s = limits, timeout_s
        found = memory_cgroup() if cgroup else "memory cgroups are turned off"
        self.cgroup = found if isinstance(found, MemoryCgroup) else None
        if self.cgroup is not None:
            remove_stale_groups(self.cgroup)
        # what bounds an execution's memory, as the tool server says at start
        self.memory_bound = (
            f"a memory cgroup per execution (cgroup v{found.version}, under {found.path})"
            if isinstance(found, MemoryCgroup)
            else f"the fork server's accounting of memory it can see ({found}); kernel memory "
            "an execution causes in ways it does not account is not bounded"
        )
        self._workers = [
            _Worker(first_uid + i, interpreter, bwrap, limits, self.cgroup) for i in range(size)
        ]
        self.pool = FairPool(self._workers)
        # blocking pipe I/O runs here, never on the event loop nor in its shared default pool
        self._threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="sandbox")

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self._workers)

    async def run(
        self, code: str, timeout_s: float | None = None, key: Hashable = None
    ) -> ExecResult:
        """Runs ``code`` in a free sandbox; while none is free, the call waits its turn among
        those of other keys. ``timeout_s`` (default: the pool's) counts from when it runs."""
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
            return ExecResult.failure(f"code longer than {MAX_CODE_BYTES} bytes; not run")
        worker = await self.pool.acquire(key)
        try:
            job = self._threads.submit(worker.execute, code, timeout_s or self.timeout_s)
        except BaseException:
            self.pool.release(key, worker)
            raise
        # The worker returns to the pool when its thread is done with it (the host deadline
        # bounds that), never when a caller stops waiting: a cancelled call must not hand a
        # busy worker to the next one. Its thread gives it back, not the caller's event loop,
        # which may have ended by then (`asyncio.run` of a call that timed out).
        job.add_done_callback(lambda _: self.pool.release(key, worker))
        return await asyncio.shield(asyncio.wrap_future(job))

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

    async def close(self) -> None:
        """Stops the pool's sandboxes (the trainer's and the tool server's tools are closed)."""
        self.sandbox.close()

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> str:
        """The trajectory's key in the pool: its calls take turns with other trajectories'
        (the tool server's ids carry their namespace, so its clients' trajectories differ)."""
        del create_kwargs  # none configure a sandbox
        return trajectory_id

    async def execute(self, state: str, arguments: dict[str, Any]) -> ToolResult:
        result = await self.sandbox.run(arguments["code"], key=state)
        error = result.exit_code != 0 or result.timed_out or result.truncated
        return ToolResult(result.as_text(), error=error)
