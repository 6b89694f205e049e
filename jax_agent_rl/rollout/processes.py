"""What backends whose engines run in processes of their own share (vLLM in `gpu_backend`,
JetStream in `jax_agent_rl.rollout.jetstream`): their interpreter check, their logs' root
causes, and stopping a whole process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception): .*")


def log_exceptions(log: Path, last: int = 6) -> str:
    """The distinct exception lines of an engine's log, indented, the last ``last`` of them:
    where the root cause of a failure is (an engine's final exception often only says to look
    above)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    lines = [m.group(0) for m in _EXCEPTION_LINE.finditer(text)]
    return "\n".join(f"  {line}" for line in list(dict.fromkeys(lines))[-last:])


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the process group ``proc`` leads (its own children included); waits for it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def interpreter_problems(key: str, given: str, default: Path, what: str, setup: str) -> list[str]:
    """The pre-run check of a backend's interpreter setting ``rollout.<key>`` (empty: the
    repo's ``default``): one line naming the key when that file is missing."""
    if Path(given or default).is_file():
        return []
    shown = repr(given) if given else f"'' (the default, {default})"
    return [
        f"rollout.{key}={shown} does not exist: expected the python of a venv with {what} "
        f"(scripts/setup.sh {setup} makes {default.parent.parent.name})"
    ]
