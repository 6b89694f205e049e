"""The sandbox's seccomp filters: classic-BPF programs, assembled here. Bubblewrap loads the
first, `filter_program`, into every process of a sandbox (``bwrap --seccomp FD``) before the
fork server starts; the fork server adds the second, `execution_filter`, once it has set up
what it alone uses, so every execution runs under both (see the end of this docstring).

It is a deny list on top of the namespaces, aimed at what an RL policy's code could use to
reach outside its own execution:

- other processes' memory: ``ptrace``, ``process_vm_readv`` / ``process_vm_writev``, ``kcmp``;
- new namespaces (a fresh user namespace grants capabilities inside it): ``unshare``,
  ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag; ``clone3`` passes its flags in
  memory a filter cannot read, so it answers ENOSYS and libc falls back to ``clone``;
- state that outlives a process inside the sandbox's IPC namespace and so would carry over
  from one execution to the next: System V shared memory, semaphores and message queues,
  POSIX message queues; and memory files (``memfd_create``), whose pages neither a process's
  resident set nor a mount's usage shows to the execution's memory accounting;
- channels to other sandboxes and to the host: file locks (``flock``, and ``fcntl``'s POSIX
  and open-file-description lock commands) on the files every sandbox shares (``/usr``, the
  ``/dev`` nodes) succeed without doing anything, so no lock is ever taken; ``inotify``
  (reads of a shared file in one sandbox are events in another) is denied to executions
  (`execution_filter`); sockets are only
  ``AF_UNIX`` and ``AF_NETLINK`` for routing queries (``NETLINK_ROUTE``, what libc's
  ``getaddrinfo`` asks) and socket diagnostics (``NETLINK_SOCK_DIAG``: the fork server reads
  its Unix sockets' queues with it; `execution_filter` refuses it to executions): ``AF_VSOCK``
  would reach a virtual machine's host, and the other families are kernel surface no code
  needs. ``AF_INET`` and ``AF_INET6`` (the sandbox's own loopback, its only network) are
  refused too: a TCP or UDP queue holds pieces of 32 KB pages its sender's task shares
  between all its sockets, and the kernel charges each piece its bytes, so one byte queued
  can keep a whole page: 200 KB queued on one loopback connection held 3.3 GB, and no
  reading of the queues (``/proc/net/tcp``, socket diagnostics) sees the pages;
- page references handed to pipes and sockets: ``vmsplice`` puts the process's own pages in
  a pipe (a 4 KB slot kept a whole 2 MB huge page after the process unmapped it: 28 pipes of
  one process held 974 MB under ``memory_mb=64``); ``splice``, ``tee`` and ``sendfile`` hand
  on page-cache pages, which outlive the file they came from (a deleted ``/tmp`` file's pages
  stay, in no mount's usage). Python's ``shutil`` and ``socket.sendfile`` fall back to
  copying;
- kernel surface a sandboxed interpreter never needs: the new mount API, keyrings, BPF,
  ``perf_event_open``, ``userfaultfd``, ``io_uring``, module loading, ``kexec``, clock and
  host-name setters, handles by inode, ``syslog``.

``mount`` and ``umount2`` are allowed: the fork server remounts the sandbox's tmpfs mounts
after every execution, and an execution holds no capability, so the kernel refuses them to it
(`sandbox_zygote` checks that every execution starts with none).

`execution_filter` is the fork server's own, added once it has set up what it alone uses: it
denies executions ``inotify_init``/``inotify_init1``, and setting ``SIGCHLD``'s action
(``rt_sigaction`` with an action: EPERM; reading it is allowed). A process whose parent ignores
``SIGCHLD`` (or sets ``SA_NOCLDWAIT``) is reaped by the kernel as it exits, and its CPU time
goes to no one's children's time, so the fork server's CPU accounting of the execution never
saw it: children forked one after another, each exiting within the limit, burned any CPU time
the wall-clock timeout left (3.2 CPU seconds under ``cpu_s=2`` in 7 s on two cores;
``processes`` cores for the whole timeout on a larger machine). Without it every exited process
stays a zombie, counted, until its parent waits for it (its time is then the parent's
children's time). Executions are also denied shared anonymous memory (``mmap`` with
``MAP_SHARED | MAP_ANONYMOUS``: EPERM; a private mapping, or a shared one of a file in
``/dev/shm``, still works), and the sandbox has no ``/dev/zero``, whose shared mappings are the
same memory: its pages are in no mount's usage, and in the resident set only of the processes
that touched them, so children filling a holder's mapping chunk by chunk, each exiting, left 4
holders with 576 MB under ``memory_mb=256`` (the fork server, pid 1, is not dumpable, nor are
the executions it forks, so it cannot read their maps to count such mappings). Executions get
no transparent huge pages (the fork server sets ``PR_SET_THP_DISABLE`` before it serves, which
every fork inherits, and ``execution_filter`` denies setting it): a 2 MB huge page stays whole
while any 4 KB of it is mapped, and the resident set counts only what is mapped, so one process
that kept 4 KB of each of 400 huge pages showed 13 MB and held 826 MB until memory pressure
splits them. Nor can they set a socket's send buffer (``setsockopt`` ``SO_SNDBUF``,
``SO_SNDBUFFORCE``: EPERM): it stays ``net.core.wmem_default``, which bounds what a closed
sender leaves queued for its receiver, memory the fork server charges without seeing it
(`sandbox_zygote._unix_queued`). Nor can they set another process's resource limits
(``prlimit64`` with a pid, EPERM; their own, pid 0, as ``setrlimit`` does, is allowed): the
fork server runs as their user, and limits set on it (a message-queue size read back, a data
limit under what an execution needs) reached every later execution on its worker.

Everything else is allowed. A system call of another ABI (i386 on an x86-64 kernel) kills
the process; one of the x32 ABI fails with EPERM. Tables exist for x86-64 and aarch64; on
another machine `filter_program` raises rather than run unfiltered. The numbers are checked
against the kernel headers by ``tests/hostile/test_sandbox_escapes.py``.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH = 0, 4


def _arg_low(i: int) -> int:
    """Offset of the low 32 bits of system call argument ``i`` (little-endian machines)."""
    return 16 + 8 * i


# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
RET_SKIP = _RET_ERRNO | 0  # the call is not made and returns 0: success, having done nothing
_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NAMESPACE_FLAGS |= 0x20000000 | 0x40000000
# socket families any code may open (the others answer EAFNOSUPPORT): AF_UNIX; AF_NETLINK
# (16) only with protocol NETLINK_ROUTE (0)
SOCKET_FAMILIES = (1,)
AF_NETLINK, NETLINK_ROUTE, NETLINK_SOCK_DIAG = 16, 0, 4
# fcntl commands that take or drop a lock: F_SETLK F_SETLKW (the same numbers as their 64-bit
# forms on 64-bit machines), F_OFD_SETLK F_OFD_SETLKW. The tests (F_GETLK, F_OFD_GETLK) run:
# with no lock ever taken in a sandbox they find none but the host's, and SQLite's WAL mode
# needs an answer of "unlocked" to take a database over.
LOCK_COMMANDS = (6, 7, 37, 38)
SIGCHLD = 17  # on x86-64 and aarch64 alike
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20  # (MAP_SHARED_VALIDATE, 0x03, has MAP_SHARED's bit)
PR_SET_THP_DISABLE = 41
SOL_SOCKET, SO_SNDBUF, SO_SNDBUFFORCE = 1, 7, 32
RWF_NOWAIT = 0x08  # preadv2/pwritev2: fail rather than wait for a page not in the cache
MADV_COLD, MADV_PAGEOUT = 20, 21
# the page cache of the files every sandbox and the host share (/usr), which executions would
# probe (cachestat, a read that must not wait) and evict (fadvise's DONTNEED, madvise's COLD
# and PAGEOUT): 11 bits from one execution to the next, exact, and to the host
PAGE_CACHE_CALLS = ("fadvise64", "readahead", "cachestat")

DENIED = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # namespaces and the new mount API (clone's namespace flags are checked separately)
    "unshare", "setns", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # IPC objects that outlive their creator; memory files no mount's usage shows
    "shmget", "semget", "msgget", "mq_open", "memfd_create", "memfd_secret",
    # pages handed by reference to pipes and sockets, outliving their mapping or file
    "vmsplice", "splice", "tee", "sendfile",
    # kernel surface
    "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "quotactl",
    "acct", "settimeofday", "clock_settime", "clock_adjtime", "sethostname", "setdomainname",
    "name_to_handle_at", "open_by_handle_at", "syslog", "lookup_dcookie", "vhangup",
    "fanotify_init", "move_pages", "migrate_pages", "iopl", "ioperm",
)  # fmt: skip

# (AUDIT_ARCH value, {syscall: number}); names not in a table do not exist on that machine.
SYSCALLS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
            "unshare": 272, "setns": 308, "clone": 56, "clone3": 435,
            "pivot_root": 155, "chroot": 161, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442, "shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240,
            "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321,
            "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
            "io_uring_enter": 426, "io_uring_register": 427, "init_module": 175,
            "finit_module": 313, "delete_module": 176, "kexec_load": 246,
            "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168,
            "quotactl": 179, "acct": 163, "settimeofday": 164, "clock_settime": 227,
            "clock_adjtime": 305, "sethostname": 170, "setdomainname": 171,
            "name_to_handle_at": 303, "open_by_handle_at": 304, "syslog": 103,
            "lookup_dcookie": 212, "vhangup": 153, "fanotify_init": 300, "move_pages": 279,
            "migrate_pages": 256, "iopl": 172, "ioperm": 173, "memfd_create": 319,
            "memfd_secret": 447, "inotify_init": 253, "inotify_init1": 294,
            "socket": 41, "socketpair": 53, "fcntl": 72, "flock": 73, "rt_sigaction": 13,
            "mmap": 9, "vmsplice": 278, "splice": 275,
            "tee": 276, "sendfile": 40, "prctl": 157, "setsockopt": 54, "prlimit64": 302,
            "fadvise64": 221, "readahead": 187, "preadv2": 327, "pwritev2": 328, "madvise": 28,
            "cachestat": 451,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
            "unshare": 97, "setns": 268, "clone": 220, "clone3": 435,
            "pivot_root": 41, "chroot": 51, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
            "mount_setattr": 442, "shmget": 194, "semget": 190, "msgget": 186, "mq_open": 180,
            "add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280,
            "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
            "io_uring_enter": 426, "io_uring_register": 427, "init_module": 105,
            "finit_module": 273, "delete_module": 106, "kexec_load": 104,
            "kexec_file_load": 294, "reboot": 142, "swapon": 224, "swapoff": 225,
            "quotactl": 60, "acct": 89, "settimeofday": 170, "clock_settime": 112,
            "clock_adjtime": 266, "sethostname": 161, "setdomainname": 162,
            "name_to_handle_at": 264, "open_by_handle_at": 265, "syslog": 116,
            "lookup_dcookie": 18, "vhangup": 58, "fanotify_init": 262, "move_pages": 239,
            "migrate_pages": 238, "memfd_create": 279, "memfd_secret": 447,
            "inotify_init1": 26, "socket": 198, "socketpair": 199, "fcntl": 25, "flock": 32,
            "rt_sigaction": 134, "mmap": 222, "vmsplice": 75,
            "splice": 76, "tee": 77, "sendfile": 71, "prctl": 167, "setsockopt": 208,
            "prlimit64": 261, "fadvise64": 223, "readahead": 213, "preadv2": 286,
            "pwritev2": 287, "madvise": 233, "cachestat": 451,
        },
    ),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One ``struct sock_filter`` {u16 code; u8 jt; u8 jf; u32 k} in the machine's byte order."""
    return struct.pack("=HBBI", code, jt, jf, k)


