"""The python sandbox attacked as a policy under RL would attack it.

Each escape attempt runs concurrently with a normal execution on the same pool, and the pool
then serves more normal executions: the other execution's output and every later one must be
exactly what plain Python prints, whatever the attempt did. Each attempt below worked before
the sandbox was hardened (the fork server was dumpable and not pid 1, bubblewrap kept the host's
environment, /dev was writable, locked directories survived the wipe, limits were per process,
nested user namespaces were allowed, and the host waited on a reply forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import resource
import select
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.sandbox import (
    ExecResult,
    Limits,
    MemoryCgroup,
    PythonSandbox,
    PythonTool,
    _Worker,
    memory_cgroup,
)
from jax_agent_rl.tools.seccomp import DENIED, SYSCALLS, filter_program

SECRET = "hf_jarl_test_secret_0123456789"
LIMITS = Limits(cpu_s=2, memory_mb=256, processes=16, files=2000)
ATTACK_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def pool(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    """Under each memory bound: a cgroup per execution, and the fork server's accounting."""
    os.environ["HF_TOKEN"] = SECRET  # a trainer's secret, present when the pool starts
    try:
        sb = PythonSandbox(size=2, limits=LIMITS, timeout_s=3.0, cgroup=sandbox_cgroup)
    finally:
        del os.environ["HF_TOKEN"]
    yield sb
    sb.close()


def run(sb: PythonSandbox, code: str) -> ExecResult:
    return asyncio.run(sb.run(code))


NORMAL = [(f"print({i} * 7)", f"{i * 7}\n") for i in range(6)]


def attack_beside_normal(sb: PythonSandbox, attack: str) -> str:
    """Runs ``attack`` while a normal execution runs on the other worker, then more normal
    executions on both workers; returns the attack's output after checking every other one."""

    async def both() -> tuple[ExecResult, ExecResult]:
        # the attack's wall timeout is far past what any attempt needs, so that its outcome
        # is the bound it hits (memory, files, CPU), never the clock of a loaded machine
        results = await asyncio.gather(sb.run(attack, ATTACK_TIMEOUT_S), sb.run(NORMAL[0][0]))
        return results[0], results[1]

    hostile, normal = asyncio.run(both())
    assert normal.stdout == NORMAL[0][1] and normal.exit_code == 0

    async def after() -> list[str]:
        return [r.stdout for r in await asyncio.gather(*(sb.run(c) for c, _ in NORMAL))]

    assert asyncio.run(after()) == [want for _, want in NORMAL]
    assert run(sb, "print(6 * 7)").stdout == "42\n"
    return hostile.as_text()


# --- 1. the fork server's memory: ptrace and /proc/<pid>/mem ------------------------------

REWRITE_42 = """
import os
# In a forked child the small int 42 lives at the same address as in its parent; its first
# digit is 24 bytes in. Rewriting it in the fork server would make every later 6 * 7 print 43.
with open(f"/proc/{os.getppid()}/mem", "r+b", buffering=0) as mem:
    mem.seek(id(42) + 24)
    mem.write((43).to_bytes(4, "little"))
print("rewrote the fork server")
"""

PTRACE_PARENT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206
print("ptrace", libc.ptrace(PTRACE_SEIZE, os.getppid(), 0, 0), ctypes.get_errno())
"""


def test_fork_server_memory_cannot_be_written(pool: PythonSandbox) -> None:
    """Refused twice over: the fork server is not dumpable (EPERM), and its /proc entries are
    hidden from executions (`sandbox_reset.hide_fork_server`: no such file)."""
    out = attack_beside_normal(pool, REWRITE_42)
    assert "FileNotFoundError" in out and "rewrote" not in out


def test_fork_server_cannot_be_traced(pool: PythonSandbox) -> None:
    out = attack_beside_normal(pool, PTRACE_PARENT)
    assert out == "ptrace -1 1"  # EPERM


def test_other_memory_syscalls_are_denied(pool: PythonSandbox) -> None:
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(8)
class IOV(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
iov = IOV(ctypes.addressof(buf), 8)
SYS_process_vm_readv = {"x86_64": 310, "aarch64": 270}[os.uname().machine]
r = libc.syscall(SYS_process_vm_readv, os.getppid(), ctypes.byref(iov), 1, ctypes.byref(iov), 1, 0)
print("process_vm_readv", r, ctypes.get_errno())
"""
    assert attack_beside_normal(pool, code) == "process_vm_readv -1 1"


