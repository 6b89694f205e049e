"""Channels between executions, and from an execution to other sandboxes or the host.

Under GRPO a rollout that signals to a sibling's execution (or reads what a sibling left)
shapes that sibling's reward, so a bit carried is a reward hack. Each test below is a channel
that was open before: the pid and inode counters an execution moved were read by the next one
on its worker; byte-range locks on the files every sandbox shares (``/usr``) were visible to
every other sandbox and to the host; and ``AF_VSOCK`` reached a virtual machine's host.
"""

from __future__ import annotations

import ast
import asyncio
import os
from collections.abc import Iterator

import pytest

from jax_agent_rl.tools.sandbox import ExecResult, Limits, PythonSandbox
from jax_agent_rl.tools.sandbox_reset import WRITABLE
from tests.hostile.test_sandbox_escapes import attack_beside_normal

LIMITS = Limits(cpu_s=5, memory_mb=64, processes=16, files=2000)


@pytest.fixture(scope="module")
def sandbox(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    """One worker: each call runs where the previous one ran (under each memory bound)."""
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=60.0, cgroup=sandbox_cgroup)
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def pool(sandbox_cgroup: bool) -> Iterator[PythonSandbox]:
    """Two workers, for `attack_beside_normal`: each attack runs beside a normal execution."""
    sb = PythonSandbox(size=2, limits=LIMITS, timeout_s=10.0, cgroup=sandbox_cgroup)
    yield sb
    sb.close()


def run(sb: PythonSandbox, code: str) -> ExecResult:
    return asyncio.run(sb.run(code))


# --- counters one execution moves and the next reads ---------------------------------------

PROBE_COUNTERS = """
import os
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
inodes = []
for root in ("/work", "/tmp", "/dev/shm"):
    open(f"{root}/probe", "w").close()
    inodes.append(os.stat(f"{root}/probe").st_ino)
print(os.getpid(), child, inodes)
"""

MOVE_COUNTERS = """
import os
for _ in range(40):  # 40 pids
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
for root in ("/work", "/tmp", "/dev/shm"):  # FILES inodes a mount
    for i in range(FILES):
        path = f"{root}/f{i}"
        open(path, "w").close()
        os.unlink(path)
for root in ("/work", "/tmp", "/dev/shm"):  # inodes no directory shows
    os.close(os.open(root, os.O_TMPFILE | os.O_WRONLY))
print("moved")
"""


@pytest.mark.parametrize("files", [300, 6000], ids=["300-files", "6000-files"])
def test_pid_and_inode_counters_carry_nothing(sandbox: PythonSandbox, files: int) -> None:
    """The pid of an execution's process and the inode numbers of the files it makes were the
    previous executions' counts: 40 forks or 300 files were a number the next one read. The
    fork server replaces every mount after every execution (unnamed files go with theirs)."""
    first = run(sandbox, PROBE_COUNTERS)
    assert first.exit_code == 0, first.as_text()
    moved = run(sandbox, MOVE_COUNTERS.replace("FILES", str(files)))
    assert moved.stdout == "moved\n", moved.as_text()
    assert run(sandbox, PROBE_COUNTERS).stdout == first.stdout
    assert first.stdout.startswith("2 3 ")  # the process after the fork server, then its child
    assert sandbox.restarts == 0  # renewed in place, not replaced


UNTOUCHED_ROOTS = """
import os
print([(os.stat(r).st_mtime_ns, os.stat(r).st_atime_ns) for r in ("/work", "/tmp", "/dev/shm")])
"""

READ_ROOTS = """
import os
print([os.listdir(r) for r in ("/work", "/tmp", "/dev/shm")])
"""


def test_reading_a_root_leaves_no_trace(sandbox: PythonSandbox) -> None:
    """Listing a root sets its access time, which the next execution would read: reading is an
    event too, and the root is replaced."""
    before = run(sandbox, UNTOUCHED_ROOTS).stdout
    assert run(sandbox, READ_ROOTS).stdout == "[[], [], []]\n"
    assert run(sandbox, UNTOUCHED_ROOTS).stdout == before


NO_INOTIFY = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("inotify_init1", libc.inotify_init1(0), ctypes.get_errno())
"""


def test_executions_get_no_inotify(sandbox: PythonSandbox) -> None:
    """inotify would show one sandbox's reads of the shared /usr files to another."""
    assert run(sandbox, NO_INOTIFY).stdout == "inotify_init1 -1 1\n"


