"""What backends whose engines run in processes of their own share (vLLM's, JetStream's):
`EngineProcess` (the engine started under its venv's interpreter in a process group of its
own, its ready handshake, a watcher thread, its log's root causes, killing the group) and the
pre-run check of the interpreter setting."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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
        f"engine.{key}={shown} does not exist: expected the python of a venv with {what} "
        f"(scripts/setup.sh {setup} makes {default.parent.parent.name})"
    ]


Messages = Callable[[IO[bytes]], Iterator[dict[str, Any]]]


class EngineProcess:
    """``python -m module CONFIG_JSON`` (``root`` on its path, ``env`` added to this
        process's), in a process group of its own, its stderr in ``log``. A watcher thread reads
        what the engine writes to its stdout, as ``messages`` parses it: the first message is the
        ready handshake (`wait_ready`; one with an ``error`` key says why it could not start),
        each later one goes to ``on_message``; once the process has exited, ``on_exit(its exit
    code)``."""

    def __init__(
        self,
        name: str,
        python: Path,
        module: str,
        config: dict[str, Any],
        *,
        root: Path,
        log: Path,
        env: dict[str, str],
        messages: Messages,
        on_exit: Callable[[int], None],
        on_message: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.name, self.log = name, log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [str(python), "-m", module, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, **env, "PYTHONPATH": str(root)},
                start_new_session=True,  # its own process group: `kill` reaps its children too
            )
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._messages, self._on_message, self._on_exit = messages, on_message, on_exit
        thread = name.lower().replace(" ", "-")
        self.watcher = threading.Thread(target=self._watch, name=thread, daemon=True)
        self.watcher.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        for message in self._messages(self.proc.stdout):
            if self.ready.done():
                assert self._on_message is not None, f"the {self.name} said more than it is heard"
                self._on_message(message)
            else:
                self.ready.set_result(message)
        code = self.proc.wait()
        if not self.ready.done():
            self.ready.set_result({"error": f"the {self.name} exited (exit code {code})"})
        self._on_exit(code)

    def wait_ready(self, timeout_s: float, error: type[Exception]) -> dict[str, Any]:
        """The engine's ready message; raises ``error`` naming why it did not start and the
        root causes in its log (the process is killed and its watcher done)."""
        try:
            ready = self.ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            ready = {"error": f"the {self.name} did not start within {timeout_s:.0f} s"}
        if "error" in ready:
            self.kill()
            self.watcher.join()  # the log is complete once the engine's pipe has closed
            raise error(f"{ready['error']}\nits log, {self.log}, says:\n{self.log_errors()}")
        return ready

    def log_errors(self) -> str:
        """The exception lines of its log, where an engine's root cause of a failure is."""
        return log_exceptions(self.log)

    def kill(self) -> None:
        """SIGKILL to the whole process group (the engine's own children included)."""
        kill_group(self.proc)

    def stop(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the engine to exit (it was asked to), then kills
        whatever is left of its group and waits for the watcher."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        self.kill()
        self.watcher.join()