# --- 2. the host's environment ------------------------------------------------------------


def test_host_environment_does_not_leak(pool: PythonSandbox) -> None:
    code = """
import os
seen = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("environ", "cmdline"):
            try:
                seen.append(open(f"/proc/{pid}/{name}", "rb").read().decode("latin-1"))
            except OSError:
                pass
print(dict(os.environ), seen)
"""
    assert SECRET not in attack_beside_normal(pool, code)


# --- 3. state that survives an execution --------------------------------------------------

LEAVE_STATE = """
import os
for d in ("/work", "/tmp", "/dev/shm"):
    for mode in (0o500, 0o000):
        path = f"{d}/locked{mode:o}"
        os.makedirs(path + "/inner")
        open(path + "/inner/answer", "w").write("42")
        os.chmod(path + "/inner", mode)
        os.chmod(path, mode)
try:
    open("/dev/answer", "w").write("42")
except OSError as e:
    print("dev:", e.strerror)
os.chmod("/work", 0)
print("left state")
"""

LIST_STATE = """
import os
print(sorted(os.listdir("/dev")), os.listdir("/work"), os.listdir("/tmp"), os.listdir("/dev/shm"))
"""


def test_no_state_survives_an_execution(pool: PythonSandbox) -> None:
    fresh_dev = run(pool, LIST_STATE).stdout
    assert fresh_dev.endswith("[] [] []\n")
    out = attack_beside_normal(pool, LEAVE_STATE)
    assert out == "dev: Read-only file system\nleft state"
    for _ in range(2):  # both workers (one ran the attack) are pristine
        assert run(pool, LIST_STATE).stdout == fresh_dev


def test_system_v_ipc_cannot_carry_state(pool: PythonSandbox) -> None:
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
print(libc.shmget(42, 4096, IPC_CREAT | 0o600), libc.msgget(42, IPC_CREAT | 0o600),
      libc.semget(42, 1, IPC_CREAT | 0o600), ctypes.get_errno())
"""
    assert attack_beside_normal(pool, code) == "-1 -1 -1 1"


def test_memory_files_are_denied(pool: PythonSandbox) -> None:
    """A memory file written with write() (never mapped) is in no resident set and on no
    mount: many of them would slip past the execution's memory accounting."""
    out = attack_beside_normal(pool, "import os\nos.memfd_create('hoard')")
    assert "PermissionError" in out


def test_a_tree_past_path_max_is_discarded(pool: PythonSandbox) -> None:
    """A tree whose paths are longer than PATH_MAX (no walk of it could remove it) goes with
    the tmpfs mount it is on: the next execution finds an empty /work on a fresh mount."""
    before = pool.restarts
    deep = """
import os
os.chdir("/work")
for _ in range(20):
    os.mkdir("d" * 250)
    os.chdir("d" * 250)
open("answer", "w").write("42")
print("deep")
"""
    assert attack_beside_normal(pool, deep) == "deep"
    assert pool.restarts == before
    assert run(pool, "import os; print(os.listdir('/work'))").stdout == "[]\n"


# --- 4. limits per execution, not per process; no nested namespaces ----------------------

CHILDREN_HOLD_MEMORY = """
import os, time
for _ in range(8):
    if os.fork() == 0:
        block = bytearray(100 * 1024 * 1024)
        time.sleep(30)
        os._exit(0)
time.sleep(30)
"""


def test_memory_is_bounded_per_execution(pool: PythonSandbox) -> None:
    out = attack_beside_normal(pool, CHILDREN_HOLD_MEMORY)
    assert "memory limit exceeded" in out


def test_tmpfs_counts_against_memory(pool: PythonSandbox) -> None:
    code = """
chunk = b"0" * (8 * 1024 * 1024)
for i in range(64):  # 512 MB over several tmpfs mounts and files, each under file_size_mb
    open(f"/dev/shm/f{i}" if i % 2 else f"/tmp/f{i}", "wb").write(chunk)
print("wrote 512 MB")
"""
    out = attack_beside_normal(pool, code)
    assert "wrote" not in out and ("memory limit exceeded" in out or "No space left" in out)


