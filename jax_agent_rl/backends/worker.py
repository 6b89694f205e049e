"""The engine side of a backend whose engine runs in a process of its own: the ``main`` every
such process runs (vLLM's ``jarl_gpu_backend.worker``, in ``gpu_backend/``, JetStream's
`jax_agent_rl.backends.jetstream.server`). Its counterpart in the trainer's process is
`jax_agent_rl.rollout.processes.EngineProcess`, which starts ``python -m MODULE CONFIG_JSON``
under the backend's venv and reads the process's stdout.

`engine_main` keeps the process's original stdout as the `Channel` to the backend (everything
else printed, the engine's own logging included, goes to stderr, the engine's log), reads the
config from the command line, checks that the engine's stack imports, and runs the backend's
``serve(config, channel)`` until it returns. The first message on the channel is the
handshake: what ``serve`` sends with `Channel.ready` once its engine serves, or
``{"error": why}`` when it could not start (the stack does not import, or ``serve`` raised
before ``ready``). A failure after ``ready`` is logged and ends the process (exit code 1),
which the backend sees.

Standard library only: it runs under every backend's interpreter (the vLLM venv has no JAX).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, BinaryIO

Write = Callable[[BinaryIO, dict[str, Any]], None]


class Channel:
    """The engine's messages to its backend, on the process's original stdout, each written by
    the backend's framing ``write``."""

    def __init__(self, out: BinaryIO, write: Write) -> None:
        self.out = out
        self._write = write
        self.handshaken = False

    def send(self, message: dict[str, Any]) -> None:
        self._write(self.out, message)

    def ready(self, message: dict[str, Any]) -> None:
        """The handshake: the engine serves (``message`` says what the backend needs of it)."""
        self.send(message)
        self.handshaken = True

    def failed(self, why: str) -> None:
        """The handshake: the engine could not start, and ``why``."""
        self.send({"error": why})
        self.handshaken = True


Serve = Callable[[dict[str, Any], Channel], Coroutine[Any, Any, None]]


def engine_main(serve: Serve, write: Write, *, stack: str, name: str, setup: str) -> None:
    """Runs ``serve`` as this process's engine (see the module docstring). ``stack`` is the
    module whose import shows the venv holds the engine's stack, ``name`` the stack's name in
    messages, ``setup`` the `scripts/setup.sh` target that builds its venv."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    channel = Channel(out, write)
    config = json.loads(sys.argv[1])
    try:
        importlib.import_module(stack)
    except ImportError as e:
        channel.failed(
            f"{name} is not importable by {sys.executable} ({e}); "
            f"build its environment with `scripts/setup.sh {setup}`"
        )
        sys.exit(1)
    try:
        asyncio.run(serve(config, channel))
    except Exception as e:
        logging.exception("the %s engine failed", name)
        if not channel.handshaken:
            channel.failed(f"{type(e).__name__}: {e}")
        sys.exit(1)
