"""Helpers for tests of backends whose engines run in processes of their own."""

import os
import time


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
