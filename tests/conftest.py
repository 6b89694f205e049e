"""Test setup: 8 fake CPU devices (so sharding code really runs), and the agent-loop tests'
memorised model as a session fixture (several modules drive it; its tokenizer is trained and
its engine compiled once per run)."""

import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax_agent_rl.cli.compile_cache import cpu_kind

# XLA's programs persist between the suite's processes (xdist workers, `jarl train` runs,
# multi-process runs, Ray actors: they inherit this environment), so the same program compiles
# once per suite rather than in every process. JAX keys an entry on the program, its compile
# options, the devices and jaxlib's version. Tests that count compilations count programs
# loaded from it too (tests/programs.py).
# No size bound for JAX to keep: with one, every write takes a file lock and reads the size and
# last use of every entry (0.25 s a write at 5,000 entries; the suite writes ~4,000): two test
# files writing 776 new entries into a full folder took 294 s with the bound, 90 s without.
# Without it, writes take no lock: a process that reads an entry while another writes it finds
# it truncated, which JAX reports as a warning and answers by compiling the program itself. The
# folder is kept under `_CACHE_KEEP` once a run, below.
# (a folder per CPU kind, as a run's own: `jax_agent_rl.cli.compile_cache`)
_CACHE = Path(__file__).parents[1] / ".cache" / f"xla-{cpu_kind()}"
_CACHE_KEEP = 4 << 30
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")


def _prune(folder: Path, keep: int) -> None:
    """The oldest files of ``folder`` (by last write) out until it holds at most ``keep``
    bytes."""
    files = []
    for f in folder.glob("*") if folder.is_dir() else ():
        try:
            files.append((f.stat().st_mtime, f.stat().st_size, f))
        except FileNotFoundError:  # removed meanwhile
            continue
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= keep:
            break
        f.unlink(missing_ok=True)
        total -= size


if not os.environ.get("PYTEST_XDIST_WORKER"):  # once a run: the main process, before workers
    _prune(_CACHE, _CACHE_KEEP)
# XLA:CPU's LLVM optimization is much of a program's compile time, and most of the suite's
# programs run a few times on tiny shapes: the suite compiles at LLVM O0
# (`jax_disable_most_optimizations`; the compilation cache keys on it), except in modules marked
# `compute_bound` (`pytestmark = pytest.mark.compute_bound`), whose programs run long enough
# for optimized code to pay. The `_optimization` fixture below sets it for each module, and
# in the environment the module's child processes inherit. JAX_DISABLE_MOST_OPTIMIZATIONS=0
# set for the run compiles everything at full optimization.
_FULL_OPTIMIZATION_ONLY = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") in ("0", "false")
# The device count is part of that key: a one-device program compiled where JAX has 8 CPU
# devices is not found where it has 1. Child processes that start JAX without asking for a
# count (Ray actors: the rollout replicas) get the tests' 8, so that a replica's engine loads
# what the tests' engines of its shape compiled (the Ray conformance tests: 217 s -> 144 s).
DEVICES = 8
os.environ["JAX_NUM_CPU_DEVICES"] = str(DEVICES)
# Ray starts its worker processes (the rollout replicas, the tool servers) at niceness 15 by
# default: beside the other test process's compilations they got almost no CPU, and a replica's
# engine compiled 5x slower than the same engine in the test's own process (the LoRA
# conformance suite's Ray backend: 298 s to start in a two-process run, 47 s alone). The tests'
# clusters (ray.init, ray.cluster_utils) inherit this and start them at the tests' own.
os.environ.setdefault("RAY_worker_niceness", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)
# Start the backend now, so that a later `request_cpu_devices` (`jarl train`, the demo) in a
# test cannot change the device count for the tests after it.
jax.devices()


import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402
from jax._src import compiler as _xla_compiler  # noqa: E402

# At O0, XLA:CPU's MLIR fusion emitters are most of what is left of a compile (an RL update
# of the test model: 22 s of XLA compilation with them, 9.7 s with the elemental emitters they
# replace; tests/rl/test_learner.py 444 -> 235 s). Optimized, the code they emit runs faster
# (a learning test took 13% more CPU without them), so modules marked `compute_bound` keep
# them. XLA reads XLA_FLAGS once per process: in this process each compile at O0 gets the
# option with its compile options (which the compilation cache keys on), and child processes
# of an O0 module get it in XLA_FLAGS (the `_optimization` fixture).
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}
_FAST_COMPILE_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items())
_get_compile_options = _xla_compiler.get_compile_options


def _compile_options(*args: Any, env_options_overrides: Any = None, **kwargs: Any) -> Any:
    if _xla_compiler._DISABLE_MOST_OPTIMIZATIONS.value:
        env_options_overrides = {**FAST_COMPILE, **(env_options_overrides or {})}
    return _get_compile_options(*args, env_options_overrides=env_options_overrides, **kwargs)


