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

Memory the fork server's accounting could not see, and which the tests below keep counted or
refused under both bounds: data queued in Unix socket pairs (219 MB held under
``memory_mb=64``); shared anonymous pages (``mmap(-1, n)``, ``/dev/zero``) filled by children
that then exited (576 MB held by 4 processes under ``memory_mb=256``); netlink sockets'
unread replies (about 224 MB under ``memory_mb=64``). And memory the kernel's own accounting
missed too:

- Loopback TCP: a sender's data sits in pieces of 32 KB pages that its task shares between
  all its sockets, and the kernel charges each piece its bytes. One byte queued on a
  connection that is never read, then 32 KB sent and read on another, put each queued byte on
  a page of its own: 200 KB queued (what ``/proc/net/tcp`` and any socket reading counts) held
  3.3 GB under ``memory_mb=64``, in plain ``send`` calls. ``sendfile`` of one byte from each
  4 KB page of a ``/tmp`` file into such a connection, the file then deleted, held 305 MB per
  connection, counted as 78 KB.
- ``vmsplice``: a pipe's 4 KB slot kept the whole 2 MB huge page it came from after the
  process unmapped it: 28 pipes of one process held 974 MB while its resident set read 12 MB.
- Transparent huge pages kept whole while 4 KB of each stayed mapped: 400 of them held
  826 MB while the process's resident set read 13 MB (until memory pressure splits them).
- POSIX timers, bounded only by the host's RLIMIT_SIGPENDING: 96,365 of one process, ~55 MB.
- Unix data whose sender closed stays in the receiver's queue, charged to a socket no dump
  lists: 56 receivers of one process held 439 MB under ``memory_mb=64``, and 500 connections
  a listening socket never accepted held 111 MB.

Executions now open no inet socket, cannot hand pages by reference to pipes or sockets
(``vmsplice``, ``splice``, ``tee``, ``sendfile``), get no transparent huge pages, get 256
timers and queued signals, and cannot raise a send buffer; the watchdog charges a Unix socket
left with a dead sender's data the most that sender can have left.
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
time.sleep(50)  # held until the bound ends it, however late a busy host lets it read
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
time.sleep(50)  # held until the bound ends it, however late a busy host lets it read
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


FILL_UNIX_QUEUES = """
import socket, time
held, queued = [], 0
for _ in range(30):  # (64 file descriptors a process; send buffers are the kernel's default)
    pair = socket.socketpair()
    for sender in pair:  # each way: each end's write queue
        sender.setblocking(False)
        while True:
            try:
                queued += sender.send(b"x" * 65536)
            except BlockingIOError:
                break
    held += pair
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(f"queued {queued >> 20} MB beside {rss >> 20} MB resident", flush=True)
if (queued >> 20) + (rss >> 20) >= BOUND_MB:  # held until the bound ends it (the run's
    time.sleep(50)  # timeout, 60 s, is what a watchdog that never counts them would meet)
print("kept them")
"""


def test_unix_socket_queues_count_toward_the_memory_limit(sandbox_cgroup: bool) -> None:
    """Data queued in Unix socket pairs is kernel memory in no process's resident set, and the
    watchdog counted only TCP and UDP queues: 28 pairs of one process held 219 MB under
    ``memory_mb=64``. The fork server now reads every Unix socket's queue (the kernel's socket
    diagnostics, a netlink socket executions cannot open). No send buffer can be raised
    (`test_executions_open_no_inet_socket`), so 30 pairs filled both ways queue ~12 MB: the
    bound is set where they and the process's resident set (~12 MB) cross it."""
    limits = Limits(cpu_s=5, memory_mb=22, processes=16, files=2000)
    sb = PythonSandbox(
        size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup
    )  # (the memory bound ends it first; held until then, however late a busy host reads)
    try:
        code = FILL_UNIX_QUEUES.replace("BOUND_MB", str(limits.memory_mb))
        result = asyncio.run(sb.run(code))
        small = asyncio.run(sb.run(SMALL_QUEUE))
    finally:
        sb.close()
    assert small.stdout == "queued 100000\nread 10\nno diagnostics\n", small
    if result.limit != "memory":
        assert result.stdout.endswith("kept them\n"), result
        queued, resident = int(result.stdout.split()[1]), int(result.stdout.split()[4])
        assert queued + resident < limits.memory_mb, result  # held past the bound, uncounted
        # a kernel whose socket buffers cannot reach the bound has no escape to show: what it
        # held is asserted under the bound above, and the counting is not exercised here
        pytest.skip(f"this kernel queued only {queued} MB beside {resident} MB resident")
    assert "kept them" not in result.stdout