def test_a_kernel_kill_at_the_groups_bound_is_reported_as_memory(sandbox_cgroup: bool) -> None:
    """Filling tmpfs past a 64 MB group gets the writer killed by the kernel, often before the
    watchdog's next look: the group's counts (its OOM kill) still name the bound. Reported
    "killed" 7 times in 15 before; every time now. Under the accounting, the watchdog or the
    mounts' size stop it."""
    code = """
chunk = b"0" * (8 * 1024 * 1024)
for i in range(64):
    open(f"/dev/shm/f{i}" if i % 2 else f"/tmp/f{i}", "wb").write(chunk)
print("wrote 512 MB")
"""
    for out in _runs_under_64_mb(code, 10, sandbox_cgroup):
        assert "wrote" not in out
        bound = "memory limit exceeded" in out
        assert bound if sandbox_cgroup else bound or "No space left" in out, out


def _runs_under_64_mb(code: str, times: int, cgroup: bool) -> list[str]:
    """What ``code`` says in each of ``times`` executions of one worker bounded at 64 MB."""
    sb = PythonSandbox(size=1, limits=dataclasses.replace(LIMITS, memory_mb=64), timeout_s=60.0,
                       cgroup=cgroup)  # fmt: skip
    try:
        return [run(sb, code).as_text() for _ in range(times)]
    finally:
        sb.close()


def test_a_child_killed_at_the_bound_reports_memory_though_its_parent_exits_well(
    sandbox_cgroup: bool,
) -> None:
    """A forked child fills tmpfs past the group's bound and is killed by the kernel; its
    parent waits and exits 0 on its own: the execution still reports its memory bound (the
    group's OOM kill count), not a clean exit (found by a review: only a SIGKILL of the
    direct child was read). Under the accounting the watchdog or the mounts' size stop it."""
    code = """
import os
pid = os.fork()
if pid == 0:
    chunk = b"0" * (8 * 1024 * 1024)
    for i in range(64):
        open(f"/dev/shm/g{i}" if i % 2 else f"/tmp/g{i}", "wb").write(chunk)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("parent done")
"""
    for out in _runs_under_64_mb(code, 5, sandbox_cgroup):
        bound = "memory limit exceeded" in out
        assert bound if sandbox_cgroup else bound or "No space left" in out, out


def test_cpu_is_bounded_per_execution() -> None:
    """Four processes spinning 1.5 s each stay under the per-process rlimit of 2 s, but not
    under the execution's 2 s, measured from their CPU time (not the wall clock)."""
    code = """
import os, resource
for _ in range(4):
    if os.fork() == 0:
        while resource.getrusage(resource.RUSAGE_SELF).ru_utime < 1.5:
            pass
        os._exit(0)
for _ in range(4):
    os.wait()
print("spun 6 CPU seconds")
"""
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=60.0)
    try:
        out = run(sb, code).as_text()
    finally:
        sb.close()
    assert "CPU time limit exceeded" in out and "spun" not in out


def test_file_count_is_bounded(pool: PythonSandbox) -> None:
    code = """
for i in range(5000):
    open(f"/work/{i}", "w").close()
print("made 5000 files")
"""
    out = attack_beside_normal(pool, code)
    assert "file count limit exceeded" in out


def test_no_nested_user_namespace(pool: PythonSandbox) -> None:
    code = """
import ctypes, subprocess
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER = 0x10000000
print("unshare", libc.unshare(CLONE_NEWUSER), ctypes.get_errno())
print(subprocess.run(["unshare", "-r", "id"], capture_output=True).returncode != 0)
"""
    assert attack_beside_normal(pool, code) == "unshare -1 1\nTrue"


# --- 5. stalling the fork server ----------------------------------------------------------


@pytest.mark.timeout(300)  # before the fix the host waited on the stopped server forever
def test_stopping_the_fork_server_does_nothing(pool: PythonSandbox) -> None:
    """SIGSTOP or SIGKILL to the parent (the namespace's init) is dropped by the kernel."""
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nprint('still here')"
    before = pool.restarts
    for _ in range(5):  # more than the pool has workers
        assert attack_beside_normal(pool, code) == "still here"
    kill = "import os, signal\nos.kill(1, signal.SIGKILL)\nprint('alive')"
    assert attack_beside_normal(pool, kill) == "alive"
    assert pool.restarts == before


