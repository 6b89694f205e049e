"""The vLLM backend's view of one engine process: its pipe, the calls waiting on it; and
whether an interpreter can run one."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from jax_agent_rl.backends.vllm import wire
from jax_agent_rl.protocol import GenerateRequest
from jax_agent_rl.rollout.processes import EngineProcess

# The engine process's code: the jarl-gpu-backend distribution (gpu_backend/ in the
# repository), installed into the vLLM venv, not part of this package
WORKER = "jarl_gpu_backend.worker"


LOOKUP_S = 60.0  # for the interpreter to start and look a module up (a loaded machine's)


def interpreter_problem(python: Path) -> str | None:
    """Why ``python`` cannot run an engine process, or None: it is missing, or the
    distribution that holds `WORKER` is not installed in its environment. (Whether vLLM
    itself imports is the engine's first check, its handshake: an import of vLLM takes
    seconds, a look-up of the distribution a fraction of one.)"""
    if not python.is_file():
        return f"no vLLM interpreter at {python}"
    package = WORKER.partition(".")[0]
    find = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        found = subprocess.run([str(python), "-I", "-c", find], check=False, timeout=LOOKUP_S)
    except subprocess.TimeoutExpired:
        return f"the vLLM interpreter {python} did not answer within {LOOKUP_S:g}s (hung)"
    if found.returncode:
        return f"the vLLM interpreter {python} has no jarl-gpu-backend ({package}) installed"
    return None


@dataclasses.dataclass
class Call:
    """A caller awaiting an engine: its future, its loop, and (generate) what it asked."""

    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    request: GenerateRequest | None = None
    version: int = 0
    resent: int = 0  # times sent again, to its engine started again


def _messages(out: IO[bytes]) -> Iterator[dict[str, Any]]:
    """An engine's messages; a start failure is the handshake's ``error``."""
    while (message := wire.read_message(out)) is not None:  # type: ignore[arg-type]
        if "error" in message:
            message = {"error": f"vLLM engine failed: {message['error']}"}
        yield message


class Engine:
    """One engine process (`EngineProcess`): its pipe and what is in flight on it."""

    def __init__(
        self,
        index: int,
        python: Path,
        config: dict[str, Any],
        env: dict[str, str],
        log: Path,
        root: Path,
        on_message: Callable[[Engine, dict[str, Any]], None],
        on_exit: Callable[[Engine, int], None],
    ) -> None:
        self.index = index
        self.settings: dict[str, Any] = {}  # the engine's ``ready``: its args as vLLM took them
        self.calls: dict[str, Call] = {}
        self.load: Call | None = None
        self.digest: Call | None = None  # a `weights_digest` waiting on it
        self.dead: str | None = None  # why its process exited, once it has
        self.restarts = 0  # engines that ran at this index before it
        self.paused = False
        self._write_lock = threading.Lock()
        self.process = EngineProcess(
            f"vLLM engine {index}",
            python,
            WORKER,
            config,
            root=root,
            log=log,
            # spawn, not fork: vLLM's children must not inherit this pipe's write end, or the
            # engine's death would not end the stream
            env={**env, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
            messages=_messages,
            on_message=lambda m: on_message(self, m),
            on_exit=lambda code: on_exit(self, code),
        )

    def send(self, message: dict[str, Any]) -> bool:
        """Whether the message went out (False: the engine is gone)."""
        stdin = self.process.proc.stdin
        assert stdin is not None
        try:
            with self._write_lock:
                wire.write_message(stdin, message)  # type: ignore[arg-type]
        except (BrokenPipeError, ValueError):
            return False
        return True
