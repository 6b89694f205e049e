"""The python sandbox's memory bound attacked with kernel memory no process's resident set
shows, at ``memory_mb=64``, under both bounds (`sandbox_cgroup`): a memory cgroup per
execution, where the kernel charges the execution every byte it causes (socket filters,
Landlock rulesets, pipe buffers, dentries, page tables, tmpfs pages) and the fork server ends
it at the bound; and the fork server's accounting, the fallback where no cgroup can be made,
which sees resident sets, tmpfs usage and socket queues only. Each test's name says what
each bound does with its attack; every attack ends in a pool that still serves.

Measured here (kernel 6.18, cgroup v1): with the cgroup each attack is killed at the bound
and reported ``memory``; without it, 1,200 socket filters and 30 processes' pipe buffers are
killed through their 20 and 30 processes' resident sets (a single process's 64 open files
cannot hold more than its resident set), while 20 Landlock domains held by zombies (~90 MB of
slab, resident set 0) and 300,000 negative dentries (~130 MB, reclaimable) are held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from jax_agent_rl.tools.sandbox import ExecResult, Limits, PythonSandbox

LIMITS = Limits(cpu_s=30, memory_mb=64, processes=32, files=2000)


@pytest.fixture(scope="module")
def pool(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    # the wall timeout is far past what any attack needs: the outcome is the bound it hits
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=120.0, cgroup=sandbox_cgroup)
    assert (sb.cgroup is not None) == sandbox_cgroup, sb.memory_bound
    yield sb
    sb.close()


def attack(pool: PythonSandbox, code: str) -> ExecResult:
    """Runs ``code``, then checks that the pool still serves."""
    result = asyncio.run(pool.run(code))
    assert asyncio.run(pool.run("print(6 * 7)")).stdout == "42\n"
    return result


SOCKET_FILTERS = """
import ctypes, os, socket, struct, time
insns = ctypes.create_string_buffer(struct.pack("=HBBI", 0x06, 0, 0, 0xFFFF) * 4096)
fprog = struct.pack("=HxxxxxxQ", 4096, ctypes.addressof(insns))  # struct sock_fprog
r, w = os.pipe()
for _ in range(20):  # 20 processes of 60 sockets (64 open files each): 1,200 filters
    if os.fork() == 0:
        held = []
        try:
            for _ in range(60):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, 26, fprog)  # SO_ATTACH_FILTER
                held.append(s)
        finally:
            os.write(w, b"+" if len(held) == 60 else b"-")
        time.sleep(60)
        os._exit(0)
done = b""
while len(done) < 20:  # each child says when it holds its sockets (or failed to)
    done += os.read(r, 20)
print(f"held {done.count(b'+') * 60} filters", flush=True)
time.sleep(1)  # held: the watchdog reads the memory at least every 10 ms
print("kept them")
"""


def test_socket_filters_are_killed_by_the_cgroup_and_by_the_accounting_of_their_processes(
    pool: PythonSandbox,
) -> None:
    """1,200 Unix sockets with 4,096-instruction filters held ~99 MB of kernel memory under
    ``memory_mb=64``. The cgroup is charged the filters; the accounting sees only the 20
    processes that hold them (their resident sets pass the bound first)."""
    result = attack(pool, SOCKET_FILTERS)
    assert result.limit == "memory" and "kept them" not in result.stdout, result


LANDLOCK_DOMAINS = """
import ctypes, os, struct, time
libc = ctypes.CDLL(None, use_errno=True)
attr = struct.pack("=QQ", 0, 3)  # handled_access_net: bind and connect TCP
def restrict(rules):
    fd = libc.syscall(444, attr, len(attr), 0)  # landlock_create_ruleset
    assert fd >= 0, os.strerror(ctypes.get_errno())
    for port in range(rules):  # landlock_add_rule, LANDLOCK_RULE_NET_PORT: bind on port
        assert libc.syscall(445, fd, 2, struct.pack("=QQ", 1, port), 0) == 0
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which landlock_restrict_self needs
    assert libc.syscall(446, fd, 0) == 0  # landlock_restrict_self
for i in range(20):  # children never reaped, each holding a domain of 60,000 rules
    pid = os.fork()
    if pid == 0:
        restrict(60000)
        os._exit(0)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a zombie now, resident set 0
