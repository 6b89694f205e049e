"""The jarl-gpu-backend distribution (gpu_backend/): what it declares agrees with the lock that
`scripts/setup.sh vllm` installs, and the vLLM venv holds that lock and this checkout's
distribution (a venv behind the repository fails here, naming the setup that fixes it)."""

import json
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
GPU_BACKEND = ROOT / "gpu_backend"
PROJECT = tomllib.loads((GPU_BACKEND / "pyproject.toml").read_text())["project"]
LOCK_FILE = GPU_BACKEND / "vllm-cpu-lock.txt"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _lock() -> dict[str, Version]:
    """The lock's pins, by canonical name; every line is one ``name==version``."""
    pins = {}
    for line in LOCK_FILE.read_text().split():
        name, _, version = line.partition("==")
        assert version, f"{LOCK_FILE.name}: {line!r} is not an exact pin"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _declared() -> list[Requirement]:
    """Everything the distribution asks for, its dependencies and every extra's, as its
    installed metadata states them (an extra's carry its marker)."""
    extras = PROJECT["optional-dependencies"].items()
    tagged = [f'{r}; extra == "{name}"' for name, rs in extras for r in rs]
    return [Requirement(r) for r in [*PROJECT["dependencies"], *tagged]]


def test_every_declared_requirement_is_locked_at_a_version_it_accepts() -> None:
    lock = _lock()
    for requirement in _declared():
        locked = lock.get(canonicalize_name(requirement.name))
        assert locked is not None, f"{requirement} is not in {LOCK_FILE.name}"
        assert requirement.specifier.contains(locked), f"{requirement}: the lock has {locked}"
    assert {canonicalize_name(r.name) for r in _declared()} >= {"vllm-cpu", "numpy"}


def test_the_vllm_venv_holds_the_lock_and_this_checkout_s_distribution() -> None:
    assert VLLM_PYTHON.is_file(), f"no {VLLM_PYTHON}: run `scripts/setup.sh vllm`"
    names = sorted(_lock())
    probe = (
        "import importlib.metadata as m, json, sys, jarl_gpu_backend\n"
        "d = m.distribution('jarl-gpu-backend')\n"
        "print(json.dumps({'version': d.version, 'requires': d.requires,\n"
        "    'file': jarl_gpu_backend.__file__,\n"
        "    'installed': {n: m.version(n) for n in json.loads(sys.argv[1])}}))\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-I", "-c", probe, json.dumps(names)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, f"{done.stderr}\n(run `scripts/setup.sh vllm`)"
    found = json.loads(done.stdout)
    assert found["version"] == PROJECT["version"]
    assert sorted(found["requires"]) == sorted(map(str, _declared()))
    assert Path(found["file"]) == GPU_BACKEND / "jarl_gpu_backend" / "__init__.py"  # editable
    lock = _lock()
    # the local part of a version is the build's (torch 2.13.0+cpu for the pin torch==2.13.0)
    drift = {
        name: version
        for name, version in found["installed"].items()
        if Version(Version(version).public) != lock[name]
    }
    assert drift == {}, f"installed against {LOCK_FILE.name}: {drift}"
