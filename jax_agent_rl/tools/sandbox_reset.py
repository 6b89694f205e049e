"""Making a sandbox as it was before an execution, for the fork server (`sandbox_zygote`),
which runs this file's code too, under the system Python with ``-I -S`` (only the standard
library is used; `tools.sandbox` puts it in ``sys.modules`` before the zygote imports it).

Between executions the fork server kills every process but itself (`sweep`) and replaces each
writable place with a fresh tmpfs mount (`renew`), and sets the pid counter back. It keeps only
the capabilities that takes (`hold_counters`) and an execution starts with none
(`drop_capabilities`).
"""

import ctypes
import os
import signal

WRITABLE = {"/work": 0o755, "/tmp": 0o1777, "/dev/shm": 0o1777}  # and their modes


def metadata(root):
    """What an execution can leave on a writable root besides its entries: (st_mode, uid, gid,
    atime ns, mtime ns, extended attributes: ``user.*`` and the ACLs, ``system.posix_acl_*``)."""
    st = os.lstat(root)
    xattrs = {name: os.getxattr(root, name) for name in os.listxattr(root)}
    return st.st_mode, st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns, xattrs


def sweep():
    """Kills every process but this one and reaps them; True if none is left."""
    try:
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of the namespace, at once
    except ProcessLookupError:
        pass  # there was none
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    return [p for p in os.listdir("/proc") if p.isdigit()] == ["1"]


# What the fork server alone may do (bubblewrap ``--cap-add``, in the sandbox's user namespace
# only, which owns nothing outside it): CAP_SYS_ADMIN to remount the writable places and to set
# the pid counter, kept; CAP_SYS_RESOURCE to close user namespaces, dropped once that is done.
# An execution starts with no capability at all (`drop_capabilities`).
CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 21, 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MNT_DETACH, MS_NOSUID, MS_NODEV = 2, 2, 4
LIBC = ctypes.CDLL(None, use_errno=True)
HELD: dict[str, int] = {}  # "last_pid": a write-only fd on ns_last_pid (`hold_counters`)
SIZES: dict[str, bytes] = {}  # each writable place's mount options, as bubblewrap mounted it


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _set_capabilities(caps):
    """Makes ``caps`` (capability numbers under 32) this process's effective and permitted
    sets, and empties its inheritable and ambient ones."""
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    mask = sum(1 << cap for cap in caps)
    data = (ctypes.c_uint32 * 6)(mask, mask, 0, 0, 0, 0)  # {effective, permitted, inheritable} x2
    _check(LIBC.capset(header, data), "capset")
    _check(LIBC.capget(header, data), "capget")
    if list(data) != [mask, mask, 0, 0, 0, 0]:
        raise OSError(f"capabilities are {list(data)}, not {caps}")


def hold_counters():
    """Once, before serving: closes user namespaces (``user.max_user_namespaces = 0`` in the
    sandbox's own one: what ``bwrap --disable-userns`` does, which would have put the fork
    server in a nested namespace that owns neither its mounts nor its pid namespace), opens
    the pid counter for `renew`, and keeps only CAP_SYS_ADMIN."""
    with open("/proc/sys/user/max_user_namespaces", "r+") as f:
        f.write("0")
        f.flush()
        f.seek(0)
        if f.read().strip() != "0":
            raise OSError("user namespaces stayed open")
    HELD["last_pid"] = os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY | os.O_CLOEXEC)
    os.chdir("/")  # not /work: a cwd there would keep the first /work mount alive
    _set_capabilities([CAP_SYS_ADMIN])


MS_NOEXEC, MS_RDONLY = 8, 1
NET: dict[str, int] = {}  # "fd": this process's /proc/<pid>/net, kept open (`hide_fork_server`)


def hide_fork_server():
    """Once, before serving: an empty read-only tmpfs over ``/proc/1``, the fork server's own
    entries, after opening its ``net`` folder for `read_net` (``/proc/net`` is
    ``/proc/self/net``, which is ``/proc/1/net`` here). Every execution ends as a child the
    fork server reaps, so its counters move with what each execution does: ``/proc/1/stat``'s
    children's CPU time carried two bits an execution from one to the next (12 of 12 read
    back), and ``status``, ``sched`` and ``schedstat`` carry the same kind of count."""
    NET["fd"] = os.open("/proc/self/net", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
    _check(LIBC.mount(b"tmpfs", b"/proc/1", b"tmpfs", flags, b"size=4k,mode=555"), "mount /proc/1")
    if os.listdir("/proc/1") or os.path.exists("/proc/self/stat"):
        raise OSError("/proc/1 is still readable")


def read_net(name):
    """The bytes of ``/proc/net/<name>`` (this network namespace's), through the folder
    `hide_fork_server` kept open."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=NET["fd"])
    with os.fdopen(fd, "rb") as f:
        return f.read()


# capset's arguments for "no capability at all", built before any fork: the child makes one
# call (building them there costs each execution ~70 page faults of copied memory)
NO_CAPABILITIES = (
    (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0),
    (ctypes.c_uint32 * 6)(),
)


def drop_capabilities():
    """In the child, before anything of the execution: no capability, or no execution."""
    if LIBC.capset(*NO_CAPABILITIES) != 0:
        os._exit(125)


def renew(pristine):
    """After the sweep: a fresh tmpfs mount in place of each writable place, in `WRITABLE`'s
    order, given the mode and times its root had (`metadata` must then equal ``pristine``),
    and the pid counter back to 1. Whatever the execution left goes with the old mount:
    entries however deep or locked, the root's extended attributes (a default ACL would shape
    every later file), and the inode counter it moved by creating files, which the next
    execution would read: each execution finds its first file at the same inode, and its
    process at pid 2. Every place, touched or not, in the same order: renewing only those
    touched moved their lines to the end of ``/proc/self/mountinfo`` and changed their mount
    ids, which the next execution read (bits chosen by which places one wrote). ~35 us of CPU
    a mount. False if any of it failed (the host then replaces the sandbox)."""
    try:
        for root, mode in WRITABLE.items():
            *_, atime, mtime, _ = pristine[root]
            _check(LIBC.umount2(root.encode(), MNT_DETACH), f"umount {root}")
            _check(
                LIBC.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, SIZES[root]),
                f"mount {root}",
            )
            os.chmod(root, mode)  # the mount option cannot say sticky
            os.utime(root, ns=(atime, mtime))
            if metadata(root) != pristine[root]:
                return False
        os.pwrite(HELD["last_pid"], b"1", 0)
    except OSError:
        return False
    return True


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def confine_executions(program):
    """Adds ``program`` (`seccomp.execution_filter`) to this process's filters: every
    execution inherits both."""
    fprog = _SockFprog(len(program) // 8, program)
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
