"""Test setup: 8 fake CPU devices (so sharding code really runs), one XLA compilation cache
for the session, and the agent-loop tests' memorised model as a session fixture (several
modules drive it; training it takes minutes)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

# Many tests build the same programs again: every `train` call jits its own step functions,
# and every `jarl train` or worker process a test starts compiles them from scratch. JAX's
# persistent cache (keyed by the program, its devices and JAX's version) serves a program
# compiled once to every later build of it, here and in those processes (they inherit the
# environment). A fresh folder each session, removed at its end.
_XLA_CACHE = tempfile.mkdtemp(prefix="jarl-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now, so that a later `request_cpu_devices` (`jarl train`, the demo) in a
# test cannot change the device count for the tests after it.
jax.devices()


import pytest  # noqa: E402


@pytest.fixture(scope="session", params=["chatml", "llama3", "qwen3"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    """A tiny model trained to reproduce scripted tool-calling conversations in one chat
    style, on the real engine (see tests/agent/test_loop.py); modules that need one style
    parametrize it indirectly."""
    from tests.agent.test_loop import STYLES, memorised

    assert request.param in STYLES
    return memorised(request.param, tmp_path_factory)