KEYRING = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_USER_KEYRING = -4
key = libc.syscall(248, b"user", b"note", b"0xBEEF", 6, KEY_SPEC_USER_KEYRING)  # add_key
print("add_key", key, ctypes.get_errno())
found = libc.syscall(249, b"user", b"note", None, 0)  # request_key
print("request_key", found, ctypes.get_errno())
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_the_kernel_keyring_carries_nothing_between_executions(sandbox: PythonSandbox) -> None:
    """The user keyring outlives every process of its uid: a key one execution added would be
    there for the next to request (a channel no pass had named). add_key and request_key are
    refused (EPERM), in the first execution and the next."""
    for _ in range(2):
        assert run(sandbox, KEYRING).stdout == "add_key -1 1\nrequest_key -1 1\n"


# --- the fork server's own state, which every execution on its worker meets ----------------

SET_FORK_SERVER_LIMITS = """
import resource
for limit, value in ((resource.RLIMIT_MSGQUEUE, 424242), (resource.RLIMIT_NPROC, 8)):
    try:
        resource.prlimit(1, limit, (value, resource.getrlimit(limit)[1]))
        print("set")
    except PermissionError:
        print("refused")
queue = resource.RLIMIT_MSGQUEUE
resource.setrlimit(queue, (4096, resource.getrlimit(queue)[1]))
print("own", resource.prlimit(0, queue)[0])
"""

READ_LIMITS = """
import resource
print(resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0], resource.getrlimit(resource.RLIMIT_NPROC))
"""


def test_an_execution_cannot_set_the_fork_server_s_limits(sandbox: PythonSandbox) -> None:
    """``prlimit(1, ...)`` set the fork server's limits (same user), which every later execution
    inherited: a message-queue size read back as a channel, and an NPROC of 8 made every later
    execution on the worker exit 1 with the fork server's own traceback. Its own limits an
    execution still sets (pid 0, as ``setrlimit``)."""
    before = run(sandbox, READ_LIMITS).stdout
    done = run(sandbox, SET_FORK_SERVER_LIMITS)
    assert done.stdout == "refused\nrefused\nown 4096\n", done.as_text()
    assert run(sandbox, READ_LIMITS).stdout == before


WRITE_ROOTS = """
import sys
for root, bit in zip(("/work", "/tmp", "/dev/shm"), sys.argv[1]):
    if bit == "1":
        open(f"{root}/x", "w").close()
"""

READ_MOUNTS = """
print([line.split()[:5] for line in open("/proc/self/mountinfo") if " /proc" not in line])
"""


def mount_table(out: str) -> list[tuple[str, str, str]]:
    """What an execution reads of its mount table, less the numbers the machine hands out:
    each mount's point, its parent's point and its root, in the table's order. Mount ids and
    anonymous device numbers come from allocators of the whole kernel (the lowest free one,
    freed after an RCU grace period), which every mount on the machine moves: another test
    beside this one changed them (docs/sandbox.md, counters of the shared kernel)."""
    lines = ast.literal_eval(out)
    point = {line[0]: line[4] for line in lines}
    return [(line[4], point.get(line[1], "outside"), line[3]) for line in lines]


def test_which_roots_an_execution_wrote_is_not_in_the_next_one_s_mount_table(
    sandbox: PythonSandbox,
) -> None:
    """Only the roots an execution touched were mounted anew, which moved their lines to the
    end of /proc/self/mountinfo with new mount ids: the next execution read which ones (16 of 16
    bits back). Every root is renewed, in one order, after every execution."""
    seen = []
    for bits in ("000", "100", "010", "001", "111"):
        wrote = run(sandbox, WRITE_ROOTS.replace("sys.argv[1]", repr(bits)))
        assert wrote.exit_code == 0, wrote.as_text()
        seen.append(mount_table(run(sandbox, READ_MOUNTS).stdout))
    assert all(table == seen[0] for table in seen), seen
    assert [point for point, *_ in seen[0] if point in WRITABLE] == list(WRITABLE)


LEAVE_DIRTY = """
import array, socket
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
fds = array.array("i", [a.fileno(), b.fileno()])
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
a.close(); b.close()  # a socket left in flight: the fork server cannot prove the sandbox clean
"""


