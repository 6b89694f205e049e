"""The fork server that runs inside each sandbox, as the sandbox's pid 1 (bubblewrap
``--as-pid-1``), under an unprivileged uid and the seccomp filter.

It serves one execution at a time: it reads a request frame, forks a child that applies the
resource limits and runs the code in ``/work``, collects its output (bounded) while a watchdog
accounts the whole execution, then kills every other process in the sandbox and replaces the
writable places (``/work``, ``/tmp``, ``/dev/shm``) with fresh tmpfs mounts and resets the pid
counter, so no state survives from one execution to the next: no entry, no attribute of the
roots (``user.*``, POSIX ACLs, mode, times), no inode or pid number it moved. The zygote
itself never runs nor compiles user code (compiling can take memory quadratic in the code's
size: the child does it, under its limits), so every child starts from the same state.

Why the executions cannot reach it: it is not dumpable (``PR_SET_DUMPABLE=0``: no
``/proc/1/mem`` and no ptrace for processes of the same uid, and the filter denies ptrace
anyway), and as the init of its pid namespace it ignores every signal sent from inside for
which it has no handler, SIGKILL and SIGSTOP included: it sets none (Python's own SIGINT
handler, KeyboardInterrupt, let ``os.kill(1, SIGINT)`` end it; each execution gets it back).
What the watchdog bounds, over every process of the execution (rlimits alone are per process):
memory (``memory_mb``: the execution's memory group, `GROUP`, where the host gave the worker
one, plus socket queues; otherwise resident memory, the bytes on the sandbox's tmpfs mounts and
socket queues), CPU seconds (``cpu_s``) and files on the tmpfs mounts (``files``). An execution
over a bound is killed and its result names the bound.

If the fork server cannot prove the sandbox clean (a process survived, a mount could not be
replaced), the reply says ``dirty`` and the zygote exits: the host starts a fresh sandbox.

Frames are a 4-byte big-endian length and a JSON object, on the two pipe file descriptors
given as arguments (requests in, replies out), which the zygote moves to fds 3 and 4; the child
closes every fd above 2, so it never sees them. After the ready frame the zygote's own stderr is
``/dev/null``: nobody reads it, and a full pipe would stop the zygote. Only the standard
library is used: this file runs under the system Python with ``-I -S``, after
`sandbox_reset` (the clean-up between executions) in the same script (`tools.sandbox`).
"""

import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

from jax_agent_rl.tools.sandbox_reset import (
    SIZES,
    WRITABLE,
    confine_executions,
    drop_capabilities,
    hide_fork_server,
    hold_counters,
    metadata,
    read_net,
    renew,
    sweep,
)

