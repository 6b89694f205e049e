"""Backends by name: the embedded engine is built in, vLLM comes through an entry point, and the
package keeps its shape: layers import only downward (nothing in jax_agent_rl outside
jax_agent_rl/backends/ imports the backends' homes), no import circles, the package's root holds
only packages and files.py; the vLLM engine's distribution (gpu_backend/) shares only the wire
and the engine main with it."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jax_agent_rl.config import EngineSection, JarlConfig, VLLMSection, check_ranges
from jax_agent_rl.models import DecoderPolicy
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import BackendFactory, backend_names, register_backend
from jax_agent_rl.rollout.registry import backend_factory
from jax_agent_rl.train.check import check_names

PACKAGE = Path(__file__).resolve().parents[2] / "jax_agent_rl"
# the jarl-gpu-backend distribution: the vLLM engine process, run under the vLLM venv
GPU_BACKEND = PACKAGE.parent / "gpu_backend" / "jarl_gpu_backend"
# what the engine process imports of this package (standard library and numpy only)
# what both sides of the pipe share: the worker's loop, the /dev/shm wire, the CUDA IPC wire
# (standard library at import, torch inside its functions)
SHARED_WITH_THE_ENGINE = {
    "jax_agent_rl.backends.worker",
    "jax_agent_rl.backends.vllm.wire",
    "jax_agent_rl.backends.vllm.cuda_ipc",
}

# The layers, low to high: a module imports only from its own package or a lower tier. The
# one module at the root, files.py, counts as a package of its own.
TIERS = [
    # the rollout protocol (requests, results, what a backend declares): the engine and every
    # backend build on it, and it on nothing of ours
    ["protocol"],
    ["console", "files"],
    ["models", "tokenization"],
    ["config"],
    # running user code (its loader, its thread and process pools, the skyrl env's process):
    # neither JAX nor envs, which a call's worker process and an env's process never import
    ["usercode"],
    ["engine", "cluster"],
    # the learner: it reads sampled sequences (`rl.sequence`), never the agent or its tools
    ["rl"],
    ["rollout"],
    ["data"],
    ["rewards"],
    ["tools"],
    ["envs"],
    ["agent"],
    ["train"],
    ["plan"],
    ["view"],
    ["cli"],
    ["backends"],
    ["compat"],
]
TIER = {package: rank for rank, packages in enumerate(TIERS) for package in packages}
# The external backends' homes sit on top and register through entry points: nothing outside
# them imports them.
BACKENDS = "jax_agent_rl.backends"
# The wings (compatibility with other frameworks) sit on top too: the core loads one by name
# (jax_agent_rl/config/wings.py) and it registers hooks; no module outside it imports it.
WINGS = "jax_agent_rl.compat"


def _module_name(path: Path) -> str:
    parts = ("jax_agent_rl", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_modules(path: Path, module: str | None = None) -> set[str]:
    """Every module `path` (module ``module``, by default its name in the package) imports, at
    the top or inside a function: `from a.b import c` is module `a.b.c` when that is one of
    ours, else `a.b`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def _import_graph() -> dict[str, set[str]]:
    return {
        module: {name for name in _imported_modules(path) if name in MODULES and name != module}
        for module, path in MODULES.items()
    }


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_import_circle_between_modules() -> None:
    cycles = _cycles(_import_graph())
    assert cycles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_root_holds_only_packages_and_the_file_checks() -> None:
    """Each module sits in the package of its concept; files.py stays at the root (its
    docstring says why: the lowest packages read through it)."""
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "files.py"], loose


def test_user_code_runs_in_processes_that_never_import_jax() -> None:
    """A reward's worker process and a skyrl-gym environment's process import `usercode` alone:
    nothing it reaches, at the top of a module or inside a function, imports JAX or Flax."""
    graph = _import_graph()
    reached = {m for m in MODULES if _package(m) == "usercode"}
    todo = list(reached)
    while todo:
        for name in graph[todo.pop()] - reached:
            reached.add(name)
            todo.append(name)
    heavy = sorted(
        f"{module} imports {name}"
        for module in reached
        for name in _imported_modules(MODULES[module])
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax")
    )
    assert "jax_agent_rl.usercode.env_process" in reached and heavy == [], heavy


def test_every_package_has_a_tier() -> None:
    untiered = sorted({_package(m) for m in MODULES if _package(m) and _package(m) not in TIER})
    assert untiered == [], f"packages missing from TIERS: {untiered}"