# An instruction before assembly: (code, k, jt, jf), where a jump target is a label (str) or 0
# (the next instruction), and a label line is a bare str.
_Line = tuple[int, int, "str | int", "str | int"] | str


def _assemble(lines: list[_Line]) -> bytes:
    """Resolves the labels of ``lines`` to the 8-bit relative offsets classic BPF jumps take."""
    at: dict[str, int] = {}
    insns: list[tuple[int, int, str | int, str | int]] = []
    for line in lines:
        if isinstance(line, str):
            at[line] = len(insns)
        else:
            insns.append(line)

    def offset(target: str | int, pc: int) -> int:
        if isinstance(target, int):
            return target
        off = at[target] - pc - 1
        if not 0 <= off <= 255:
            raise AssertionError(f"seccomp jump to {target} out of 8-bit range ({off})")
        return off

    return b"".join(
        _insn(code, k, offset(jt, pc), offset(jf, pc)) for pc, (code, k, jt, jf) in enumerate(insns)
    )


def _ret(value: int) -> _Line:
    return (_RET_K, value, 0, 0)


def _load(offset: int) -> _Line:
    """Loads a 32-bit word of ``struct seccomp_data``."""
    return (_LD_W_ABS, offset, 0, 0)


def _is(value: int, then: str | int, otherwise: str | int = 0) -> _Line:
    """Jumps to ``then`` if the loaded word equals ``value``, else to ``otherwise``."""
    return (_JEQ_K, value, then, otherwise)