SMALL_QUEUE = """
import socket
a, b = socket.socketpair()
a.setblocking(False)
print("queued", a.send(b"x" * 100000))
print("read", len(b.recv(10)))
try:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4)  # NETLINK_SOCK_DIAG
except OSError:
    print("no diagnostics")
"""


# three holders each map shared anonymous memory (within their address space's rlimit), and
# short-lived children fill it chunk by chunk, each exiting: the pages stay, in the resident
# set of no process alive (the holders never touch them)
FILL_SHARED_ANONYMOUS = """
import mmap, os, time
SIZE, CHUNK = 24 << 20, 8 << 20
try:
    os.open("/dev/zero", os.O_RDWR)
except OSError as e:
    print("/dev/zero:", e.strerror, flush=True)
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        try:
            m = mmap.mmap(-1, SIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        except OSError as e:
            print("shared anonymous:", e.strerror, flush=True)
            os._exit(1)
        for off in range(0, SIZE, CHUNK):
            if os.fork() == 0:
                for i in range(off, off + CHUNK, 4096):
                    m[i] = 1
                os._exit(0)
            os.wait()
        os.write(w, b"x")
        time.sleep(2)
        os._exit(0)
os.close(w)
held = len(os.read(r, 3) + os.read(r, 3) + os.read(r, 3))
print(f"held {held * SIZE >> 20} MB", flush=True)
time.sleep(1)  # held: the watchdog reads the memory at least every 10 ms
print("kept them")
"""


def test_shared_anonymous_memory_is_refused_to_executions(sandbox_cgroup: bool) -> None:
    """Shared anonymous pages (``mmap(-1, ...)``'s default, or a shared map of ``/dev/zero``)
    are in no mount's usage and only in the resident set of the processes that touched them:
    4 holders whose children filled their mappings and exited held 576 MB under
    ``memory_mb=256``. Executions now get EPERM for such a mapping and find no ``/dev/zero``;
    private mappings and shared ones of files (counted) still work. (At this test's small
    scale the children's own resident sets may cross the bound first: the refusal is what
    it checks.)"""
    limits = Limits(cpu_s=5, memory_mb=64, processes=16, files=2000)
    sb = PythonSandbox(size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup)
    try:
        result = asyncio.run(sb.run(FILL_SHARED_ANONYMOUS))
        works = asyncio.run(sb.run(PRIVATE_AND_FILE_MAPPINGS))
    finally:
        sb.close()
    out = result.stdout
    assert "shared anonymous: Operation not permitted" in out, result
    assert "/dev/zero: No such file or directory" in out and "held 0 MB" in out, result
    assert works.stdout == "1 9\n", works


PRIVATE_AND_FILE_MAPPINGS = """
import mmap, os
private = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
private[0] = 1
fd = os.open("/dev/shm/f", os.O_RDWR | os.O_CREAT)
os.ftruncate(fd, 4096)
shared = mmap.mmap(fd, 4096)
shared[0] = 9
print(private[0], shared[0])
"""


FILL_NETLINK_QUEUES = """
import socket, struct, time
# RTM_GETLINK of the loopback interface (index 1): a reply of about 1 KB each, never read
request = struct.pack("=IHHII", 32, 18, 1, 0, 0) + struct.pack("=BBHiII", 0, 0, 0, 1, 0, 0)
held = []
for _ in range(28):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)  # (the kernel caps it)
    s.setblocking(False)
    for _ in range(20000):
        try:
            s.send(request)
        except OSError:  # (the queue is full: ENOBUFS)
            break
    held.append(s)
rcvbuf = held[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
print(f"queues of {28 * rcvbuf >> 20} MB", flush=True)
if 28 * rcvbuf >> 20 >= BOUND_MB:  # held until the bound ends it, however late it reads
    time.sleep(50)
print("kept them")
"""


