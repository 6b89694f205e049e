"""Test setup: 8 fake CPU devices (so sharding code really runs), and the agent-loop tests'
memorised model as a session fixture (several modules drive it; training it takes minutes)."""

import os
import pickle

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now, so that a later `request_cpu_devices` (`jarl train`, the demo) in a
# test cannot change the device count for the tests after it.
jax.devices()


import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402


@pytest.fixture(scope="session", params=["chatml", "llama3", "qwen3"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    """A tiny model trained to reproduce scripted tool-calling conversations in one chat
    style, on the real engine (see tests/agent/test_loop.py); modules that need one style
    parametrize it indirectly."""
    from tests.agent.test_loop import STYLES, memorised, trained, with_engine

    assert request.param in STYLES
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return memorised(request.param, tmp_path_factory)
    # Under pytest-xdist, the workers of one run share its base folder: the first worker to
    # need a style trains it and leaves it there; the others wait on the lock and load it.
    shared = tmp_path_factory.getbasetemp().parent / f"memorised-{request.param}.pkl"
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            made = trained(request.param, tmp_path_factory)
            made["weights"] = jax.device_get(made["weights"])
            shared.write_bytes(pickle.dumps(made))
        made = pickle.loads(shared.read_bytes())
    return with_engine({**made, "weights": jax.device_put(made["weights"])})
