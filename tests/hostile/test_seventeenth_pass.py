"""The seventeenth adversarial pass.

- ``llama3_json`` calls whose strings hold an escaped quote (``\\"``): the ``;`` splitter
  took the quote after a backslash as the string's end, so the brackets and separators after
  it counted outside the string. A valid call holding ``s = '"}}'; t = 1`` was split into two
  malformed calls, and two valid calls, the first holding ``"{``, were read as one malformed
  call: the model's well-formed calls were answered as its errors (and counted malformed).
- ``jarl eval`` over held-out rows whose data_source is ``all``, the name of its report's line
  of every source together: their prompts counted twice in that line, their own line lost.
- The python sandbox's CPU bound: children of a process ignoring SIGCHLD are reaped by the
  kernel, their CPU time counted nowhere, so an execution forking children in turn used CPU
  past ``cpu_s`` until its wall-clock timeout (up to ``processes`` cores for all of it).
- The python sandbox's memory bound: data queued in Unix socket pairs (kernel memory in no
  process's resident set) was not counted: 219 MB held under ``memory_mb=64``; nor were shared
  anonymous pages (``mmap(-1, n)``, ``/dev/zero``) filled by children that then exited: 576 MB
  held by 4 processes under ``memory_mb=256``; nor were netlink sockets' unread replies:
  about 224 MB under ``memory_mb=64``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox
from jax_agent_rl.train.evaluation import EvalInputError, eval_target


@pytest.mark.parametrize(
    "values",
    [
        [{"code": "s = '\"}}'; t = 1"}],  # a quote, then closing brackets, then a ';'
        [{"x": '"{'}, {}],  # an opening bracket after an escaped quote hid the ';'
        [{"x": '\\"'}, {"y": "a;b"}],  # an escaped backslash before a real closing quote
        [{"x": '\\\\\\"]'}, {"y": '"];{'}],
    ],
)
def test_llama3_calls_holding_escaped_quotes_are_read_as_written(
    values: list[dict[str, str]],
) -> None:
    calls = [{"name": f"f{i}", "parameters": v} for i, v in enumerate(values)]
    text = "<|python_tag|>" + "; ".join(json.dumps(c) for c in calls)
    parsed = make_parser("llama3_json").parse(text)
    assert parsed == [ParsedCall(c["name"], c["parameters"]) for c in calls]


def test_a_held_out_source_named_all_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    """``jarl eval``'s report has one line per data source and one, ``all``, of every source
    together: the rows of a source named ``all`` were counted in that line twice (once as
    their source's, once as every source's), and their own line was lost. Two prompts of
    ``all`` failing and two of ``b`` succeeding reported 6 prompts and pass@1 = 1/3 over all,
    not 4 and 1/2. Now such a source is refused, naming the row, before anything loads."""
    val = tmp_path / "val.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2", "data_source": s}
        for s in ("b", "all")
    ]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}\ndata:\n  train: {val}\n  val: {val}\n")
    with pytest.raises(EvalInputError, match=r"data\.val row 'all-1' has data_source 'all'"):
        eval_target(str(config))


# children forked one after another, each spinning 0.3 s of CPU and exiting: 2.4 s in all,
# past the execution's cpu_s of 1 (each alone far under it)
AUTOREAPED = """
import os, resource, signal
try:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited children: reaped by the kernel
except OSError as e:
    print("SIGCHLD:", e.strerror, flush=True)
for _ in range(8):
    if os.fork() == 0:
        while resource.getrusage(resource.RUSAGE_SELF).ru_utime < 0.3:
            pass
        os._exit(0)
    try:
        os.waitpid(-1, 0)  # (with SIGCHLD ignored: ECHILD once the child has gone)
    except ChildProcessError:
        pass
print("spun 2.4 CPU seconds")
"""


READS = "import signal; print(signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL)"


def test_children_reaped_by_the_kernel_count_toward_the_executions_cpu_time() -> None:
    """A process whose parent ignores SIGCHLD is reaped by the kernel as it exits, and its
    CPU time was then no one's: the fork server's accounting of the execution never saw it,
    and children spinning in turn ran past ``cpu_s`` for as long as the wall clock allowed.
    Now setting SIGCHLD's action is denied to executions (reading it is not), so every child's
    time is counted: as its own while it lives or is a zombie, then as its parent's."""
    limits = Limits(cpu_s=1, memory_mb=256, processes=16, files=2000)
    sb = PythonSandbox(size=1, limits=limits, timeout_s=60.0)  # (the CPU bound ends it first)
    try:
        result = asyncio.run(sb.run(AUTOREAPED))
        reads = asyncio.run(sb.run(READS))
    finally:
        sb.close()
    assert "SIGCHLD: Operation not permitted" in result.stdout
    assert result.limit == "CPU time" and "spun" not in result.stdout
    assert reads.stdout == "True\n"


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
time.sleep(1)  # held: the watchdog reads the queues at least every 0.1 s
print("kept them")
"""


def test_unix_socket_queues_count_toward_the_memory_limit(sandbox_cgroup: bool) -> None:
    """Data queued in Unix socket pairs is kernel memory in no process's resident set, and the
    watchdog counted only TCP and UDP queues: 28 pairs of one process held 219 MB under
    ``memory_mb=64``. The fork server now reads every Unix socket's queue (the kernel's socket
    diagnostics, a netlink socket executions cannot open). Since the eighteenth pass no send
    buffer can be raised, so 30 pairs filled both ways queue ~12 MB: the bound is set where
    they and the process's resident set (~12 MB) cross it."""
    limits = Limits(cpu_s=5, memory_mb=22, processes=16, files=2000)
    sb = PythonSandbox(
        size=1, limits=limits, timeout_s=60.0, cgroup=sandbox_cgroup
    )  # (the memory bound ends it first)
    try:
        result = asyncio.run(sb.run(FILL_UNIX_QUEUES))
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
time.sleep(1)  # held: the watchdog reads the queues at least every 0.1 s
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
        result = asyncio.run(sb.run(FILL_NETLINK_QUEUES))
    finally:
        sb.close()
    if result.limit != "memory":
        assert result.stdout.endswith("kept them\\n"), result
        size = int(result.stdout.split()[2])
        assert size < limits.memory_mb, result
        # as above: the queues this kernel allows stay under the bound (asserted), no escape
        pytest.skip(f"this kernel's netlink queues hold only {size} MB (< {limits.memory_mb})")
    assert "kept them" not in result.stdout