REQ_FD, REP_FD, GROUP_FD = 3, 4, 5  # where `_take_pipes` puts what the host hands over
# Standard-library modules that model-written code imports most, imported once here so that
# every execution forks with them ready: a fresh interpreter pays e.g. ~5 ms for ``fractions``
# (it imports ``decimal``, ``numbers``, ``re``) per call. They are pure computation (no files,
# sockets or threads); each child gets its own copy-on-write copy, so what code changes in one
# is gone in the next, and ``random`` reseeds itself in each forked child (`os.register_at_fork`).
PRELOAD = (
    "bisect", "cmath", "collections", "datetime", "decimal", "fractions", "functools",
    "heapq", "itertools", "math", "operator", "random", "re", "statistics", "string",
)  # fmt: skip
# Compiled once by the fork server, never run: the compiler's lazily built state (the AST
# types, the parser's tables) then exists before the fork, so each child does not build it
# again (~1 ms and ~130 page faults an execution).
WARM_COMPILER = """
import math
def f(x, *a, k=1, **kw):
    return [i * 2 for i in range(x) if i % 2], {i: j for i, j in kw.items()}, lambda y: y + 1
class C:
    z: int = 0
    async def g(self):
        async with self as s:
            await s
match f:
    case [a, b, *rest] if a: pass
    case {"k": v}: pass
    case C(z=1) | None: pass
try:
    print(f"{math.pi:.3f} {1!r}", 1 if 2 else 3, (y := 2), *a, **kw)
except (ValueError, TypeError) as e:
    raise RuntimeError from e
finally:
    del y
"""
PR_SET_DUMPABLE, PR_SET_THP_DISABLE = 4, 41
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
WATCH_EVERY_S = 0.01
SOCKETS_EVERY_S = 0.1
# the last reading of the Unix and netlink sockets' queues (`_unix_queued`, `_netlink_queued`)
QUEUED = {"at": 0.0, "bytes": 0}
UNIX_DIAG: list[socket.socket] = []  # the fork server's NETLINK_SOCK_DIAG socket, made once
# sock_diag's request of every Unix socket's queues: nlmsghdr (SOCK_DIAG_BY_FAMILY,
# NLM_F_REQUEST | NLM_F_DUMP), then unix_diag_req (AF_UNIX, every state,
# UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN)
UNIX_DUMP = struct.pack("=IHHII", 40, 20, 0x301, 0, 0) + struct.pack(
    "=BBHIIIII", 1, 0, 0, 0xFFFFFFFF, 0, 0x14, 0, 0
)
# What a Unix socket with data to read and no live peer is charged (`_unix_queued`), by type
# (SOCK_STREAM 1, SOCK_DGRAM 2, SOCK_SEQPACKET 5); set by `main` from the kernel's sysctls
ORPHANED: dict[int, int] = {}


