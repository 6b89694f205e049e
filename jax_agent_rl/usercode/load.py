"""User code a config names: functions (and classes), ``package.module:function`` or
``path/to/file.py:function`` (a reward, ``data.reward``; a LangGraph graph, ``agent.graph``; an
environment, ``env.classes``), and modules imported for what they do when imported
(``env.imports``: a module that registers skyrl-gym environments).

A file's folder is put on ``sys.path`` (at its end, so it shadows nothing) before the file
runs, as running the file would put it first: the file imports its neighbours as it would then
(``from count_letter_env import CountLetterEnv``), and so does a skyrl-gym entry point it
registers by name (``"count_letter_env:CountLetterEnv"``), made later. The working directory is
importable too, as under ``python -m``, for the modules named by their import path.

User code written for verl imports ``verl.*`` (a tool's ``BaseTool``, an interaction's base, a
reward's ``verl.utils.reward_score`` helpers): every import here first turns on the `verl` shim
(`jax_agent_rl.compat.verl.shim`; a real verl on ``sys.path`` still wins), so the shim exists
only in a run that loads user code, never merely by importing jax_agent_rl or starting the
environment's Python. A ``verl`` folder in the working directory that is not verl would
shadow both: it is refused in one line naming it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.config.wings import install_shims


def working_directory_importable() -> None:
    """Puts the working directory on ``sys.path``, as ``python -m`` does (verl's way in), so a
    module a config names by its import path is found in the folder jarl runs from: an
    interaction's ``class_name: tutor_interaction.TutorInteraction``, a reward, a harness, an
    environment or tool class (a ``jarl`` console script's ``sys.path[0]`` is its bin folder).
    It goes last, so a stray file there shadows no installed package."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def load_function(spec: str, key: str, what: str = "function") -> Callable[..., Any]:
    """The function (or class: ``what`` says which the key takes) ``spec`` names; a
    `ConfigError` naming the config ``key`` if there is none."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{key}={spec!r}: expected module:{what} or path/to/file.py:{what}")
    fn = getattr(_module(where, spec, key), name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {where} has no {what} {name!r}")
    return fn


def import_module(spec: str, key: str) -> None:
    """Imports the module ``spec`` names (``package.module`` or ``path/to/file.py``) for what
    it does when imported; a file is imported under its own name (its stem), so an entry point
    that names it (``"register_letters:LettersEnv"``) finds it imported, not a second copy.
    A `ConfigError` naming the config ``key`` if it cannot be."""
    if not spec.endswith(".py"):
        _module(spec, spec, key)
        return
    path = Path(spec).resolve()
    if _loaded_from(path.stem, path):
        return  # imported already (make_environments runs more than once in a run)
    if path.stem in sys.modules:
        raise ConfigError(
            f"{key}={spec!r}: a module named {path.stem!r} is imported already "
            f"({getattr(sys.modules[path.stem], '__file__', None)}); rename the file"
        )
    _load_file(path, path.stem, spec, key)


def import_named(module: str, key: str) -> Any:
    """``importlib.import_module(module)`` for a module a config or YAML file names (``key``
    says where), with the `verl` shim on (module docstring); its ImportError propagates, or a
    `ConfigError` if a ``verl`` folder in the working directory made it."""
    install_shims()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        _refuse_verl_folder(e, key)
        raise


def _refuse_verl_folder(e: ImportError, key: str) -> None:
    """A one-line `ConfigError` naming ``key`` and the folder if ``e`` is an import of verl
    that a ``verl`` folder in the working directory answered (it comes before the shim, and
    before an installed verl once the working directory is importable: ``No module named
    'verl.tools'``); nothing for any other ImportError."""
    verl = sys.modules.get("verl")
    here = Path.cwd() / "verl"
    if (e.name or "").split(".")[0] != "verl" or verl is None or not here.is_dir():
        return
    if here.resolve() in {Path(p).resolve() for p in getattr(verl, "__path__", ())}:
        raise ConfigError(
            f"{key}: the folder {str(here)!r} in the working directory was imported as verl "
            f"({e}); rename it or run jarl from another folder"
        ) from e


def _module(where: str, spec: str, key: str) -> Any:
    if not where.endswith(".py"):
        try:
            return import_named(where, key)
        except ImportError as e:
            raise ConfigError(f"{key}={spec!r}: cannot import module {where!r}: {e}") from e
    path = Path(where)
    for name in (path.stem, f"jarl_user_{path.stem}"):  # by env.imports, or an earlier key
        if _loaded_from(name, path):
            return sys.modules[name]
    return _load_file(path, f"jarl_user_{path.stem}", spec, key)


def _loaded_from(name: str, path: Path) -> bool:
    """Whether module ``name`` is imported already, from the file ``path`` (a file is run
    once: a second run would register its environments twice, which skyrl-gym refuses)."""
    module = sys.modules.get(name)
    return module is not None and Path(getattr(module, "__file__", "") or "").resolve() == (
        path.resolve()
    )


def _load_file(path: Path, name: str, spec: str, key: str) -> Any:
    """The module of the file ``path``, run as module ``name`` (kept in ``sys.modules``), its
    folder on ``sys.path``."""
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r}: no such file {str(path)!r}")
    install_shims()
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, ImportError):
            _refuse_verl_folder(e, key)
        raise
    return module