def test_interrupting_the_fork_server_does_nothing(pool: PythonSandbox) -> None:
    """SIGINT reached the fork server: Python's own handler (KeyboardInterrupt) is one the
    kernel delivers to a namespace's init, and it ended it (the sandbox replaced). The fork
    server has no handler now; an execution's own SIGINT is still its KeyboardInterrupt."""
    before = pool.restarts
    code = "import os, signal\nos.kill(1, signal.SIGINT)\nprint('alive')"
    assert attack_beside_normal(pool, code) == "alive"
    own = asyncio.run(pool.run("import os, signal\nos.kill(os.getpid(), signal.SIGINT)"))
    assert own.exit_code == 1 and own.stderr.endswith("KeyboardInterrupt\n"), own.as_text()
    assert pool.restarts == before


def _zygotes(sb: PythonSandbox) -> list[int]:
    """Host pids of the pool's fork servers (the children of each bwrap process)."""
    parents = {w.proc.pid for w in sb._workers if w.proc is not None}
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(re.split(r"\) ", (entry / "stat").read_text(), maxsplit=1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid in parents:
                pids.append(int(entry.name))
    return pids


def test_host_deadline_replaces_a_silent_worker() -> None:
    """A fork server stopped from outside (as by a kernel stall) never answers: the host's
    deadline kills and replaces it, and the call gets an error instead of hanging."""
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=1.0)
    try:
        (zygote,) = _zygotes(sb)
        os.kill(zygote, signal.SIGSTOP)
        out = run(sb, "print(1)")
        assert "stopped answering" in out.as_text() and sb.restarts == 1
        assert run(sb, "print(6 * 7)").stdout == "42\n"
    finally:
        sb.close()


def test_worker_is_not_reused_while_a_call_waits_on_it() -> None:
    """A caller that gives up (the executor's timeout) must not hand its busy worker to the
    next call: with one worker, the next call waits for it and gets its own answer."""
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=10.0)
    tools = LocalTools(ToolRegistry([PythonTool(sb)]), timeout_s=0.2)

    async def calls() -> list[str]:
        slow = "import time\nfor _ in range(40):\n    time.sleep(0.05)\nprint('slow done')"
        first = await tools.call("t1", "python", {"code": slow})
        assert "timed out" in first.text
        results = await asyncio.gather(
            *(sb.run(f"print({i})") for i in range(4)),
        )
        return [r.stdout for r in results]

    try:
        assert asyncio.run(calls()) == [f"{i}\n" for i in range(4)]
    finally:
        sb.close()


def test_closing_leaves_no_process() -> None:
    sb = PythonSandbox(size=2, limits=LIMITS)
    handles = [os.pidfd_open(pid) for pid in _zygotes(sb)]
    assert len(handles) == 2
    sb.close()
    # bwrap was killed and reaped; each fork server dies with it (--die-with-parent): a
    # pidfd becomes readable when its process has exited
    for fd in handles:
        assert select.select([fd], [], [], 120)[0] == [fd]
        os.close(fd)


# --- the filter itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "header"),
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        ("aarch64", "/usr/include/asm-generic/unistd.h"),
    ],
)
def test_syscall_tables_match_kernel_headers(machine: str, header: str) -> None:
    if not Path(header).exists():
        pytest.skip(f"{header} is not installed (package linux-libc-dev)")
    text = Path(header).read_text()
    numbers = dict(re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text))
    _, table = SYSCALLS[machine]
    # (cachestat, Linux 6.5, is newer than some headers: its number is the same on every ABI)
    known = {name: nr for name, nr in table.items() if name in numbers or name != "cachestat"}
    assert {name: str(nr) for name, nr in known.items()} == {n: numbers[n] for n in known}
    assert {n for n in DENIED if n in numbers} <= set(table)
    assert len(filter_program(machine)) % 8 == 0


# --- the fork server's own surface: the roots' metadata, its stderr, compiling, its pipes ---
#     (each attempt below worked against the fork server before: see docs/sandbox.md)

