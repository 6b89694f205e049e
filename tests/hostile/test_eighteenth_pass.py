"""The eighteenth adversarial pass: memory an execution held that the python sandbox's
watchdog could not see, the kernel's own accounting missing it too.

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
left with a dead sender's data the most that sender can have left."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from jax_agent_rl.tools.sandbox import ExecResult, Limits, PythonSandbox


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
time.sleep(1)  # held: the watchdog reads the queues at least every 0.1 s
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
time.sleep(1)
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
