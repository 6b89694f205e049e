"""The fork server that runs inside each sandbox, as the sandbox's pid 1 (bubblewrap
``--as-pid-1``), under an unprivileged uid and the seccomp filter.

It serves one execution at a time: it reads a request frame, forks a child that applies the
resource limits and runs the code in ``/work``, collects its output (bounded) while a watchdog
accounts the whole execution, then kills every other process in the sandbox and wipes the
writable places (``/work``, ``/tmp``, ``/dev/shm``), so no state survives from one execution to
the next. The zygote itself never runs user code, so every child starts from the same state.

Why the executions cannot reach it: it is not dumpable (``PR_SET_DUMPABLE=0``: no
``/proc/1/mem`` and no ptrace for processes of the same uid, and the filter denies ptrace
anyway), and as the init of its pid namespace it ignores every signal sent from inside,
SIGKILL and SIGSTOP included. What the watchdog accounts, summed over every process of the
execution (rlimits alone are per process): resident memory plus the bytes on the sandbox's
tmpfs mounts (``memory_mb``), CPU seconds (``cpu_s``) and files on the tmpfs mounts
(``files``). An execution over a bound is killed and its result names the bound.

If the sweep cannot prove the sandbox clean (a process survived, or something could not be
removed), the reply says ``dirty`` and the zygote exits: the host starts a fresh sandbox.

Frames are a 4-byte big-endian length and a JSON object, on the two pipe file descriptors
given as arguments (requests in, replies out); the child never sees them. Only the standard
library is used: this file runs under the system Python with ``-I -S``.
"""

import ctypes
import gc
import json
import os
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time
import traceback

REQ_FD, REP_FD = int(sys.argv[1]), int(sys.argv[2])
# Standard-library modules that model-written code imports most, imported once here so that
# every execution forks with them ready: a fresh interpreter pays e.g. ~5 ms for ``fractions``
# (it imports ``decimal``, ``numbers``, ``re``) per call. They are pure computation (no files,
# sockets or threads); each child gets its own copy-on-write copy, so what code changes in one
# is gone in the next, and ``random`` reseeds itself in each forked child (`os.register_at_fork`).
PRELOAD = (
    "bisect", "cmath", "collections", "datetime", "decimal", "fractions", "functools",
    "heapq", "itertools", "math", "operator", "random", "re", "statistics", "string",
)  # fmt: skip
WRITABLE = {"/work": 0o755, "/tmp": 0o1777, "/dev/shm": 0o1777}  # and their modes
PR_SET_DUMPABLE = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
WATCH_EVERY_S = 0.01


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


def _child(compiled, limits, out_w, err_w):
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, 1024)
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    os.chdir("/work")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    status = 0
    try:
        exec(compiled, scope)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the traceback is the model's observation
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def usage():
    """(resident bytes + tmpfs bytes, CPU seconds, tmpfs files) of every process but pid 1.

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
    return rss + used, ticks / TICK, files


def over_limit(limits):
    """The name of the execution-wide bound that is exceeded, or None."""
    memory, cpu, files = usage()
    if memory > limits["memory_mb"] * 1024 * 1024:
        return "memory"
    if cpu > limits["cpu_s"]:
        return "CPU time"
    if files > limits["files"]:
        return "file count"
    return None


def _make_writable(top):
    """chmod u+rwx every directory under ``top`` (the code may have locked some) before
    removing it; raises on anything it cannot open."""
    stack = [top]
    while stack:
        path = stack.pop()
        os.chmod(path, 0o700)
        with os.scandir(path) as entries:
            stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))


def _sweep():
    """Kill every process but this one, then empty the writable dirs. True if the sandbox is
    provably back to its pristine state."""
    try:
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of the namespace, at once
    except ProcessLookupError:
        pass  # there was none
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    clean = [p for p in os.listdir("/proc") if p.isdigit()] == ["1"]
    for root, mode in WRITABLE.items():
        try:
            os.chmod(root, mode)
            for name in os.listdir(root):
                path = os.path.join(root, name)
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    _make_writable(path)
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            clean = clean and not os.listdir(root)
        except (OSError, RecursionError):
            clean = False
    return clean


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


def _run(req):
    limits = req["limits"]
    start = time.time()
    try:  # compiled here, not in the child: cheaper, and a syntax error needs no process
        compiled = compile(req["code"], "<sandbox>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        text = "".join(traceback.format_exception_only(type(e), e))
        return _result(
            start, "", text, 1, timed_out=False, truncated=False, limit=None, dirty=False
        )
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(compiled, limits, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    bufs, status, timed_out, truncated, limit = _supervise(
        pid, out_r, err_r, limits, start, start + req["timeout_s"]
    )
    if status is None:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    os.close(out_r)
    os.close(err_r)
    clean = _sweep()
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
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    for name in PRELOAD:
        __import__(name)
    # Objects alive now never need collecting; freezing them keeps a forked child's garbage
    # collector from touching (and copying) the whole heap: ~3 ms less per execution.
    gc.freeze()
    _send({"ready": True})
    while True:
        head = _read_exact(4)
        if head is None:
            return
        body = _read_exact(struct.unpack(">I", head)[0])
        if body is None:
            return
        reply = _run(json.loads(body))
        _send(reply)
        if reply["dirty"]:
            return  # the host starts a fresh sandbox


main()