def test_a_fresh_sandbox_and_a_used_one_look_the_same(sandbox_cgroup: bool) -> None:
    """The first execution of a sandbox ran on bubblewrap's own mounts, whose ids and order
    differed from the renewed ones every later execution sees, and an execution decides when
    its worker is fresh by leaving it dirty: a bit to the next one (16 of 16). The fork server
    renews the mounts once before its first execution."""
    sb = PythonSandbox(size=1, limits=LIMITS, timeout_s=60.0, cgroup=sandbox_cgroup)
    try:
        first, used = run(sb, READ_MOUNTS).stdout, run(sb, READ_MOUNTS).stdout
        run(sb, LEAVE_DIRTY)
        fresh = run(sb, READ_MOUNTS).stdout
        assert sb.restarts == 1
    finally:
        sb.close()
    seen = [mount_table(out) for out in (first, used, fresh)]
    assert seen[0] == seen[1] == seen[2], seen


READ_FORK_SERVER = """
import os
print(sorted(os.listdir("/proc/1")))
for name in ("stat", "status", "sched", "schedstat", "task/1/stat"):
    try:
        open(f"/proc/1/{name}").read()
        print("read", name)
    except OSError as e:
        print(e.strerror)
print(os.getpid(), os.path.exists("/proc/self/stat"), len(open("/proc/net/unix").read()) > 0)
"""


def test_the_fork_server_s_counters_are_hidden(sandbox: PythonSandbox) -> None:
    """The fork server reaps every execution, so its children's CPU time (/proc/1/stat) moved
    by what each execution spent: a sender spun to a chosen count of ticks, the next execution
    read two bits back (12 of 12). /proc/1 is an empty read-only folder to executions; their
    own /proc entries and /proc/net read as before."""
    done = run(sandbox, READ_FORK_SERVER)
    missing = "No such file or directory"
    assert done.stdout == "[]\n" + f"{missing}\n" * 5 + "2 True True\n", done.as_text()


PAGE_CACHE = """
import ctypes, mmap, os
fd = os.open("/usr/lib/os-release", os.O_RDONLY)
tries = {
    "fadvise": lambda: os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED),
    "readahead": lambda: ctypes.CDLL(None, use_errno=True).readahead(fd, 0, 4096),
    "nowait read": lambda: os.preadv(fd, [bytearray(16)], 0, os.RWF_NOWAIT),
    "plain preadv2": lambda: os.preadv(fd, [bytearray(16)], 0, os.RWF_HIPRI),
}
for name, call in tries.items():
    try:
        got = call()
        print(name, "ran" if got in (None, 0, 16) else got, ctypes.get_errno() if got == -1 else "")
    except OSError as e:
        print(name, e.strerror)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
for advice in (20, 21):  # MADV_COLD, MADV_PAGEOUT
    try:
        m.madvise(advice)
        print("madvise", advice, "ran")
    except OSError as e:
        print("madvise", advice, e.strerror)
"""


def test_executions_neither_probe_nor_evict_the_shared_page_cache(sandbox: PythonSandbox) -> None:
    """/usr is the host's, read-only, so its page cache is shared with every sandbox and the
    host: a sender evicted pages (fadvise DONTNEED) or read them, a receiver asked whether each
    was cached (a read with RWF_NOWAIT fails when it is not): 11 bits from one execution to the
    next, exact, and to a host process. The calls that probe or evict are refused."""
    done = run(sandbox, PAGE_CACHE)
    assert done.stdout.splitlines() == [
        "fadvise Operation not permitted",
        "readahead -1 1",  # (EPERM, through ctypes)
        "nowait read Operation not supported",
        "plain preadv2 ran ",
        "madvise 20 Operation not permitted",
        "madvise 21 Operation not permitted",
    ], done.as_text()


# --- locks on the files every sandbox shares ------------------------------------------------

LOCK_SHARED_FILE = """
import fcntl, os, struct
path = "/usr/lib/os-release"  # on the read-only /usr every sandbox and the host share
f = open(path, "rb")
fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # POSIX byte-range lock (F_SETLK)
fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
F_OFD_SETLK = 37
fcntl.fcntl(f, F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 0, 0))
# /proc/locks lists the locks of the whole machine: what is listed, any sandbox and the host see
st = os.stat(path)
dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
print("locks listed:", sum(line.split()[5] == dev for line in open("/proc/locks")))
found = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
print("a write lock would conflict:", struct.unpack("hhqqi", found)[0] != fcntl.F_UNLCK)
"""


