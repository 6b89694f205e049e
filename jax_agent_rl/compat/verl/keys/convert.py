"""The whole table (`TABLE`, in docs/verl.md's order) and `to_jarl`, which rewrites a command
line's verl keys into jarl overrides."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jax_agent_rl.compat.verl.keys.data_keys import DATA
from jax_agent_rl.compat.verl.keys.rules import VERL_SECTIONS, Given, VerlKey
from jax_agent_rl.compat.verl.keys.training_keys import TRAINING
from jax_agent_rl.compat.verl.keys.workers_keys import WORKERS
from jax_agent_rl.config.errors import ConfigError

# Every key a verl GSM8K tool-agent run script sets (examples/sglang_multiturn/*gsm8k*.sh,
# examples/grpo_trainer/*gsm8k*.sh and their YAML), and the common ones near them.
TABLE: tuple[VerlKey, ...] = (*DATA, *WORKERS, *TRAINING)


def find(key: str) -> VerlKey | None:
    """The entry for verl key ``key``: its own, else the entry of a section holding it."""
    for entry in TABLE:
        if key == entry.verl or (entry.verl.endswith(".") and key.startswith(entry.verl)):
            return entry
    return None


def _is_verl(key: str) -> bool:
    entry = find(key)
    if entry is not None:
        return entry.verl != entry.jarl  # a key both spell alike is jarl's
    return key.split(".", 1)[0] in VERL_SECTIONS


def _parse(raw: str) -> Any:
    """An override's value as Hydra / OmegaConf read it (``[a,b]`` a list, ``True`` a bool);
    text that is not of that syntax stays text."""
    try:
        parsed: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))
        return parsed["v"]
    except OmegaConfBaseException:
        return raw


def count_rows(path: str) -> int:
    """Rows of a ``.parquet`` (its metadata) or ``.jsonl`` (its non-blank lines) file; a
    ValueError for a path that is there and no regular file (a FIFO's read never ends)."""
    if Path(path).exists() and not Path(path).is_file():
        raise ValueError(f"{path} is not a regular file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return int(pq.read_metadata(path).num_rows)
    with Path(path).open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def to_jarl(
    overrides: Sequence[str],
    config: Callable[[str], Any],
    say: Callable[[str], None],
    rows: Callable[[str], int] = count_rows,
) -> list[str]:
    """``overrides`` with every verl key replaced by the jarl overrides it means (`TABLE`), each
    told through ``say`` once, and the keys accepted with nothing to set (their effect is
    jarl's already) named together in one note; ``config`` gives a jarl key's value before the
    overrides, and ``rows`` counts a data file's rows (verl's epochs). Every refused key (one
    jarl cannot honour) is a `ConfigError` line, all of them at once."""
    kept: list[str] = []  # jarl's own overrides, in their order
    jarl: dict[str, str] = {}  # their key -> raw value, the last one winning
    verl: dict[str, str] = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        bare = key.lstrip("+")  # Hydra's +key / ++key: add or force
        if _is_verl(bare):
            verl[bare] = raw
        else:
            kept.append(item)
            jarl[key] = raw
    if not verl:
        return kept
    results: dict[str, dict[str, Any]] = {}
    problems: list[str] = []

    given_verl = {key: _parse(raw) for key, raw in verl.items()}

    def current(target: str) -> Any:
        if target in jarl:
            return _parse(jarl[target])
        for key in verl:
            entry = find(key)
            if entry is not None and target in entry.jarl.split(", "):
                values = convert(key)
                if target in values:
                    return values[target]
        return config(target)

    def convert(key: str) -> dict[str, Any]:
        """The jarl values of verl key ``key`` (none when it is refused)."""
        if key in results:
            return results[key]
        results[key] = {}  # a key is converted once
        entry = find(key)
        try:
            if entry is None:
                raise ConfigError(
                    "a verl key with no jarl equivalent listed in docs/verl.md: set the jarl "
                    "key directly (`jarl config` lists them)"
                )
            if entry.rule is None:
                results[key] = {entry.jarl: given_verl[key]}
            else:
                given = Given(given_verl, current, rows, lambda target: target in jarl)
                results[key] = entry.rule(given_verl[key], given)
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            why = str(e) or (entry.how if entry is not None else "")
            problems.append(f"verl key {key}={verl[key]}: {why}")
        return results[key]

    for key in verl:
        convert(key)
    problems += _clashes(results, jarl)
    if problems:
        raise ConfigError("\n".join(problems))
    out = list(kept)
    for key, raw in verl.items():
        values = results[key]
        if values:
            say(f"verl key {key}={raw} -> " + ", ".join(f"{k}={v}" for k, v in values.items()))
        out += [f"{k}={json.dumps(v)}" for k, v in values.items()]
    unset = {key: raw for key, raw in verl.items() if not results[key]}
    if unset:
        say(_accepted_note(unset))
    return list(dict.fromkeys(out))  # two verl keys may give one jarl key the same value


def _accepted_note(unset: Mapping[str, str]) -> str:
    """The one note naming the verl keys accepted with nothing to set (jarl already has their
    effect: `rules.not_needed`, `rules.fixed`), keys of one reason on one line."""
    why: dict[str, list[str]] = {}
    for key, raw in unset.items():
        entry = find(key)
        why.setdefault(entry.how if entry is not None else "", []).append(f"{key}={raw}")
    lines = [f"  {', '.join(keys)}: {how}" for how, keys in why.items()]
    keys = "verl key" if len(unset) == 1 else f"{len(unset)} verl keys"
    head = f"{keys} accepted with nothing to set (jarl already has their effect):"
    return "\n".join([head, *lines])


def _clashes(results: Mapping[str, Mapping[str, Any]], jarl: Mapping[str, str]) -> list[str]:
    """A jarl key set directly and by a verl key, or by two verl keys to different values."""
    problems: list[str] = []
    set_by: dict[str, tuple[str, Any]] = {}
    for key, values in results.items():
        for target, value in values.items():
            if target in jarl:
                problems.append(f"{target} is set directly and by verl key {key}: keep one")
            elif target in set_by and set_by[target][1] != value:
                problems.append(
                    f"{target} is set to {set_by[target][1]!r} by verl key {set_by[target][0]} "
                    f"and to {value!r} by verl key {key}: keep one"
                )
            set_by.setdefault(target, (key, value))
    return problems


def markdown_table() -> str:
    """`TABLE` as docs/verl.md's table."""
    lines = ["| verl key | jarl key | how |", "| --- | --- | --- |"]
    for e in TABLE:
        verl = f"`{e.verl}*`" if e.verl.endswith(".") else f"`{e.verl}`"
        jarl = ", ".join(f"`{k}`" for k in e.jarl.split(", ")) if e.jarl else "none"
        how = ("**trap**: " if e.trap else "") + e.how
        lines.append(f"| {verl} | {jarl} | {how} |")
    return "\n".join(lines) + "\n"
