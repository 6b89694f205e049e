"""Typed run configuration: frozen dataclasses per concern, filled from YAML plus dotted overrides.

A YAML file only fills in these dataclasses (OmegaConf structured configs do the merging and
type checks). An unknown or misspelled key, a value of the wrong type or outside a ``Literal``
is a `ConfigError` naming the full dotted key and the keys allowed there::

    cfg = load_config("configs/demo.yaml", ["model.dtype=bfloat16", "mesh.fsdp=2"])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to load and in which dtype."""

    path: str = "???"  # a local HF checkpoint folder (config.json + safetensors)
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter and compute dtype


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh; data * fsdp * tensor must equal the number of devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class JarlConfig:
    """The whole run configuration."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    schema: type[T] = JarlConfig,  # type: ignore[assignment]
) -> T:
    """Loads ``schema`` from a YAML file (optional), then ``key.sub=value`` overrides in order."""
    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(base, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"required config keys not set: {missing}")
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigKeyError as e:
        key = _full_key(e)
        raise ConfigError(
            f"unknown config key {key!r}; allowed here: {_allowed_keys(schema, key)}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad value for config key {_full_key(e)!r}: {e.msg}") from None


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (for run folders and ``--dry-run``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _full_key(e: OmegaConfBaseException) -> str:
    return str(e.full_key) if getattr(e, "full_key", None) else "<root>"


def _allowed_keys(schema: type, dotted: str) -> list[str]:
    """Field names of the dataclass that holds ``dotted``'s last part."""
    cls: Any = schema
    for part in dotted.split(".")[:-1]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            break
        inner = fields[part].default_factory
        if inner is dataclasses.MISSING or not dataclasses.is_dataclass(inner):
            break
        cls = inner
    return sorted(f.name for f in dataclasses.fields(cls))
