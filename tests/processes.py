"""Helpers for tests of backends whose engines run in processes of their own."""

import os
import time
from pathlib import Path


def group_gone(pid: int, wait_s: float = 30.0) -> bool:
    """No process is left in the group ``pid`` led (the engine and its own children). Killed
    processes take a moment to be reaped, longer on a loaded machine: this waits for that
    state (up to ``wait_s``), it does not time anything."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def children() -> set[int]:
    """The process ids of this process's children, living or not yet reaped (Linux: read from
    ``/proc``, each process's parent being the fourth field of its ``stat``)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # (its name may hold spaces)
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found