def test_no_module_imports_from_a_package_above_it() -> None:
    upward = []
    for module, imported in sorted(_import_graph().items()):
        here = _package(module)
        for name in sorted(imported):
            there = _package(name)
            if here in TIER and there in TIER and TIER[there] > TIER[here]:
                upward.append(f"{module} imports {name} ({here} sits below {there})")
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def test_the_learner_sits_below_the_agent_and_its_tools() -> None:
    """`rl/` builds its rows from sampled sequences alone: an import of the agent loop or its
    tools from there is an upward import (`test_no_module_imports_from_a_package_above_it`)."""
    assert TIER["rl"] < min(TIER["agent"], TIER["tools"], TIER["rollout"])
    reached = {
        _package(name)
        for module, imported in _import_graph().items()
        if _package(module) == "rl"
        for name in imported
    }
    assert reached.isdisjoint({"agent", "tools", "tokenization", "rollout"}), reached


def _in_backends(module: str) -> bool:
    return module == BACKENDS or module.startswith(f"{BACKENDS}.")


def test_nothing_imports_the_external_backend_homes() -> None:
    imports = [
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if not _in_backends(module)
        for name in sorted(_imported_modules(path))
        if _in_backends(name)
    ]
    assert imports == [], "imports of the backends' homes:\n" + "\n".join(imports)


def test_nothing_outside_a_wing_imports_it() -> None:
    """The agent loop, the train step and every other core module reach verl's compatibility
    only through the hooks its wing registers; only the wing names its modules."""
    assert any(module.startswith(f"{WINGS}.verl.") for module in MODULES)
    imports = [
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if not module.startswith(f"{WINGS}.") and module != WINGS
        for name in sorted(_imported_modules(path))
        if name == WINGS or name.startswith(f"{WINGS}.")
    ]
    assert imports == [], "imports of the wings:\n" + "\n".join(imports)


def test_the_wings_module_names_every_wing_that_exists() -> None:
    """`jax_agent_rl.config.wings` imports the wings by name: each name it holds is a module
    here."""
    from jax_agent_rl.config import wings

    assert set(wings.WINGS.values()) | set(wings.SHIMS) <= set(MODULES)


def test_the_engine_distribution_shares_only_the_wire_and_the_engine_main() -> None:
    """gpu_backend/ runs under the vLLM venv with this repository on its path: of this package
    it imports only what both sides of the pipe share; and this package never imports it (the
    backend runs it as ``python -m``)."""
    assert sorted(GPU_BACKEND.glob("*.py")), f"no modules under {GPU_BACKEND}"
    reached = set()
    for path in sorted(GPU_BACKEND.rglob("*.py")):
        module = ".".join(
            ("jarl_gpu_backend", *path.relative_to(GPU_BACKEND).with_suffix("").parts)
        )
        imported = _imported_modules(path, module.removesuffix(".__init__"))
        reached |= {name for name in imported if name.split(".")[0] == "jax_agent_rl"}
    assert reached == SHARED_WITH_THE_ENGINE
    into = sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        for name in _imported_modules(path)
        if name.split(".")[0] == "jarl_gpu_backend"
    )
    assert into == []


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
        "homes = ('jax_agent_rl.backends', 'grpc', 'jetstream')\n"
        "assert not any(m.startswith(homes) for m in sys.modules)\n"
        "assert 'jax_agent_rl.backends.jetstream.client' not in sys.modules\n"
        "from jax_agent_rl.backends.vllm.backend import FACTORY\n"
        "assert backend_factory('vllm') is FACTORY\n"
        "from jax_agent_rl.backends.jetstream.client import FACTORY as JETSTREAM\n"
        "assert backend_factory('jetstream') is JETSTREAM\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_backend_names_the_registered_ones() -> None:
    cfg = JarlConfig(engine=EngineSection(backend="vlm"))
    assert check_names(cfg) == [f"engine.backend='vlm': expected one of {backend_names()}"]
    with pytest.raises(ValueError, match=r"engine.backend='vlm' is not a registered backend"):
        backend_factory("vlm")