def test_netlink_socket_queues_count_toward_the_memory_limit(sandbox_cgroup: bool) -> None:
    """Replies to routing requests that a netlink socket never reads stay queued, up to its
    receive buffer: kernel memory no watchdog reading counted, 28 sockets of one process held
    about 224 MB under ``memory_mb=64``. The fork server now adds ``/proc/net/netlink``'s
    queues (the sandbox's own network namespace)."""
    limits = Limits(cpu_s=30, memory_mb=64, processes=16, files=2000)
    sb = PythonSandbox(
        size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup
    )  # (the memory bound ends it first)
    try:
        code = FILL_NETLINK_QUEUES.replace("BOUND_MB", str(limits.memory_mb))
        result = asyncio.run(sb.run(code))
    finally:
        sb.close()
    if result.limit != "memory":
        assert result.stdout.endswith("kept them\\n"), result
        size = int(result.stdout.split()[2])
        assert size < limits.memory_mb, result
        # as above: the queues this kernel allows stay under the bound (asserted), no escape
        pytest.skip(f"this kernel's netlink queues hold only {size} MB (< {limits.memory_mb})")
    assert "kept them" not in result.stdout


@pytest.fixture(scope="module")
def sandbox(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    limits = Limits(cpu_s=5, memory_mb=256, processes=16)
    sb = PythonSandbox(size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup)
    yield sb
    sb.close()


def run(sb: PythonSandbox, code: str) -> ExecResult:
    return asyncio.run(sb.run(code))


INET = """
import socket
for family in (socket.AF_INET, socket.AF_INET6):
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        try:
            socket.socket(family, kind).close()
            print("opened")
        except OSError as e:
            print(e.errno)
a, b = socket.socketpair()  # (AF_UNIX: its queues are counted)
a.sendall(b"unix works")
print(b.recv(100).decode())
try:
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
except OSError as e:
    print("SO_SNDBUF", e.errno)
a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # (any other option still works)
"""


def test_executions_open_no_inet_socket(sandbox: PythonSandbox) -> None:
    """The pages behind a TCP or UDP queue are shared 32 KB page fragments charged by the byte,
    so no reading of the queues bounds them (3.3 GB held behind 200 KB counted). The sandbox
    has no network beyond its own loopback; inet and inet6 sockets now answer EAFNOSUPPORT.
    (A Unix socket's send buffer cannot be raised either: see the test of closed senders.)"""
    assert run(sandbox, INET).stdout == "97\n97\n97\n97\nunix works\nSO_SNDBUF 1\n"


PAGE_REFERENCES = """
import ctypes, os, shutil
libc = ctypes.CDLL(None, use_errno=True)

class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

page = ctypes.create_string_buffer(4096)
r, w = os.pipe()
iov = iovec(ctypes.addressof(page), 4096)
print("vmsplice", libc.vmsplice(w, ctypes.byref(iov), 1, 0), ctypes.get_errno())
open("/tmp/f", "w").write("answer")
fd = os.open("/tmp/f", os.O_RDONLY)
r2, w2 = os.pipe()
for name, call in [
    ("splice", lambda: os.splice(fd, w, 1, offset_src=0)),
    ("sendfile", lambda: os.sendfile(w, fd, 0, 1)),
    ("tee", lambda: os.write(w2, b"x") and libc.tee(r2, w, 1, 0) == -1 and ctypes.get_errno()),
]:
    try:
        print(name, call())
    except OSError as e:
        print(name, e.errno)
shutil.copyfile("/tmp/f", "/tmp/g")  # (falls back from sendfile to reading and writing)
print(open("/tmp/g").read())
"""


def test_executions_hand_no_page_to_a_pipe_or_socket(sandbox: PythonSandbox) -> None:
    """A page handed by reference (``vmsplice`` of the process's memory, ``splice``, ``tee`` or
    ``sendfile`` of a file's) stays while the pipe or socket holds it, whatever the process
    unmaps or deletes: 4 KB slots kept 2 MB huge pages, 974 MB in one process's pipes under
    ``memory_mb=64``. Each is now EPERM; ``shutil.copyfile`` still copies."""
    out = run(sandbox, PAGE_REFERENCES).stdout
    assert out == "vmsplice -1 1\nsplice 1\nsendfile 1\ntee 1\nanswer\n", out


THP = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("disabled", libc.prctl(42, 0, 0, 0, 0))  # PR_GET_THP_DISABLE
print("enable", libc.prctl(41, 0, 0, 0, 0), ctypes.get_errno())  # PR_SET_THP_DISABLE, 0
print("disabled", libc.prctl(42, 0, 0, 0, 0))
"""


def test_executions_get_no_transparent_huge_pages(sandbox: PythonSandbox) -> None:
    """A 2 MB huge page stays whole while any 4 KB of it is mapped, and a resident set counts
    only what is mapped: 400 of them, each 4 KB kept, held 826 MB behind 13 MB counted. Every
    execution now starts with huge pages disabled and cannot turn them back on (EPERM); the
    machine's own setting (``madvise`` here) does not change what this checks."""
    assert run(sandbox, THP).stdout == "disabled 1\nenable -1 1\ndisabled 1\n"


TIMERS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
timer = ctypes.c_void_p()
def make(n):
    made = 0
    while made < n and libc.timer_create(1, None, ctypes.byref(timer)) == 0:  # CLOCK_MONOTONIC
        made += 1
    return made
held_r, held_w = os.pipe()
done_r, done_w = os.pipe()
if os.fork() == 0:
    os.write(held_w, b"%d" % make(200))
    os.read(done_r, 1)  # holds its timers until the parent has made its own
    os._exit(0)
print(int(os.read(held_r, 10)), make(2000))
os.write(done_w, b"x")
os.wait()
print(make(2000))  # the child's went with it
"""


def test_posix_timers_are_bounded_per_execution(sandbox: PythonSandbox) -> None:
    """Each POSIX timer is kernel memory in no resident set, bounded only by the host's
    RLIMIT_SIGPENDING: one process made 96,365 of them, about 55 MB. Executions now get 256
    timers and queued signals in all, shared by their processes."""
    assert run(sandbox, TIMERS).stdout == "200 56\n200\n"


CLOSED_SENDERS = """
import socket, time
held, queued = [], 0
for _ in range(56):  # (64 file descriptors a process: the senders close)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_KIND)
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 24)  # (before: up to 8 MB)
    except OSError:
        pass
    a.setblocking(False)
    while True:
        try:
            queued += a.send(b"x" * 16384)
        except OSError:  # (full)
            break
    a.close()  # its data stays in b's queue
    held.append(b)