POISON_ROOTS = """
import os, struct

def acl(*entries):  # the kernel's binary ACL: a version, then (tag, permissions, id) each
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)

ANY, USER_OBJ, USER, GROUP_OBJ, MASK, OTHER = 0xFFFFFFFF, 0x01, 0x02, 0x04, 0x10, 0x20
nobody = acl((USER_OBJ, 0, ANY), (GROUP_OBJ, 0, ANY), (OTHER, 0, ANY))
named = acl((USER_OBJ, 7, ANY), (USER, 7, os.getuid()), (GROUP_OBJ, 5, ANY), (MASK, 7, ANY),
            (OTHER, 5, ANY))  # a named entry: the only uid mapped in the sandbox is its own
for root in ("/work", "/tmp", "/dev/shm"):
    os.setxattr(root, "system.posix_acl_default", nobody)  # later files: no one may read them
    os.setxattr(root, "system.posix_acl_access", named)
    try:
        os.setxattr(root, "user.answer", b"42")
    except OSError as e:  # tmpfs has user.* attributes since Linux 6.6
        print("user xattr:", e.strerror)
    os.utime(root, (424242, 424242))
print("poisoned")
"""

PROBE_ROOTS = """
import os, stat
for root in ("/work", "/tmp", "/dev/shm"):
    st = os.stat(root)
    print(root, os.listxattr(root), oct(stat.S_IMODE(st.st_mode)), int(st.st_mtime) != 424242)
    with open(f"{root}/f", "w") as f:
        f.write("42")
    print(open(f"{root}/f").read())
"""


def test_roots_metadata_does_not_survive(pool: PythonSandbox) -> None:
    """A default ACL of no permissions on a root made every later execution on that worker
    unable to read the files it wrote (the sweep emptied and chmodded the roots, nothing
    more); attributes and times passed bits to later executions."""
    pristine = "/work [] 0o755 True\n42\n/tmp [] 0o1777 True\n42\n/dev/shm [] 0o1777 True\n42"
    before = pool.restarts
    assert attack_beside_normal(pool, POISON_ROOTS).endswith("poisoned")
    for worker in pool._workers:  # each worker, whichever ran the attack
        assert worker.execute(PROBE_ROOTS, ATTACK_TIMEOUT_S).as_text() == pristine
    assert pool.restarts == before  # restored, not replaced


def test_syntax_warnings_go_to_the_execution() -> None:
    """compile() ran in the fork server and wrote its warnings to a stderr pipe nobody read:
    ~64 KB of them (9 per call, the 88th call) stopped the worker for every later caller."""
    code = "\n".join(f"x{i} = {i} is {i}" for i in range(100)) + "\nprint('ok', x99)"
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=10.0)
    try:
        results = [run(sb, code) for _ in range(20)]  # ~7 KB of warnings each
    finally:
        sb.close()
    assert [(r.stdout, r.exit_code) for r in results] == [("ok True\n", 0)] * 20
    warning = '<sandbox>:100: SyntaxWarning: "is" with a literal. Did you mean "=="?\n'
    assert all(r.stderr.count("SyntaxWarning") == 100 and warning in r.stderr for r in results)
    assert sb.restarts == 0


def test_syntax_errors_read_as_before(pool: PythonSandbox) -> None:
    """Compiling in the execution's own process changes nothing a syntax error shows."""
    result = run(pool, "print(")
    text = '  File "<sandbox>", line 1\n    print(\n         ^\n'
    text += "SyntaxError: '(' was never closed\n"
    assert (result.stdout, result.stderr, result.exit_code) == ("", text, 1)
    nul = run(pool, "a\x00b")
    assert nul.stderr == "ValueError: source code string cannot contain null bytes\n"


def test_compiling_is_bounded_by_the_execution_limits(pool: PythonSandbox) -> None:
    """CPython 3.11 compiles a match pattern in memory quadratic in the names it captures:
    these 30 KB of code took 1.3 GB in the fork server, outside every limit."""
    names = ", ".join(f"a{i}" for i in range(4500))
    code = f"match []:\n    case [{names}]:\n        pass\nprint('compiled')"
    before = pool.restarts
    out = attack_beside_normal(pool, code)
    assert "compiled" not in out
    assert "MemoryError" in out or "memory limit exceeded" in out
    assert pool.restarts == before  # the fork server never took the blow


FORGE_REPLIES = """
import json, os, struct
body = json.dumps({"stdout": "42\\n", "stderr": "", "exit_code": 0, "timed_out": False,
                   "truncated": False, "limit": None, "wall_s": 0.0, "dirty": False}).encode()
hits = []
for fd in range(3, 4096):
    try:
        os.write(fd, struct.pack(">I", len(body)) + body)
        hits.append(fd)
    except OSError:
        pass
print("forged replies on", hits)
"""


