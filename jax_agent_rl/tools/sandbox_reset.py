"""Making a sandbox as it was before an execution, for the fork server (`sandbox_zygote`),
which runs this file's code too, under the system Python with ``-I -S`` (only the standard
library is used; `tools.sandbox` puts it in ``sys.modules`` before the zygote imports it).

Between executions the fork server kills every process but itself (`sweep`) and replaces each
writable place an execution touched with a fresh tmpfs mount (`renew`), which it knows from an
inotify watch on each (`confine_executions`), and sets the pid counter back. It keeps only
the capabilities that takes (`hold_counters`) and an execution starts with none
(`drop_capabilities`).
"""

import ctypes
import os
import signal
import struct

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
    """After the sweep: a fresh tmpfs mount in place of each writable place the execution
    touched (`_touched`), given the mode and times its root had (`metadata` must then equal
    ``pristine``), and the pid counter back to 1. Whatever the execution left goes with the
    old mount: entries however deep or locked, the root's extended attributes (a default ACL
    would shape every later file), and the inode counter it moved by creating files, which the
    next execution would read: each execution finds its first file at the same inode, and its
    process at pid 2. A place no event shows touched holds nothing and was not changed (every
    entry starts at its empty root, and unnamed files are denied): it stays. ~35 us of CPU a
    mount. False if any of it failed (the host then replaces the sandbox)."""
    try:
        for root in _touched():
            *_, atime, mtime, _ = pristine[root]
            _check(LIBC.umount2(root.encode(), MNT_DETACH), f"umount {root}")
            _check(
                LIBC.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, SIZES[root]),
                f"mount {root}",
            )
            os.chmod(root, WRITABLE[root])  # the mount option cannot say sticky
            os.utime(root, ns=(atime, mtime))
            if metadata(root) != pristine[root]:
                return False
            _watch(root)  # after chmod and utime, whose events would mark it touched
        os.pwrite(HELD["last_pid"], b"1", 0)
    except OSError:
        return False
    return True


# inotify: the fork server watches each writable root for any event at all (an entry made,
# moved or removed, a read of the directory, a change of its mode, times or attributes)
IN_NONBLOCK, IN_CLOEXEC, IN_ALL_EVENTS, IN_Q_OVERFLOW = 0o4000, 0o2000000, 0xFFF, 0x4000
INOTIFY = {"fd": -1}
WATCHES: dict[int, str] = {}  # watch descriptor: root, for the current mounts only


def _watch(root):
    wd = LIBC.inotify_add_watch(INOTIFY["fd"], root.encode(), IN_ALL_EVENTS)
    if wd < 0:
        _check(wd, f"inotify_add_watch {root}")
    for old in [w for w, r in WATCHES.items() if r == root]:
        del WATCHES[old]  # its mount is gone; its IN_IGNORED may come later
    WATCHES[wd] = root


def _touched():
    """The writable roots an event was queued for since the last call (all of them if the
    queue overflowed), in `WRITABLE`'s order."""
    touched: set[str] = set()
    while True:
        try:
            data = os.read(INOTIFY["fd"], 65536)
        except BlockingIOError:
            break
        at = 0
        while at < len(data):  # struct inotify_event: wd, mask, cookie, len, name[len]
            wd, mask, _, size = struct.unpack_from("iIII", data, at)
            at += 16 + size
            if mask & IN_Q_OVERFLOW:
                touched.update(WRITABLE)
            elif wd in WATCHES:
                touched.add(WATCHES[wd])
    return [root for root in WRITABLE if root in touched]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def confine_executions(program):
    """Watches the writable roots, then adds ``program`` (`seccomp.execution_filter`, which
    denies inotify and unnamed files) to this process's filters: every execution inherits
    both, and only the fork server holds an inotify instance."""
    INOTIFY["fd"] = LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    _check(min(INOTIFY["fd"], 0), "inotify_init1")
    for root in WRITABLE:
        _watch(root)
    fprog = _SockFprog(len(program) // 8, program)
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
