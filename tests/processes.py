"""Helpers for tests of backends whose engines run in processes of their own."""

import os
import time
from pathlib import Path
from typing import Any

from jax_agent_rl.train.metrics import read_metrics
from jax_agent_rl.train.traces import read_traces


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


def trained_through_one_restart(run_dir: Path) -> list[dict[str, Any]]:
    """The train metrics of a 2-step run (2 prompts x 4 samples a step) whose engine died once
    in step 1's rollout, checked: the death, the restart and the requests sent again counted
    in step 1, nothing in step 2, every step trained all 8 episodes, none aborted, failed or
    left out, and step 1's traces (all 8: ``trainer.traces_per_step=8``) mark the requests
    sent again."""
    steps = read_metrics(run_dir / "metrics.jsonl", "train")
    assert len(steps) == 2
    first, second = steps
    assert first["rollout/replica_deaths"] == first["rollout/replica_restarts"] == 1
    assert first["rollout/requests_requeued"] >= 1
    assert second["rollout/replica_deaths"] == second["rollout/requests_requeued"] == 0
    for m in steps:
        assert m["batch/trajectories"] == 8  # 2 prompts x 4 samples: none lost
        assert m["stop/aborted"] == m["stop/agent_error"] == m["untrainable"] == 0.0
    # the trajectories whose requests were sent again say so in their traces
    marked = [t["resent_requests"] for t in read_traces(run_dir / "traces.jsonl", 1)]
    assert sum(marked) >= 1 and all(m >= 0 for m in marked)
    return steps