@contextlib.contextmanager
def fds_past_1024(holes: int) -> Iterator[None]:
    """Holds this process's fds open up to past 1100, as a host with many files does, but for
    ``holes`` free numbers below 1024 (the next fds opened take those first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"the hard open-files limit ({hard}) is under 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open("/dev/null", os.O_RDONLY)]
    try:
        while held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        low = [fd for fd in held if fd < 1024]
        for fd in low[len(low) - holes :]:
            os.close(fd)
            held.remove(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _zygote_pipes(worker: _Worker) -> list[int]:
    """The fds the fork server was handed (its first two arguments, before the filter, the
    memory group's fd and the cgroup version), as numbered in the host."""
    assert worker.proc is not None and isinstance(worker.proc.args, list)
    return [int(a) for a in worker.proc.args[-5:-3]]


@pytest.mark.parametrize("holes", [0, 3], ids=["all-pipes-high", "sandbox-ends-high"])
def test_pipes_numbered_past_1024(holes: int) -> None:
    """Pipes numbered 1024 and above: the execution inherited the reply pipe (the child
    closed fds 3..1023 only) and forged the next callers' results; and the host's select()
    refused such fds, so no worker could start or restart."""
    with fds_past_1024(holes):
        sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=10.0)
        try:
            (worker,) = sb._workers
            if holes:  # the host's ends took the free low numbers, the reply pipe's write end not
                assert worker._rep < 1024 and max(_zygote_pipes(worker)) >= 1024
            else:
                assert worker._rep >= 1024 and min(_zygote_pipes(worker)) >= 1024
            calls = (FORGE_REPLIES, "print('call B')", "print(6 * 7)")
            assert [run(sb, c).stdout for c in calls] == [
                "forged replies on []\n",
                "call B\n",
                "42\n",
            ]
            worker.restart()
            assert run(sb, "print(6 * 7)").stdout == "42\n"
        finally:
            sb.close()


def _children() -> set[int]:
    return {
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_a_failed_start_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch, sandbox_cgroup: bool
) -> None:
    """A start that fails for any reason (select() raising on a high fd did) kills the
    bubblewrap it started, and removes the worker's memory group."""
    found = memory_cgroup() if sandbox_cgroup else None
    cgroup = found if isinstance(found, MemoryCgroup) else None
    # (this process's: another process's sandboxes beside it make and remove their own)
    ours = lambda: set(cgroup.path.glob(f"jarl-sandbox-{os.getpid()}-*")) if cgroup else set()  # noqa: E731
    groups = ours()

    def no_ready_frame(self: _Worker, deadline: float) -> dict[str, Any] | None:
        del self, deadline
        raise RuntimeError("no ready frame")

    before = _children()
    monkeypatch.setattr(_Worker, "_recv", no_ready_frame)
    with pytest.raises(RuntimeError, match="no ready frame"):
        _Worker(61000, "/usr/bin/python3", shutil.which("bwrap") or "bwrap", LIMITS, cgroup)
    assert _children() == before
    assert ours() == groups


CAPABILITIES = """
import ctypes, os
status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines())
print({k: status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")})
libc = ctypes.CDLL(None, use_errno=True)
print("mount", libc.mount(b"tmpfs", b"/work", b"tmpfs", 0, None), ctypes.get_errno())
print("umount", libc.umount2(b"/tmp", 2), ctypes.get_errno())
try:
    open("/proc/sys/user/max_user_namespaces", "w").write("10")
except OSError as e:
    print("user namespaces stay closed:", e.strerror)
try:
    os.pwrite(os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY), b"100", 0)
except OSError as e:
    print("pid counter:", e.strerror)
"""


def test_executions_hold_no_capability(pool: PythonSandbox) -> None:
    """The fork server keeps CAP_SYS_ADMIN of the sandbox's user namespace (it remounts the
    writable places and resets the pid counter); an execution must hold none of it, nor gain
    any: mount, the pid counter and the user-namespace switch stay out of its reach."""
    zero = "0000000000000000"
    assert attack_beside_normal(pool, CAPABILITIES) == "\n".join(
        [
            str(
                {"CapInh": zero, "CapPrm": zero, "CapEff": zero, "CapAmb": zero, "NoNewPrivs": "1"}
            ),
            "mount -1 1",
            "umount -1 1",
            "user namespaces stay closed: Permission denied",
            "pid counter: Operation not permitted",
        ]
    )
