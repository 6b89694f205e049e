"""The sandbox's seccomp filter: a classic-BPF program, assembled here, that bubblewrap loads
into every process of a sandbox (``bwrap --seccomp FD``) before the fork server starts.

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
- kernel surface a sandboxed interpreter never needs: mounts, keyrings, BPF,
  ``perf_event_open``, ``userfaultfd``, ``io_uring``, module loading, ``kexec``, clock and
  host-name setters, handles by inode, ``syslog``.

Everything else is allowed. A system call of another ABI (i386 or x32 on an x86-64 kernel)
kills the process. Tables exist for x86-64 and aarch64; on another machine `filter_program`
raises rather than run unfiltered. The numbers are checked against the kernel headers by
``tests/hostile/test_sandbox_escapes.py``.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NAMESPACE_FLAGS |= 0x20000000 | 0x40000000

DENIED = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # namespaces and mounts (clone's namespace flags are checked separately)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # IPC objects that outlive their creator; memory files no mount's usage shows
    "shmget", "semget", "msgget", "mq_open", "memfd_create", "memfd_secret",
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
            "unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "mount": 165,
            "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
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
            "memfd_secret": 447,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
            "unshare": 97, "setns": 268, "clone": 220, "clone3": 435, "mount": 40,
            "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
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
        },
    ),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One ``struct sock_filter`` {u16 code; u8 jt; u8 jf; u32 k} in the machine's byte order."""
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one), as the bytes ``bwrap --seccomp`` reads."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise RuntimeError(
            f"no seccomp syscall table for {machine!r} (have {sorted(SYSCALLS)}); the sandbox "
            "refuses to run without its filter"
        )
    arch, table = SYSCALLS[machine]
    denied = [table[name] for name in DENIED if name in table]
    # Layout: arch check, load nr, [x32 check], one JEQ per denied nr, clone, clone3, ALLOW,
    # then the shared targets EPERM, ENOSYS and the clone-flags block.
    head = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ_K, arch, jt=1),
        _insn(_RET_K, RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _NR),
    ]
    x32 = machine == "x86_64"
    n_checks = len(denied) + 2 + (1 if x32 else 0)
    # offsets below count from the instruction after each jump
    allow_at = n_checks  # index (within the checks block) of RET ALLOW
    eperm_at, enosys_at, clone_block_at = allow_at + 1, allow_at + 2, allow_at + 3
    checks: list[bytes] = []
    if x32:
        checks.append(_insn(_JGE_K, _X32_SYSCALL_BIT, jt=eperm_at - 1))
    for nr in denied:
        checks.append(_insn(_JEQ_K, nr, jt=eperm_at - len(checks) - 1))
    checks.append(_insn(_JEQ_K, table["clone"], jt=clone_block_at - len(checks) - 1))
    checks.append(_insn(_JEQ_K, table["clone3"], jt=enosys_at - len(checks) - 1))
    tail = [
        _insn(_RET_K, RET_ALLOW),
        _insn(_RET_K, _RET_ERRNO | errno.EPERM),
        _insn(_RET_K, _RET_ERRNO | errno.ENOSYS),
        # clone: deny when any namespace flag is set in the low word of args[0]
        _insn(_LD_W_ABS, _ARG0_LOW),
        _insn(_AND_K, CLONE_NAMESPACE_FLAGS),
        _insn(_JEQ_K, 0, jt=0, jf=1),
        _insn(_RET_K, RET_ALLOW),
        _insn(_RET_K, _RET_ERRNO | errno.EPERM),
    ]
    if clone_block_at > 255:  # the farthest jump; classic BPF offsets are 8 bits
        raise AssertionError("the seccomp deny list is too long for 8-bit jump offsets")
    return b"".join(head + checks + tail)
