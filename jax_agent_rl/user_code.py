"""User functions a config names: ``package.module:function`` or ``path/to/file.py:function``
(a reward, ``data.reward``; a LangGraph graph, ``agent.graph``), and the working directory
importable, as under ``python -m``, for the modules named by their import path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jax_agent_rl.config import ConfigError


def working_directory_importable() -> None:
    """Puts the working directory on ``sys.path``, as ``python -m`` does (verl's way in), so a
    module a config names by its import path is found in the folder jarl runs from: an
    interaction's ``class_name: tutor_interaction.TutorInteraction``, a reward, a harness, an
    environment or tool class (a ``jarl`` console script's ``sys.path[0]`` is its bin folder).
    It goes last, so a stray file there shadows no installed package."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """The function ``spec`` names; a `ConfigError` naming the config ``key`` if there is none."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{key}={spec!r}: expected module:function or path/to/file.py:function")
    fn = getattr(_module(where, spec, key), name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {where} has no function {name!r}")
    return fn


def _module(where: str, spec: str, key: str) -> Any:
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"{key}={spec!r}: cannot import module {where!r}: {e}") from e
    path = Path(where)
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r}: no such file {where!r}")
    module_spec = importlib.util.spec_from_file_location(f"jarl_user_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