print("held 20 domains", flush=True)
time.sleep(1)  # held: the watchdog reads the memory at least every 10 ms
print("kept them")
"""


def test_landlock_domains_of_zombies_are_killed_by_the_cgroup_and_held_past_the_accounting(
    pool: PythonSandbox, sandbox_cgroup: bool
) -> None:
    """28 unreaped children each holding a 60,000-rule Landlock domain held ~112 MB of slab
    with a resident set of 0 (syscalls 444-446 are allowed). The cgroup is charged the
    rulesets; the accounting sees nothing of them."""
    result = attack(pool, LANDLOCK_DOMAINS)
    if sandbox_cgroup:
        assert result.limit == "memory" and "kept them" not in result.stdout, result
    else:
        assert result.limit is None and result.stdout.endswith("kept them\n"), result


PIPE_BUFFERS = """
import os, time
r, w = os.pipe()
for _ in range(30):  # 30 processes, each filling 29 pipes (64 open files each)
    if os.fork() == 0:
        held = []
        try:
            for _ in range(29):
                pipe = os.pipe()
                os.set_blocking(pipe[1], False)
                try:
                    while True:
                        os.write(pipe[1], b"x" * 65536)
                except BlockingIOError:
                    held.append(pipe)
        finally:
            os.write(w, b"+")
        time.sleep(60)
        os._exit(0)
done = b""
while len(done) < 30:  # each child says when its pipes are full
    done += os.read(r, 30)
print("filled them", flush=True)
time.sleep(1)
print("kept them")
"""


def test_pipe_buffers_are_killed_by_the_cgroup_and_by_the_accounting_of_their_processes(
    pool: PythonSandbox,
) -> None:
    """Pipe buffers are kernel memory (64.6 MB of them were held under ``memory_mb=32``). The
    cgroup is charged them; the accounting sees the 30 processes that hold them."""
    result = attack(pool, PIPE_BUFFERS)
    assert result.limit == "memory" and "kept them" not in result.stdout, result


NEGATIVE_DENTRIES = """
import os, random, time
name = "%016x" % random.getrandbits(64) + "n" * 184  # long names: each dentry keeps its own
for i in range(300000):  # lookups of names that do not exist, each a negative dentry
    try:
        os.stat(f"/usr/{name}{i}")
    except FileNotFoundError:
        pass
print("looked them up", flush=True)
time.sleep(1)
print("kept them")
"""


def test_negative_dentries_are_killed_by_the_cgroup_and_held_past_the_accounting(
    pool: PythonSandbox, sandbox_cgroup: bool
) -> None:
    """A lookup of a name that does not exist leaves a negative dentry in the kernel's cache:
    86 MB of them were held (reclaimable). The cgroup is charged them and reclaims them at
    its bound, which is the execution's end; the accounting sees none."""
    result = attack(pool, NEGATIVE_DENTRIES)
    if sandbox_cgroup:
        assert result.limit == "memory" and "kept them" not in result.stdout, result
    else:
        assert result.limit is None and result.stdout.endswith("kept them\n"), result


HIDE_IN_FLIGHT = """
import array, socket
held = []
for bit in range(16):  # 0xBEEF as which of 16 abstract names are bound
    if 0xBEEF >> bit & 1:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(f"\\0jarl-covert-{bit}")
        held.append(s)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
# sent into b's own queue with b itself: a cycle that no close frees, only the kernel's
# garbage collector, some time after the execution's processes are gone
fds = array.array("i", [a.fileno(), b.fileno(), *(s.fileno() for s in held)])
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
print("hidden")
"""

READ_NAMES = """
import socket
value = 0
for bit in range(16):
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).bind(f"\\0jarl-covert-{bit}")
    except OSError:
        value |= 1 << bit
print(hex(value))
"""


def test_sockets_held_in_flight_carry_nothing_to_the_next_execution(pool: PythonSandbox) -> None:
    """Sockets bound to abstract names and sent, in a cycle, over a Unix socket outlived the
    execution until the kernel's garbage collector ran, and the next execution on the worker
    read which names were bound: 0xBEEF in 4 to 6 of 12 tries. The fork server now finds any
    socket left in the sandbox's network namespace after the sweep and replaces the sandbox."""
    reads = []
    for _ in range(12):
        assert asyncio.run(pool.run(HIDE_IN_FLIGHT)).stdout == "hidden\n"
        reads.append(asyncio.run(pool.run(READ_NAMES)).stdout)
    assert reads == ["0x0\n"] * 12


def test_executions_write_no_core_file(pool: PythonSandbox) -> None:
    """No core file of an execution, nor of a program it starts: ``RLIMIT_CORE`` is 0, hard
    and soft, so no process of it can raise it (a core file is the process's memory, written
    where the host's ``core_pattern`` says, maybe outside the sandbox)."""
    code = """
import resource, subprocess, sys
print(resource.getrlimit(resource.RLIMIT_CORE))
try:
    resource.setrlimit(resource.RLIMIT_CORE, (1 << 20, 1 << 20))
except ValueError as e:
    print(e)
print(subprocess.run([sys.executable, "-c", "import resource; print(resource.getrlimit(4))"],
                     capture_output=True, text=True).stdout, end="")
"""
    assert asyncio.run(pool.run(code)).stdout == (
        "(0, 0)\nnot allowed to raise maximum limit\n(0, 0)\n"
    )