_xla_compiler.get_compile_options = _compile_options
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

T = TypeVar("T")


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """``make(folder)``'s result, made once per run: under pytest-xdist the first worker to
    ask makes it in a folder of the workers' shared base and pickles what it returns there;
    the others wait on the lock and read it (their tests then share that folder)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / name
    made = folder.with_suffix(".pkl")
    with FileLock(f"{made}.lock"):
        if not made.exists():
            folder.mkdir()
            made.write_bytes(pickle.dumps(make(folder)))
        result: T = pickle.loads(made.read_bytes())
    return result


@pytest.fixture(scope="session", params=["chatml", "llama3", "qwen3"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    """A tiny model trained to reproduce scripted tool-calling conversations in one chat
    style (committed weights), on the real engine (see tests/agent/test_loop.py); modules that
    need one style parametrize it indirectly."""
    from tests.agent.test_loop import STYLES, memorised, trained, with_engine

    assert request.param in STYLES
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return memorised(request.param, tmp_path_factory.mktemp(request.param))
    # Under pytest-xdist, the workers of one run share its base folder: the first worker to
    # need a style makes it and leaves it there; the others wait on the lock and load it.
    shared = tmp_path_factory.getbasetemp().parent / f"memorised-{request.param}.pkl"
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            made = trained(request.param, tmp_path_factory.mktemp(request.param))
            made["weights"] = jax.device_get(made["weights"])
            shared.write_bytes(pickle.dumps(made))
        made = pickle.loads(shared.read_bytes())
    return with_engine({**made, "weights": jax.device_put(made["weights"])})


@pytest.fixture(autouse=True, scope="module")
def _optimization(request: pytest.FixtureRequest) -> Iterator[None]:
    """This module's programs compiled at LLVM O0 unless it is marked `compute_bound` (above)."""
    fast_compile = not (_FULL_OPTIMIZATION_ONLY or request.node.get_closest_marker("compute_bound"))
    jax.config.update("jax_disable_most_optimizations", fast_compile)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = str(int(fast_compile))
    flags = f"{_XLA_FLAGS} {_FAST_COMPILE_FLAGS}" if fast_compile else _XLA_FLAGS
    os.environ["XLA_FLAGS"] = flags.strip()
    yield


@pytest.fixture(scope="module", params=["cgroup", "accounting"])
def sandbox_cgroup(request: pytest.FixtureRequest) -> bool:
    """Whether the python sandbox under test bounds memory with a cgroup per execution: a
    test taking this runs under both bounds, the cgroup (skipped, saying why, where none can
    be made) and the fork server's accounting, the fallback, which always runs."""
    from jax_agent_rl.tools.sandbox import MemoryCgroup, memory_cgroup

    if request.param == "accounting":
        return False
    found = memory_cgroup()
    if not isinstance(found, MemoryCgroup):
        pytest.skip(found)
    return True


SLOWEST_FILES = 40  # the suite's last lines: where its time goes, by test file
HEAVY_FILES = Path(__file__).with_name("heavy_files.txt")


def heavy_files() -> list[str]:
    """tests/heavy_files.txt's files, heaviest first."""
    lines = HEAVY_FILES.read_text().splitlines()
    return [line.split()[1] for line in lines if line.strip() and not line.startswith("#")]


def file_order(files: list[str], heavy: list[str]) -> list[str]:
    """The order workers take test files in: ``heavy`` ones first as listed, then the others
    by their number of tests, most first (xdist's own order), ``files`` repeating each file
    once per test."""
    count = {name: files.count(name) for name in dict.fromkeys(files)}
    rank = {name: i for i, name in enumerate(heavy)}
    return sorted(count, key=lambda name: (rank.get(name, len(rank)), -count[name]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (`file_order`; `make test` passes --no-loadscope-reorder so xdist
    keeps this order): the run ends when its last file does."""
    files = [item.nodeid.split("::")[0] for item in items]
    place = {name: i for i, name in enumerate(file_order(files, heavy_files()))}
    items.sort(key=lambda item: place[item.nodeid.split("::")[0]])  # stable within a file


@pytest.hookimpl(trylast=True)  # after the slowest tests, before the short summary
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The test files that took longest (setup, call and teardown of their tests), summed:
    under ``--dist loadfile`` a file is the unit a worker takes, so these bound the run."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                name = report.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + report.duration
    if not per_file:
        return
    terminalreporter.section(f"slowest {SLOWEST_FILES} test files")
    ranked = sorted(per_file.items(), key=lambda kv: -kv[1])
    for name, seconds in ranked[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f}s {name}")
    rest = ranked[SLOWEST_FILES:]
    terminalreporter.write_line(
        f"{sum(s for _, s in rest):8.1f}s the other {len(rest)} files; "
        f"{sum(per_file.values()):.1f}s in all test files"
    )
