"""The python sandbox's CPU bound against the processes an execution starts: children of a
process ignoring SIGCHLD are reaped by the kernel, their CPU time counted nowhere, so an
execution forking children in turn used CPU past ``cpu_s`` until its wall-clock timeout (up to
``processes`` cores for all of it)."""

from __future__ import annotations

import asyncio

from jax_agent_rl.tools.sandbox import Limits, PythonSandbox

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