time.sleep(50)  # held until the bound ends it, however late a busy host lets it read
print("kept them")
"""


NOT_ACCEPTED = """
import socket, time
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\\0server")
server.listen(128)
for _ in range(60):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect("\\0server")
    client.setblocking(False)
    while True:
        try:
            client.send(b"x" * 16384)
        except OSError:  # (full)
            break
    client.close()  # its data stays in the connection the server never accepts
print("connected", flush=True)
time.sleep(50)  # held until the bound ends it, however late a busy host lets it read
print("kept them")
"""


@pytest.mark.parametrize(
    "code",
    [
        CLOSED_SENDERS.replace("SOCK_KIND", "SOCK_STREAM"),
        CLOSED_SENDERS.replace("SOCK_KIND", "SOCK_DGRAM"),
        NOT_ACCEPTED,
    ],
    ids=["stream", "datagram", "not-accepted"],
)
def test_data_a_closed_sender_left_counts_toward_the_memory_limit(
    code: str, sandbox_cgroup: bool
) -> None:
    """Unix data is charged to its sender, and the watchdog read each sender's write queue;
    once a sender closes, its data stays with the receiver, charged to a socket no dump lists:
    56 pairs whose sending ends one process closed held 439 MB (stream) and 395 MB (datagram)
    under ``memory_mb=64``, and so did connections a listening socket never accepted (500 held
    111 MB). Executions now cannot raise a send buffer (EPERM), and a socket with data to read
    and no live peer, or a connection not accepted, is charged the most its dead sender can
    have left it: two default send buffers, ~0.4 MB (here 56 or 60 of them, past a bound of
    22 MB that the process's ~12 MB resident set alone stays under)."""
    limits = Limits(cpu_s=5, memory_mb=22, processes=16)
    sb = PythonSandbox(size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup)
    try:
        result = run(sb, code)
    finally:
        sb.close()
    assert result.limit == "memory" and "kept them" not in result.stdout, result


UNNAMED_FILES = """
import os
fds = []
for _ in range(40):  # 160 MB in files no directory shows, each under file_size_mb
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR)
    os.pwrite(fd, b"x" * (4 << 20), 0)
    fds.append(fd)
print("kept them")
"""

SHM_FREE = "import os\ns = os.statvfs('/dev/shm')\nprint(s.f_bfree == s.f_blocks)"


def test_unnamed_tmpfs_files_are_killed_and_leave_nothing(pool: PythonSandbox) -> None:
    """Unnamed files (``O_TMPFILE``, allowed since every mount is renewed after every
    execution) are tmpfs pages like named ones: killed at ``memory_mb`` under both bounds,
    and the next execution finds the mount empty."""
    result = attack(pool, UNNAMED_FILES)
    assert result.limit == "memory" and "kept them" not in result.stdout, result.as_text()
    assert asyncio.run(pool.run(SHM_FREE)).stdout == "True\n"
