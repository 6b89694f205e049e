"""The ``main`` every engine process runs (`jax_agent_rl.backends.worker.engine_main`): its
handshake, where its output goes, how it ends; and the vLLM engine's side stays off JAX (its
venv has none)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# an engine whose serve does what its config says; the stack to check is the second argument
ENGINE = """
import json
import sys

from jax_agent_rl.backends.worker import engine_main


def write(out, message):
    out.write(json.dumps(message).encode() + b"\\n")
    out.flush()


async def serve(config, channel):
    print("the engine's own chatter")
    if config["ready"]:
        channel.ready({"port": 1234})
    if config["fail"]:
        raise ValueError("no such checkpoint")


engine_main(serve, write, stack=sys.argv[2], name="Stack", setup="stack")
"""


def _run(tmp_path: Path, *, ready: bool, fail: bool, stack: str = "json") -> tuple[int, list, str]:
    """The engine's exit code, the messages on its original stdout, and its stderr."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    config = json.dumps({"ready": ready, "fail": fail})
    done = subprocess.run(
        [sys.executable, str(script), config, stack],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def test_an_engine_that_serves_sends_its_ready_handshake_and_nothing_else(tmp_path: Path) -> None:
    code, messages, log = _run(tmp_path, ready=True, fail=False)
    assert (code, messages) == (0, [{"port": 1234}])
    assert "the engine's own chatter" in log  # what the engine prints goes to its log


def test_a_start_failure_is_the_handshake_error_and_is_logged(tmp_path: Path) -> None:
    code, messages, log = _run(tmp_path, ready=False, fail=True)
    assert (code, messages) == (1, [{"error": "ValueError: no such checkpoint"}])
    assert "Traceback" in log
    assert "ValueError: no such checkpoint" in log


def test_a_failure_after_ready_is_logged_and_ends_the_process(tmp_path: Path) -> None:
    code, messages, log = _run(tmp_path, ready=True, fail=True)
    assert (code, messages) == (1, [{"port": 1234}])  # the backend sees the exit
    assert "ValueError: no such checkpoint" in log


def test_a_missing_stack_names_the_setup_that_builds_it(tmp_path: Path) -> None:
    code, messages, _ = _run(tmp_path, ready=True, fail=False, stack="jarl_no_such_stack")
    why = (
        f"Stack is not importable by {sys.executable} (No module named 'jarl_no_such_stack'); "
        "build its environment with `scripts/setup.sh stack`"
    )
    assert (code, messages) == (1, [{"error": why}])


@pytest.mark.parametrize("module", ["jarl_gpu_backend.worker", "jax_agent_rl.backends.worker"])
def test_the_engine_side_imports_no_jax(module: str) -> None:
    """The vLLM engine's interpreter has no JAX: its worker (gpu_backend/, the jarl-gpu-backend
    distribution), and what it imports of this package, must not import any. (Run here, where
    JAX is installed, so that an import of it would succeed and be seen.)"""
    code = (
        "import sys\n"
        f"import {module}\n"
        "jax = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
        "assert jax == [], jax\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gpu_backend")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