def _read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(REQ_FD, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _send(obj):
    data = json.dumps(obj).encode()
    os.write(REP_FD, struct.pack(">I", len(data)) + data)


def _take_pipes(req, rep, group):
    """Moves the host's pipes (``req``, ``rep``: any numbers, 1024 and above when the host
    holds many files) to REQ_FD and REP_FD, and the worker's memory group (``group``, -1
    for none) to GROUP_FD, and closes every other fd above 2."""
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 6) if fd >= 0 else -1 for fd in (req, rep, group)]
    for fd, to in zip(fds, (REQ_FD, REP_FD, GROUP_FD), strict=True):
        if fd >= 0:
            os.dup2(fd, to)
    last = GROUP_FD if group >= 0 else REP_FD
    os.closerange(last + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def _child(code, limits, out_w, err_w, procs):
    if procs >= 0:  # into the execution's memory group, before anything of it runs
        try:
            os.write(procs, b"0")
        except OSError:
            os._exit(125)
    drop_capabilities()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as python -c has it
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    # every fd above 2, up to the hard limit (one close_range call): the reply pipe included
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    # POSIX timers and queued signals: kernel memory in no resident set, each one counted here
    # (the host's limit let one process make 96,365 timers, about 55 MB)
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the execution, anywhere
    os.chdir("/work")
    status = 1
    try:
        status = _execute(code)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _execute(code):
    """Compiles and runs ``code``; returns its exit status. Compiling happens here, under the
    child's limits, and its warnings (``SyntaxWarning``) go to the execution's stderr.

    ``code`` runs as ``python -c`` runs it: in a fresh module that is ``sys.modules["__main__"]``.
    Run in a bare dict named ``__main__`` while that entry was this fork server's own module,
    whatever looked the code's names up by module failed on them: ``pickle`` of its classes and
    functions (so ``multiprocessing.Pool.map`` of its function), ``typing.get_type_hints`` of
    its forward references, ``import __main__``."""
    try:
        compiled = compile(code, "<sandbox>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return 1
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    try:
        exec(compiled, module.__dict__)
    except SystemExit as e:
        # the status's low 8 bits, as the kernel keeps them (``sys.exit(2**64)`` ended in this
        # file's own traceback: os._exit overflowed)
        if e.code is None or isinstance(e.code, int):
            return 0 if e.code is None else e.code & 0xFF
        print(e.code, file=sys.stderr)  # as python prints ``sys.exit("message")``
        return 1
    except BaseException:  # the traceback is the model's observation
        traceback.print_exc()
        return 1
    return 0


def usage():
    """(resident bytes + tmpfs bytes + socket queues, CPU seconds, tmpfs files) of every
    process but pid 1; with a memory group (`GROUP`), which counts resident and tmpfs
    memory, the first is the socket queues alone.

    CPU counts each live or zombie process's own and reaped children's time, so work done by
    a process that already exited is still counted through its parent.
    """
    rss = ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:  # it exited meanwhile
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()  # fields from the 3rd ("state") on
        ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        rss += int(fields[21]) * PAGE
    used = files = 0
    for root in WRITABLE:
        st = os.statvfs(root)
        used += (st.f_blocks - st.f_bfree) * st.f_frsize
        files += st.f_files - st.f_ffree
    if GROUP["version"]:  # the group counts the rest (`over_limit`)
        return _socket_bytes(), ticks / TICK, files
    return rss + used + _socket_bytes(), ticks / TICK, files


def _socket_bytes():
    """Bytes queued in the sandbox's sockets, Unix and netlink (the only families executions
    can open: `seccomp`), read at most every SOCKETS_EVERY_S: kernel memory in no process's
    resident set."""
    if time.monotonic() - QUEUED["at"] >= SOCKETS_EVERY_S:
        QUEUED.update(at=time.monotonic(), bytes=_unix_queued() + _netlink_queued())
    return QUEUED["bytes"]


def _unix_queued():
    """Memory in the sandbox's Unix socket queues. Sent data is charged to its sender, whose
    write queue the kernel's socket diagnostics give: 28 socket pairs of one process held
    219 MB under a 64 MB limit. Once a sender closes, its data stays in the receiver's queue,
    charged to a socket no dump lists, and the receiver's figures give its bytes (a one-byte
    send takes ~1 KB) or its first datagram: 56 pairs whose sending ends one process closed
    held 439 MB under a 64 MB limit. So a socket with data to read and no live peer (a
    datagram socket with any) is charged the most dead senders can have left it
    (`ORPHANED`), and a listening socket as much for each connection it has not accepted,
    which no dump lists either (500 of them, their clients closed, held 111 MB)."""
    sock = UNIX_DIAG[0]
    sock.send(UNIX_DUMP)
    total, live = 0, set()
    unread: list[tuple[int, int]] = []  # (peer inode, socket type) of each socket with data
    while True:
        data, at = sock.recv(1 << 16), 0
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind == 3:  # NLMSG_DONE
                # (a datagram socket may hold others' datagrams beside its live peer's)
                orphaned = [k for peer, k in unread if peer not in live or k == 2]
                return total + sum(ORPHANED[k] for k in orphaned)
            if kind == 2:  # NLMSG_ERROR
                raise OSError(-struct.unpack_from("=i", data, at + 16)[0], "sock_diag")
            # unix_diag_msg: family, type, state, pad, inode
            sock_type, listening = data[at + 17], data[at + 18] == 10  # (state TCP_LISTEN)
            ino, peer = struct.unpack_from("=I", data, at + 20)[0], 0
            live.add(ino)
            attr = at + 32  # after nlmsghdr (16 bytes) and unix_diag_msg (16)
            while attr + 4 <= at + length:
                size, name = struct.unpack_from("=HH", data, attr)
                if name == 2:  # UNIX_DIAG_PEER: its inode (0 once closed)
                    peer = struct.unpack_from("=I", data, attr + 4)[0]
                if name == 4:  # UNIX_DIAG_RQLEN: (rqueue, wqueue)
                    rqueue, wqueue = struct.unpack_from("=II", data, attr + 4)
                    if listening:  # rqueue: connections not accepted, which no dump lists
                        total += rqueue * ORPHANED[sock_type]
                    else:
                        total += wqueue
                        if rqueue:
                            unread.append((peer, sock_type))
                attr += max((size + 3) & ~3, 4)
            at += max((length + 3) & ~3, 16)


def _orphan_bounds():
    """`ORPHANED`: what a dead sender can have left in a receiver's queue. Executions cannot
    raise a send buffer (`seccomp`: SO_SNDBUF), so each sender's is ``net.core.wmem_default``,
    which its queued data passes by at most one send (half a buffer). A stream or seqpacket
    socket has one peer; a datagram socket also takes up to ``max_dgram_qlen`` + 1 datagrams
    from senders that are not its peer, each at most a buffer."""
    with open("/proc/sys/net/core/wmem_default") as f:
        buffer = int(f.read())
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        backlog = int(f.read()) + 1
    ORPHANED.update({1: 2 * buffer, 5: 2 * buffer, 2: (2 + backlog) * buffer})


def _netlink_queued():
    """Bytes in the sandbox's netlink sockets' queues (``/proc/net/netlink``: Rmem, Wmem):
    replies to requests never read stay queued, up to each socket's receive buffer: 28
    routing sockets of one process held 224 MB under a 64 MB limit."""
    lines = read_net("netlink").splitlines()[1:]  # after the header
    return sum(int(line.split()[4]) + int(line.split()[5]) for line in lines)


# The execution's memory group, when the host gave the worker one (`tools.sandbox`): the
# kernel charges it the memory the execution's processes cause, kernel memory included (socket
# filters, pipe buffers, slab such as dentries and Landlock rulesets, page tables, tmpfs
# pages; not Unix and netlink socket queues, which the watchdog adds), and holds it at
# ``memory_mb``: at the bound it reclaims what it can, then fails the allocation or kills a
# process of the group. The fork server reads from the kernel's counts whether the group
# reached its bound and then ends the whole execution ("memory").
GROUP = {"version": 0, "dir": -1, "procs": -1}
COUNTS: list[int] = []  # the group's counts the watchdog reads (`_group_at_bound`)
EXECUTION_GROUP = "execution"


def _group_write(name, value):
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=GROUP["dir"])
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def new_group(limits):
    """A fresh memory group for one execution, bounded by its ``memory_mb`` (no swap), and on
    cgroup v2 ``processes``; opens its ``cgroup.procs`` for the child (`_child`) and the
    kernel's counts for the watchdog (`_group_at_bound`)."""
    os.mkdir(EXECUTION_GROUP, dir_fd=GROUP_FD)
    GROUP["dir"] = os.open(EXECUTION_GROUP, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                           dir_fd=GROUP_FD)  # fmt: skip
    limit = limits["memory_mb"] * 1024 * 1024
    if GROUP["version"] == 1:
        _group_write("memory.limit_in_bytes", limit)
        try:  # memory + swap, where the kernel accounts swap
            _group_write("memory.memsw.limit_in_bytes", limit)
        except FileNotFoundError:
            pass
        counts = ("memory.max_usage_in_bytes", "memory.oom_control", "memory.usage_in_bytes")
    else:
        _group_write("memory.max", limit)
        _group_write("memory.swap.max", 0)
        _group_write("pids.max", limits["processes"])
        counts = ("memory.peak", "memory.events", "memory.current")
    COUNTS[:] = [os.open(n, os.O_RDONLY | os.O_CLOEXEC, dir_fd=GROUP["dir"]) for n in counts]
    GROUP["procs"] = os.open("cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=GROUP["dir"])


def _group_at_bound(limit, queued):
    """Whether the execution's group reached its memory bound ``limit``: its peak (v1
    ``memory.max_usage_in_bytes``, v2 ``memory.peak``) came within one charge batch of it (the
    kernel charges in batches of up to 64 pages, reclaims at the bound and does not always
    count the failure: a v1 ``memory.failcnt`` stayed 0 as negative dentries were reclaimed
    at the bound), the kernel killed a process of it (``oom_kill``), or what it holds now
    and the ``queued`` bytes of the sandbox's Unix and netlink sockets, which the kernel
    charges to no group (v2 charges TCP and UDP buffers only), pass the bound."""
    peak, current = (os.pread(COUNTS[i], 4096, 0) for i in (0, 2))
    return int(peak) >= limit - 64 * PAGE or _oom_kills() > 0 or int(current) + queued > limit


def _oom_kills():
    """The processes the kernel killed in the execution's group at its bound (v1
    ``memory.oom_control``, v2 ``memory.events``: ``oom_kill N``)."""
    words = os.pread(COUNTS[1], 4096, 0).split()
    return int(words[words.index(b"oom_kill") + 1])


def remove_group():
    """Removes the execution's group, once its processes are gone (`sweep`); False if it
    cannot be (a process is left in it)."""
    for fd in (GROUP["procs"], GROUP["dir"], *COUNTS):
        os.close(fd)
    GROUP["procs"] = -1
    try:
        os.rmdir(EXECUTION_GROUP, dir_fd=GROUP_FD)
    except OSError:
        return False
    return True


def _netlink_inodes():
    return {line.split()[-1] for line in read_net("netlink").splitlines()[1:]}


OWN_NETLINK: set[bytes] = set()  # the netlink sockets of the fork server and of the kernel


def no_sockets_left():
    """After the sweep: whether the sandbox's network namespace holds no socket of an
    execution. One sent over a Unix socket and never received (in flight) outlives every
    process until the kernel's garbage collector finds it, and a socket bound to an abstract
    name of the namespace is there for the next execution to connect to: a message passed
    between executions that way. The namespace lives as long as the sandbox, so one that is
    not empty makes it dirty (replaced)."""
    sock = UNIX_DIAG[0]
    sock.send(UNIX_DUMP)
    count = 0
    while True:
        data, at = sock.recv(1 << 16), 0
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind == 3:  # NLMSG_DONE
                return count == 0 and _netlink_inodes() <= OWN_NETLINK
            if kind == 2:  # NLMSG_ERROR
                return False
            count += 1
            at += max((length + 3) & ~3, 16)


def over_limit(limits):
    """The name of the execution-wide bound that is exceeded, or None."""
    memory, cpu, files = usage()
    limit = limits["memory_mb"] * 1024 * 1024
    if _group_at_bound(limit, memory) if GROUP["version"] else memory > limit:
        return "memory"
    if cpu > limits["cpu_s"]:
        return "CPU time"
    if files > limits["files"]:
        return "file count"
    return None


def _result(start, stdout, stderr, exit_code, *, timed_out, truncated, limit, dirty):
    return {
        "stdout": stdout,
        "stderr": stderr,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "truncated": truncated,
        "limit": limit,
        "wall_s": time.time() - start,
        "dirty": dirty,
    }


def _supervise(pid, out_r, err_r, limits, start, deadline):
    """Reads the child's output until it ends, its deadline passes, a limit of the execution
    is crossed (polled every WATCH_EVERY_S) or the output outgrows its cap. Returns (bufs,
    status or None while the child still runs, timed_out, truncated, limit)."""
    bufs = {out_r: bytearray(), err_r: bytearray()}
    cap = limits["output_bytes"]
    next_watch = start + WATCH_EVERY_S
    timed_out = truncated = False
    limit = None
    open_fds = [out_r, err_r]
    status = None
    exited_at = None
    while open_fds:
        now = time.time()
        if now >= deadline:
            timed_out = status is None
            break
        if now >= next_watch:
            limit = over_limit(limits)
            if limit is not None:
                break
            next_watch = now + WATCH_EVERY_S
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status, exited_at = st, time.time()
        elif exited_at is not None and now - exited_at > 0.05:
            break  # the code returned; something it started still holds the pipes
        ready, _, _ = select.select(open_fds, [], [], min(deadline - now, WATCH_EVERY_S))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            bufs[fd] += chunk
            if len(bufs[out_r]) + len(bufs[err_r]) > cap:
                truncated = True
                open_fds = []
                break
    return bufs, status, timed_out, truncated, limit


def _run(req, pristine):
    limits = req["limits"]
    start = time.time()
    if GROUP["version"]:
        new_group(limits)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(req["code"], limits, out_w, err_w, GROUP["procs"])
    os.close(out_w)
    os.close(err_w)
    bufs, status, timed_out, truncated, limit = _supervise(
        pid, out_r, err_r, limits, start, start + req["timeout_s"]
    )
    if status is None:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if limit is None and GROUP["version"] and not (timed_out or truncated):
        # the kernel's kill at the group's bound falls between two looks of the watchdog as
        # often as not (its pipes close, the loop ends: 7 of 15 tmpfs fills were "killed", not
        # "memory"); the group's counts keep it until the group goes: the child killed at
        # its peak, or any process of the execution killed by the kernel (a child's, whose
        # parent went on to exit on its own)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        at_bound = _group_at_bound(limits["memory_mb"] * 1024 * 1024, 0)
        if (killed and at_bound) or _oom_kills() > 0:
            limit = "memory"
    os.close(out_r)
    os.close(err_r)
    clean = sweep() and renew(pristine) and no_sockets_left()
    if GROUP["version"]:
        clean = remove_group() and clean
    if os.WIFSIGNALED(status):
        exit_code = -os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
    cap = limits["output_bytes"]
    return _result(
        start,
        bufs[out_r][:cap].decode("utf-8", "replace"),
        bufs[err_r][:cap].decode("utf-8", "replace"),
        exit_code,
        timed_out=timed_out,
        truncated=truncated,
        limit=limit,
        dirty=not clean,
    )


def main():
    # no handler for a signal an execution can send (the kernel drops those to a namespace's
    # init that has none); the ignored SIGPIPE and SIGXFSZ Python set stay ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    # no transparent huge pages, here and (inherited) in every execution, which cannot undo it
    # (`seccomp.execution_filter`): a huge page stays whole while 4 KB of it is mapped, and only
    # those 4 KB are in a resident set (400 kept so held 826 MB while 13 MB were counted)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE, 1) failed")
    _take_pipes(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4]))
    GROUP["version"] = int(sys.argv[5])
    hold_counters()  # after `_take_pipes`, which closes every other fd
    hide_fork_server()
    # (before `confine_executions`, whose filter refuses executions this kind of socket)
    UNIX_DIAG.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 4))
    _orphan_bounds()
    _unix_queued()  # a kernel that cannot tell them fails the start, never an execution
    OWN_NETLINK.update(_netlink_inodes())
    for root, mode in WRITABLE.items():
        os.chmod(root, mode)
        fs = os.statvfs(root)
        SIZES[root] = f"mode=755,size={fs.f_blocks * fs.f_frsize}".encode()
    pristine = {root: metadata(root) for root in WRITABLE}
    # the first execution meets the sandbox as every later one does: on renewed mounts (on
    # bubblewrap's own, their ids and order told it the sandbox was fresh, which an execution
    # decides by leaving it dirty: a bit to the next one, 16 of 16)
    if not renew(pristine):
        raise OSError("could not renew the writable mounts before the first execution")
    confine_executions(bytes.fromhex(sys.argv[3]))
    for name in PRELOAD:
        __import__(name)
    compile(WARM_COMPILER, "<warm>", "exec")
    # Objects alive now never need collecting; freezing them keeps a forked child's garbage
    # collector from touching (and copying) the whole heap: ~3 ms less per execution.
    gc.freeze()
    # Start-up errors went to the host through stderr; from here on nothing reads it, and
    # a full pipe would stop this process for good.
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    _send({"ready": True})
    while True:
        head = _read_exact(4)
        if head is None:
            return
        body = _read_exact(struct.unpack(">I", head)[0])
        if body is None:
            return
        reply = _run(json.loads(body), pristine)
        _send(reply)
        if reply["dirty"]:
            return  # the host starts a fresh sandbox


main()