def filter_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one), as the bytes ``bwrap --seccomp`` reads."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise RuntimeError(
            f"no seccomp syscall table for {machine!r} (have {sorted(SYSCALLS)}); the sandbox "
            "refuses to run without its filter"
        )
    arch, table = SYSCALLS[machine]

    lines: list[_Line] = [_load(_ARCH), _is(arch, 0, "kill"), _load(_NR)]
    if machine == "x86_64":
        lines.append((_JGE_K, _X32_SYSCALL_BIT, "eperm", 0))
    lines += [_is(table[name], "eperm") for name in DENIED if name in table]
    lines += [
        _is(table["clone"], "clone"),
        _is(table["clone3"], "enosys"),
        _is(table["socket"], "socket"),
        _is(table["socketpair"], "socket"),
        _is(table["fcntl"], "fcntl"),
        _is(table["flock"], "skip"),
        _ret(RET_ALLOW),
        # clone: denied when any namespace flag is set in the low word of args[0]
        "clone",
        _load(_arg_low(0)),
        (_AND_K, CLONE_NAMESPACE_FLAGS, 0, 0),
        _is(0, "allow", "eperm"),
        # socket, socketpair: the family (args[0]); netlink only for routing (args[2])
        "socket",
        _load(_arg_low(0)),
        *(_is(family, "allow") for family in SOCKET_FAMILIES),
        _is(AF_NETLINK, 0, "eafnosupport"),
        _load(_arg_low(2)),
        _is(NETLINK_ROUTE, "allow"),
        _is(NETLINK_SOCK_DIAG, "allow", "eafnosupport"),  # the fork server's (executions: no)
        # fcntl: the commands that take a lock (args[1]) do nothing and succeed
        "fcntl",
        _load(_arg_low(1)),
        *(_is(cmd, "skip") for cmd in LOCK_COMMANDS),
        # the shared returns (classic BPF jumps only forward)
        "allow",
        _ret(RET_ALLOW),
        "kill",
        _ret(RET_KILL_PROCESS),
        "eperm",
        _ret(_RET_ERRNO | errno.EPERM),
        "enosys",
        _ret(_RET_ERRNO | errno.ENOSYS),
        "eafnosupport",
        _ret(_RET_ERRNO | errno.EAFNOSUPPORT),
        "skip",
        _ret(RET_SKIP),
    ]
    return _assemble(lines)


