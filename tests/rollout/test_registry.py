"""Backends by name: the embedded engine is built in, vLLM comes through an entry point, and the
layers import only downward (nothing in jax_agent_rl imports gpu_backend; engine/ imports nothing
from rollout/)."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jax_agent_rl.config import JarlConfig, RolloutSection, check_ranges
from jax_agent_rl.rollout import BackendFactory, backend_names, register_backend
from jax_agent_rl.rollout.registry import backend_factory
from jax_agent_rl.train.check import check_names

PACKAGE = Path(__file__).resolve().parents[2] / "jax_agent_rl"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_module_imports_upward() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _imported_modules(path):
            if name.split(".")[0] == "gpu_backend":
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if "engine" in path.parts and name.startswith("jax_agent_rl.rollout"):
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert upward == []


def test_training_classes_stay_small() -> None:
    """The run is assembled by functions (build / step / loop / hooks), not grown in a class."""
    big = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > 200:
                big.append(f"{path.name}: {node.name} has {lines} lines")
    assert big == []


def test_backends_are_found_through_their_entry_points_and_loaded_only_when_asked() -> None:
    code = (
        "import sys\n"
        "from jax_agent_rl.rollout import backend_names\n"
        "from jax_agent_rl.rollout.registry import backend_factory\n"
        "assert backend_names() == ['embedded', 'jetstream', 'vllm'], backend_names()\n"
        "backend_factory('embedded')\n"
        "assert not any(m.startswith(('gpu_backend', 'grpc', 'jetstream')) for m in sys.modules)\n"
        "assert 'jax_agent_rl.rollout.jetstream' not in sys.modules\n"
        "from gpu_backend.backend import FACTORY\n"
        "assert backend_factory('vllm') is FACTORY\n"
        "from jax_agent_rl.rollout.jetstream import FACTORY as JETSTREAM\n"
        "assert backend_factory('jetstream') is JETSTREAM\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_backend_names_the_registered_ones() -> None:
    cfg = JarlConfig(rollout=RolloutSection(backend="vlm"))
    assert check_names(cfg) == [f"rollout.backend='vlm': expected one of {backend_names()}"]
    with pytest.raises(ValueError, match=r"rollout.backend='vlm' is not a registered backend"):
        backend_factory("vlm")


def test_a_registered_backend_is_checked_and_names_are_not_taken_twice() -> None:
    def check(rollout: RolloutSection) -> list[str]:
        return [] if rollout.replicas == 1 else [f"rollout.replicas={rollout.replicas}: one only"]

    def build(spec: object) -> object:
        del spec
        raise AssertionError("not built in this test")

    factory = BackendFactory(build=build, check=check)  # type: ignore[arg-type]
    register_backend("single_replica_test", factory)
    assert "single_replica_test" in backend_names()
    assert backend_factory("single_replica_test") is factory
    rollout = dataclasses.replace(RolloutSection(), backend="single_replica_test", replicas=2)
    cfg = JarlConfig(rollout=rollout)
    assert check_ranges(cfg) == check_names(cfg) == []
    assert backend_factory(rollout.backend).check(rollout) == ["rollout.replicas=2: one only"]
    for taken in ("embedded", "vllm", "single_replica_test"):
        with pytest.raises(ValueError, match="registered already"):
            register_backend(taken, factory)
