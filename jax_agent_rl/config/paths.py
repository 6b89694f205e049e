"""Paths in a config: ``pkg://`` names of files shipped inside a package, the absolute paths a
run folder's ``config.yaml`` holds, and the folders a key or flag names, made (`made_folder`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.config.sections import JarlConfig

T = TypeVar("T")

PACKAGE_SCHEME = "pkg://"


def package_file(value: str, key: str) -> str:
    """The path of ``pkg://<package>/<path>``: ``<path>`` inside the installed ``<package>``
    (whether or not the file exists: the reader says so). Other values are returned as they are.
    ``key`` names the setting in errors."""
    if not value.startswith(PACKAGE_SCHEME):
        return value
    package, _, inner = value.removeprefix(PACKAGE_SCHEME).partition("/")
    try:
        root = importlib.resources.files(package)
    except (ImportError, TypeError, ValueError):
        raise ConfigError(
            f"{key}={value!r}: no installed package {package!r}; expected "
            f"{PACKAGE_SCHEME}<package>/<path inside it>"
        ) from None
    return str(root.joinpath(inner))


def resolve_packaged(cfg: T, prefix: str = "") -> T:
    """``cfg`` with every ``pkg://`` string of it (nested sections included) resolved."""
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value, key = getattr(cfg, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            changes[field.name] = resolve_packaged(value, f"{key}.")
        elif isinstance(value, str) and value.startswith(PACKAGE_SCHEME):
            changes[field.name] = package_file(value, key)
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]


# Keys whose value is a file or folder, and keys whose value may name a Python file
# (path/to/file.py:function), alone or as every value of a mapping.
PATH_KEYS = (
    "model.path",
    "model.tokenizer",
    "model.lora.adapter_path",
    "engine.vllm.python",
    "engine.jetstream.python",
    "tools.config",
    "env.interaction_config",
    "data.train",
    "data.val",
    "data.judge.model_path",
    "sft.data",
    "trainer.run_dir",
)
CODE_KEYS = ("agent.graph", "agent.harness", "data.reward", "model.module")
CODE_MAP_KEYS = ("env.classes", "data.rewards_by_source")


def absolute_paths(cfg: JarlConfig, cwd: Path) -> JarlConfig:
    """``cfg`` with every relative path of it made absolute against ``cwd``, the directory they
    are relative to. A run folder's ``config.yaml`` holds this, so that the run's readers
    (export, eval, traces, a resume) work from any directory."""

    def code(spec: str) -> str:
        where, colon, name = spec.rpartition(":")
        return f"{_absolute(where, cwd)}:{name}" if colon and where.endswith(".py") else spec

    for key in PATH_KEYS:
        cfg = _with(cfg, key, _absolute(_get(cfg, key), cwd))
    for key in CODE_KEYS:
        cfg = _with(cfg, key, code(_get(cfg, key)))
    for key in CODE_MAP_KEYS:
        cfg = _with(cfg, key, {name: code(spec) for name, spec in _get(cfg, key).items()})
    return cfg


def missing_paths(cfg: JarlConfig, keys: Sequence[str]) -> list[str]:
    """For each of ``keys`` (`PATH_KEYS`) set to a path that does not exist, one line naming
    the key and the absolute path."""
    paths = [(key, _get(cfg, key)) for key in keys]
    return [
        f"{key}={str(Path(path).absolute())!r} does not exist"
        for key, path in paths
        if path and not Path(path).exists()
    ]


def _absolute(path: str, cwd: Path) -> str:
    return str(cwd / path) if path and not Path(path).is_absolute() else path


def _get(cfg: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)


def _with(cfg: T, dotted: str, value: Any) -> T:
    """``cfg`` with the field ``dotted`` (nested sections included) set to ``value``."""
    head, _, rest = dotted.partition(".")
    inner = value if not rest else _with(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: inner})  # type: ignore[type-var]


def made_folder(path: Path, named: str) -> Path:
    """``path``, made a folder (with its parents) unless it is one; a `ConfigError` saying so
    after ``named`` (the key or flag that gives it) when it cannot be: under a file, on a
    read-only file system."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{named}: cannot make the folder: {e.strerror or e}") from None
    return path
