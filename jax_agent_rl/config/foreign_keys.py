"""Another framework's spellings of jarl's keys, which a wing registers
(`jax_agent_rl.config.wings`; the verl wing: verl's Hydra keys, `jax_agent_rl.compat.verl.keys`).
The config loader passes a `JarlConfig`'s overrides through each registered translation and
names a registered framework's sections when a config file uses them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

# (overrides, the value of a jarl key in the config before them, say one line) -> overrides
ToJarl = Callable[[Sequence[str], Callable[[str], Any], Callable[[str], None]], list[str]]


@dataclasses.dataclass(frozen=True)
class ForeignKeys:
    """``name``'s keys (e.g. "verl"): its top-level ``sections`` and ``to_jarl``, which rewrites
    its overrides into jarl's."""

    name: str
    sections: tuple[str, ...]
    to_jarl: ToJarl


_REGISTERED: dict[str, ForeignKeys] = {}


def register_foreign_keys(keys: ForeignKeys) -> None:
    """Reads ``keys.name``'s spellings from now on."""
    _REGISTERED[keys.name] = keys


def foreign_keys() -> list[ForeignKeys]:
    """The registered frameworks' keys."""
    return list(_REGISTERED.values())