def test_locks_on_shared_files_are_never_taken(pool: PythonSandbox) -> None:
    """A read lock on a ``/usr`` file was listed machine-wide, so another sandbox (testing for
    a conflicting lock) or the host read it: a bit per file, across workers. Lock calls now
    succeed without taking a lock."""
    out = attack_beside_normal(pool, LOCK_SHARED_FILE)
    assert out == "locks listed: 0\na write lock would conflict: False"


SQLITE = """
import sqlite3
for mode in ("delete", "wal"):
    a = sqlite3.connect(f"/tmp/{mode}.db")
    assert a.execute(f"pragma journal_mode={mode}").fetchone()[0] == mode
    a.execute("create table t(x)")
    a.executemany("insert into t values (?)", [(i,) for i in range(100)])
    a.commit()
    b = sqlite3.connect(f"/tmp/{mode}.db")  # a second connection reads what the first wrote
    b.execute("insert into t values (1000)")
    b.commit()
    print(mode, a.execute("select count(*), sum(x) from t").fetchone())
"""


def test_sqlite_works_without_locks(sandbox: PythonSandbox) -> None:
    """What model-written code does with locks (SQLite, rollback journal and WAL) still works:
    within one execution the locks were never needed to keep its own connections apart."""
    assert run(sandbox, SQLITE).stdout == "delete (101, 5950)\nwal (101, 5950)\n"


# --- socket families ----------------------------------------------------------------------

SOCKETS = """
import socket
def opens(*args):
    try:
        socket.socket(*args).close()
        return "ok"
    except OSError as e:
        return e.errno
print("vsock", opens(socket.AF_VSOCK, socket.SOCK_STREAM))
print("packet", opens(socket.AF_PACKET, socket.SOCK_RAW))
print("alg", opens(socket.AF_ALG, socket.SOCK_SEQPACKET))
print("netlink sock_diag", opens(socket.AF_NETLINK, socket.SOCK_RAW, 4))
print("netlink route", opens(socket.AF_NETLINK, socket.SOCK_RAW, 0))
print("unix", opens(socket.AF_UNIX, socket.SOCK_STREAM), len(socket.socketpair()))
print("inet", opens(socket.AF_INET, socket.SOCK_STREAM), opens(socket.AF_INET6, socket.SOCK_DGRAM))
# AI_ADDRCONFIG: libc asks netlink which address families are configured
found = socket.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG)
print(found[0][4])
"""


def test_only_the_socket_families_code_needs(pool: PythonSandbox) -> None:
    """``AF_VSOCK`` reaches the host of a virtual machine (a CI runner's, a cloud TPU VM's):
    outside every namespace. Only unix and netlink's routing queries (what ``getaddrinfo``
    asks) open; the rest answer EAFNOSUPPORT (97), inet and inet6 included
    (`tests.hostile.test_sandbox_memory`: what a loopback queue holds is not countable)."""
    assert attack_beside_normal(pool, SOCKETS) == (
        "vsock 97\npacket 97\nalg 97\nnetlink sock_diag 97\nnetlink route ok\nunix ok 2\n"
        "inet 97 97\n('127.0.0.1', 80)"
    )


SYSV_IPC = """
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for key in (0xBEEF, 0):  # a guessed key, and IPC_PRIVATE
    shm = libc.shmget(key, 4096, 0o1666)
    if shm >= 0:
        p = libc.shmat(shm, None, 0)
        ok = p not in (None, ctypes.c_void_p(-1).value)
        print("shm", shm, ctypes.string_at(p, 6) if ok else None)
        if ok:
            ctypes.memmove(p, b"SECRET", 6)
    print("msg", libc.msgget(key, 0o1666) >= 0, "sem", libc.semget(key, 1, 0o1666) >= 0)
"""


def test_system_v_shared_memory_queues_and_semaphores_carry_nothing(sandbox: PythonSandbox) -> None:
    """System V IPC objects outlive the process that made them: an execution that leaves a
    segment, a queue or a semaphore under a guessed key would hand the next execution on its
    worker a message. Every get is refused, so nothing is made and nothing is read back."""
    for _ in range(2):  # the second run is where a left segment would show
        result = run(sandbox, SYSV_IPC)
        assert result.stdout == "msg False sem False\n" * 2, (result.stdout, result.stderr)