def test_a_registered_backend_is_checked_and_names_are_not_taken_twice() -> None:
    def check(engine: EngineSection, processes: int) -> list[str]:
        del processes
        replicas = engine.vllm.replicas
        return [] if replicas == 1 else [f"engine.vllm.replicas={replicas}: one only"]

    def build(spec: object) -> object:
        del spec
        raise AssertionError("not built in this test")

    factory = BackendFactory(build=build, check=check)  # type: ignore[arg-type]
    register_backend("single_replica_test", factory)
    assert "single_replica_test" in backend_names()
    assert backend_factory("single_replica_test") is factory
    engine = dataclasses.replace(
        EngineSection(), backend="single_replica_test", vllm=VLLMSection(replicas=2)
    )
    cfg = JarlConfig(engine=engine)
    assert check_ranges(cfg) == check_names(cfg) == []
    problems = backend_factory(engine.backend).check(engine, 1)
    assert problems == ["engine.vllm.replicas=2: one only"]
    for taken in ("embedded", "vllm", "single_replica_test"):
        with pytest.raises(ValueError, match="registered already"):
            register_backend(taken, factory)


def test_a_backend_that_does_not_declare_lora_is_refused_for_a_lora_run(tmp_path: Path) -> None:
    """A run whose policy carries LoRA adapters needs a backend declaring `Capabilities.lora`
    (it will be pushed the adapters alone): here the embedded engine serving the checkpoint's
    base model whatever the run's (as a factory ignoring the run's model would) does not."""
    import asyncio

    import jax

    from jax_agent_rl.engine import Engine
    from jax_agent_rl.models import Lora, load_hf
    from jax_agent_rl.models.adapters import add_lora
    from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
    from jax_agent_rl.rollout import EmbeddedBackend
    from jax_agent_rl.rollout.registry import BackendBuild, lora_problem

    base_cfg, base = load_hf(
        write_hf_checkpoint(tmp_path / "tiny", TINY_QWEN2), sharder=one_device_sharder()
    )
    cfg, w = add_lora(jax.random.key(0), base_cfg, base, Lora(4, 8.0))
    spec = BackendBuild(
        EngineSection(),
        DecoderPolicy(cfg),
        w,
        checkpoint=tmp_path / "tiny",
        dtype="float32",
        sharder=one_device_sharder(),
    )
    served = EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=2, max_len=64, sharder=one_device_sharder()), w
    )
    base_only = EmbeddedBackend(
        Engine(base_cfg, max_concurrent_decodes=2, max_len=64, sharder=one_device_sharder()), base
    )
    try:
        assert served.capabilities.lora and lora_problem(spec, served) is None
        assert not base_only.capabilities.lora
        assert lora_problem(spec, base_only) == (
            "model.lora: engine.backend=embedded does not serve LoRA adapters (its "
            "capabilities.lora is false): use a backend that does (embedded, vllm, jetstream) "
            "or model.lora.rank=0"
        )
    finally:
        for backend in (served, base_only):
            asyncio.run(backend.close())


def test_engine_warmup_false_compiles_each_program_when_first_needed(tmp_path: Path) -> None:
    """``engine.warmup`` (default true) compiles every serving program as the backend starts;
    false compiles none then, and the first request compiles what it needs: the same tokens."""
    import asyncio

    from jax_agent_rl.models import load_hf
    from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
    from jax_agent_rl.rollout import GenerateRequest, SamplingParams
    from jax_agent_rl.rollout.registry import BackendBuild
    from tests.programs import programs_built

    cfg, w = load_hf(
        write_hf_checkpoint(tmp_path / "tiny", TINY_QWEN2), sharder=one_device_sharder()
    )
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=6, temperature=0.0))
    tokens, reported = {}, {}
    for warmup in (True, False):
        heard: list[tuple[int, int]] = []
        spec = BackendBuild(
            EngineSection(max_model_len=64, max_concurrent=2, warmup=warmup),
            DecoderPolicy(cfg),
            w,
            checkpoint=tmp_path / "tiny",
            dtype="float32",
            sharder=one_device_sharder(),
            on_program=lambda done, total, heard=heard: heard.append((done, total)),
        )
        with programs_built() as built:
            backend = backend_factory("embedded").build(spec)
        try:
            reported[warmup] = (len(heard), len(built))
            tokens[warmup] = asyncio.run(backend.generate(request)).token_ids
        finally:
            asyncio.run(backend.close())
    (heard_warm, built_warm), (heard_lazy, built_lazy) = reported[True], reported[False]
    assert heard_warm >= 4 and heard_lazy == 0  # prefill buckets, decode buckets, insert...
    assert built_warm - built_lazy >= heard_warm  # (both build the empty decode state's)
    assert tokens[False] == tokens[True] and len(tokens[True]) == 6