def execution_filter(machine: str | None = None) -> bytes:
    """The fork server's filter for the executions (see the module docstring), as the bytes of
    a ``sock_filter`` array; on a machine of another ABI every call passes (the sandbox's own
    filter has already killed the process)."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise RuntimeError(f"no seccomp syscall table for {machine!r}")
    arch, table = SYSCALLS[machine]

    lines: list[_Line] = [_load(_ARCH), _is(arch, 0, "allow"), _load(_NR)]
    lines += [_is(table[n], "eperm") for n in ("inotify_init", "inotify_init1") if n in table]
    lines += [
        _is(table["rt_sigaction"], "sigaction"),
        _is(table["socket"], "socket"),
        _is(table["mmap"], "mmap"),
        _is(table["prctl"], "prctl"),
        _is(table["setsockopt"], "setsockopt"),
        _is(table["prlimit64"], "prlimit"),
        *(_is(table[name], "eperm") for name in PAGE_CACHE_CALLS),
        _is(table["preadv2"], "rw_flags"),
        _is(table["pwritev2"], "rw_flags"),
        _is(table["madvise"], "madvise"),
        _ret(RET_ALLOW),
        # preadv2, pwritev2: RWF_NOWAIT (flags, args[5]) tells a cached page from one not
        "rw_flags",
        _load(_arg_low(5)),
        (_JSET_K, RWF_NOWAIT, "eopnotsupp", "allow"),
        # madvise: the advice (args[2]) that evicts a file's pages from the page cache
        "madvise",
        _load(_arg_low(2)),
        _is(MADV_COLD, "eperm"),
        _is(MADV_PAGEOUT, "eperm", "allow"),
        # prlimit64: its own limits only (pid, args[0], 0): the fork server runs as the same
        # user, so another pid would be the fork server itself (or a sibling), whose limits
        # every later execution inherits
        "prlimit",
        _load(_arg_low(0)),
        _is(0, "allow", "eperm"),
        # setsockopt: a socket's send buffer (SOL_SOCKET, args[1]; SO_SNDBUF or its forced
        # form, args[2]) stays the kernel's default, the most a closed sender leaves queued
        "setsockopt",
        _load(_arg_low(1)),
        _is(SOL_SOCKET, 0, "allow"),
        _load(_arg_low(2)),
        _is(SO_SNDBUF, "eperm"),
        _is(SO_SNDBUFFORCE, "eperm", "allow"),
        # prctl: the fork server disabled transparent huge pages for itself and every execution
        # it forks; PR_SET_THP_DISABLE (args[0]) would let one turn them back on
        "prctl",
        _load(_arg_low(0)),
        _is(PR_SET_THP_DISABLE, "eperm", "allow"),
        # mmap: shared anonymous memory (its flags, args[3]) is denied
        "mmap",
        _load(_arg_low(3)),
        (_JSET_K, MAP_ANONYMOUS, 0, "allow"),
        (_JSET_K, MAP_SHARED, "eperm", "allow"),
        # socket: netlink's socket diagnostics (args[0], args[2]) are the fork server's alone
        "socket",
        _load(_arg_low(0)),
        _is(AF_NETLINK, 0, "allow"),
        _load(_arg_low(2)),
        _is(NETLINK_SOCK_DIAG, "eafnosupport", "allow"),
        # rt_sigaction: setting SIGCHLD's action (args[0], a non-NULL act pointer in args[1],
        # both of its words) is denied; reading it (act NULL) is allowed
        "sigaction",
        _load(_arg_low(0)),
        _is(SIGCHLD, 0, "allow"),
        _load(_arg_low(1)),
        _is(0, 0, "eperm"),
        _load(_arg_low(1) + 4),
        _is(0, "allow", "eperm"),
        "allow",
        _ret(RET_ALLOW),
        "eperm",
        _ret(_RET_ERRNO | errno.EPERM),
        "eopnotsupp",
        _ret(_RET_ERRNO | errno.EOPNOTSUPP),
        "eafnosupport",
        _ret(_RET_ERRNO | errno.EAFNOSUPPORT),
    ]
    return _assemble(lines)
