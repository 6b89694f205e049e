"""Loading a config: the schema's defaults, a YAML file and dotted overrides (verl's spellings
too) merged, every problem one `ConfigError` line naming its key."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from jax_agent_rl.config.checks import check_ranges, moved_keys, moved_to
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.config.foreign_keys import foreign_keys
from jax_agent_rl.config.paths import resolve_packaged
from jax_agent_rl.config.sections import JarlConfig
from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.config.yaml_text import (
    MAX_DEPTH,
    MAX_TEXT_BYTES,
    read_yaml,
    yaml_read,
    yaml_top,
)

T = TypeVar("T")


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    schema: type[T] = JarlConfig,  # type: ignore[assignment]
    unread: Collection[str] = (),
) -> T:
    """Loads ``schema`` from a YAML file (optional), then ``key.sub=value`` overrides in order;
    ``pkg://`` paths are resolved, and a `JarlConfig`'s numbers are checked (`check_ranges`).
    A key that moved (a field's ``was``) is an error naming its new key. Required keys in
    ``unread`` (a command that reads no data: ``jarl plan``) may stay unset: they load empty."""
    merged = _merged(path, overrides, schema)
    missing = _missing_keys(merged, schema)
    empty = [key for key in missing if key in unread]
    merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}=''" for key in empty]))
    missing = [key for key in missing if key not in unread]
    if missing:
        settings = " ".join(f"{key}=..." for key in missing)
        raise ConfigError(
            f"required config keys not set: {missing}; set them in the YAML or as overrides "
            f"({settings})"
        )
    return _checked(merged, schema)


class Preview(NamedTuple):
    """A config as `preview_config` shows it: its YAML, the required keys still unset marked."""

    yaml: str
    missing: list[str]  # required keys not set, dotted


def preview_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    schema: type[T] = JarlConfig,  # type: ignore[assignment]
) -> Preview:
    """As `load_config`, but a required key left unset is shown, not refused: its line reads
    ``key: ???  # required: set a.b.key=...``. Every other value is checked as it loads."""
    merged = _merged(path, overrides, schema)
    missing = _missing_keys(merged, schema)
    # required keys are strings; "" passes their checks
    unset = OmegaConf.from_dotlist([f"{key}=''" for key in missing])
    lines = to_yaml(_checked(OmegaConf.merge(merged, unset), schema)).splitlines()
    for i, key in _key_lines(lines):
        if key in missing:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            name = key.rpartition(".")[2]
            lines[i] = f"{indent}{name}: ???  # required: set {key}=..."
    return Preview("".join(f"{line}\n" for line in lines), missing)


def _key_lines(lines: Sequence[str]) -> list[tuple[int, str]]:
    """(line number, dotted key) of every ``key:`` line of block YAML indented by two spaces
    per level, as `to_yaml` writes it."""
    out: list[tuple[int, str]] = []
    parents: list[str] = []
    for i, line in enumerate(lines):
        name, colon, _ = line.strip().partition(":")
        if not colon or line.lstrip().startswith("- "):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        parents[depth:] = [name]
        out.append((i, ".".join(parents)))
    return out


def _merged(path: str | Path | None, overrides: Sequence[str], schema: type) -> Any:
    """The schema's defaults, the YAML file's values and then the overrides, merged (missing
    values left missing); every problem a one-line `ConfigError`."""
    layers = [] if path is None else [read_yaml(Path(path))]
    # Hydra's +key=v / ++key=v (add / force) set the key as key=v does: every key exists here
    overrides = [item.lstrip("+") for item in overrides]
    for item in overrides:
        if item.startswith("~"):
            raise ConfigError(
                f"override {_shown(item)}: Hydra's ~key (delete) has nothing to do here: every "
                "key has a default; drop it"
            )
        if len(item) > MAX_TEXT_BYTES:
            raise ConfigError(f"override {_shown(item)}: at most {MAX_TEXT_BYTES} characters")
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, _, value = item.partition("=")
        if not all(key.split(".")):
            raise ConfigError(f"override {_shown(item)}: {key!r} is not a dotted key (a.b.c)")
        if key.count(".") >= MAX_DEPTH:
            raise ConfigError(f"override {_shown(key)}: nested deeper than {MAX_DEPTH} levels")
        yaml_top(value, f"override {key}")
        yaml_read(value, f"override {key}")
    if schema is JarlConfig:  # verl's spellings of its keys (docs/verl.md), from the verl wing
        load_wing("verl_keys")
        overrides = _foreign_overrides(overrides, OmegaConf.structured(schema), layers)
    # `key=` means the empty string (OmegaConf would read it as null)
    dotlist = [f"{item}''" if item.endswith("=") else item for item in overrides]
    try:
        layers.append(OmegaConf.from_dotlist(dotlist))
        moved = moved_keys(schema)
        for layer in layers:
            _refuse_moved(moved, layer, schema)
            _check_sections(schema, layer)
        return OmegaConf.merge(OmegaConf.structured(schema), *layers)
    except ConfigKeyError as e:
        key = _full_key(e)
        foreign = [s for keys in foreign_keys() for s in keys.sections]
        if key.split(".")[0] in ("defaults", *foreign):
            raise ConfigError(
                f"unknown config key {key!r}: a verl (Hydra) config file? jarl reads verl's "
                "keys as command-line overrides only; start from a jarl config (docs/verl.md)"
            ) from None
        verl = "; a verl key? docs/verl.md" if key.split(".")[0] in _VERL_SHARED else ""
        raise ConfigError(
            f"unknown config key {key!r}; allowed here: {_allowed_keys(schema, key)}{verl}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(_bad_value(schema, e)) from None


def _missing_keys(merged: Any, schema: type) -> list[str]:
    """The required keys ``merged`` leaves unset, dotted and sorted. Finding them resolves
    every value: an interpolation naming no key (``${foo}``), or itself, is a `ConfigError`
    naming its key (it was OmegaConf's traceback), and the new key of one that moved; one that
    would take too long, too (`_bounded_interpolations`)."""
    _bounded_interpolations(merged)
    try:
        return sorted(OmegaConf.missing_keys(merged))
    except InterpolationResolutionError as e:
        why = (e.msg or type(e).__name__).splitlines()[0]
        found = re.search(r"Interpolation key '([^']+)' not found", why)
        named = "" if found is None else found[1]
        new = moved_to(named, moved_keys(schema)) if named else None
        moved = "" if new is None else f" ({named!r} is now {new!r})"
        raise ConfigError(f"config key {_full_key(e)!r}: {why}{moved}") from None


# jarl's sections that verl's config has too: an unknown key there may be a verl key
_VERL_SHARED = ("data", "trainer", "algorithm")


def _refuse_moved(moved: dict[str, str], layer: Any, schema: type, prefix: str = "") -> None:
    """A key of ``layer`` (a YAML file's or the overrides') that moved (`moved_keys`) is an
    error naming its new key; one of ``schema``'s no more whose keys moved, naming where."""
    for name, value in layer.items_ex(resolve=False) if OmegaConf.is_dict(layer) else ():
        key = f"{prefix}{name}"
        if OmegaConf.is_dict(value) and len(value):
            _refuse_moved(moved, value, schema, f"{key}.")
        elif (new := moved_to(key, moved)) is not None:
            raise ConfigError(f"config key {key!r} is now {new!r}")
        elif _expected(schema, key) is None and (split := _split_into(key, moved)):
            raise ConfigError(f"config key {key!r} split: its keys are now under {split}")


def _split_into(key: str, moved: dict[str, str]) -> str:
    """The sections the keys under ``key`` moved to ("engine, group, sampling"), where ``key``
    held moved keys but did not move itself (``rollout:``, empty, split into three sections);
    "" where none did."""
    new = {moved[old].split(".")[0] for old in moved if old.startswith(f"{key}.")}
    return ", ".join(sorted(new))


def _check_sections(schema: Any, layer: Any, prefix: str = "") -> None:
    """Each section of ``schema`` that ``layer`` sets is a mapping, and each list or mapping
    setting a list or a mapping (OmegaConf's own errors name no key: ``model: 5``; ``stop:
    {a: 1}`` raised "Cannot merge incompatible container types", a traceback)."""
    hints: Any = schema if isinstance(schema, _Entries) else typing.get_type_hints(schema)
    for name, value in layer.items_ex(resolve=False) if OmegaConf.is_dict(layer) else ():
        if isinstance(schema, _Entries) and not isinstance(name, str):
            raise ConfigError(f"{prefix}{name!r}: a name (text) is expected as the key")
        hint = hints.get(name)
        if dataclasses.is_dataclass(hint):
            if not OmegaConf.is_dict(value):
                shown = _shown(str(value))
                raise ConfigError(f"{prefix}{name}={shown}: expected a section (key: value lines)")
            _check_sections(hint, value, f"{prefix}{name}.")
        else:
            _check_container(hint, value, f"{prefix}{name}")
            if not OmegaConf.is_interpolation(layer, name):
                _check_bool(hint, value, f"{prefix}{name}")
            entry = typing.get_args(hint)[1] if typing.get_origin(hint) is dict else None
            if dataclasses.is_dataclass(entry) and OmegaConf.is_dict(value):
                # a mapping of sections (``policies``): each entry checked as a section
                _check_sections(_Entries(typing.cast(type, entry)), value, f"{prefix}{name}.")


class _Entries:
    """The type hints of a mapping whose every value is a section of type ``entry``: any key
    (a name) maps to it, so `_check_sections` checks each entry as that section."""

    def __init__(self, entry: type) -> None:
        self.entry = entry

    def get(self, _name: str) -> type:
        return self.entry


def _check_container(hint: Any, value: Any, key: str) -> None:
    """``value`` (a layer's, at ``key``) is a list where ``hint`` is one and a mapping where it
    is one (OmegaConf names the key of a wrong item inside); null is left to OmegaConf."""
    origin = typing.get_origin(hint)
    if value is None or origin not in (list, tuple, dict):
        return
    if origin is dict and not OmegaConf.is_dict(value):
        raise ConfigError(f"{key}={_shown(str(value))}: expected a mapping (key: value)")
    if origin is not dict and not OmegaConf.is_list(value):
        raise ConfigError(f"{key}={_shown(str(value))}: expected a list ([a, b])")


def _check_bool(hint: Any, value: Any, key: str) -> None:
    """A true/false setting is given a YAML boolean (``true``, ``false``; OmegaConf's loader
    reads ``yes``/``on`` as them too): OmegaConf would take ``2``, ``0.5`` or the string
    ``"yes"`` as true."""
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={_shown(str(value))}: expected true or false")


# What resolving a config's interpolations may take: OmegaConf resolves each ``${key}`` anew
# wherever it is used, so values that each name the one before many times grew exponentially
# (a 10^5-character file took 13.8 s, 10^6 past 100 s, in `jarl config` and `jarl train`)
MAX_RESOLVED_CHARS = 1 << 20
MAX_RESOLUTIONS = 100_000
_REFERENCE = re.compile(r"\$\{([^${}]*)\}")


def _reference_chars(ref: str) -> int:
    """The characters ``${ref}`` (no key of the config) resolves to: an environment variable's
    value (``oc.env:NAME[,default]``: a 100 kB variable named 10^4 times took 5.7 GB), else
    its own text."""
    if not ref.startswith("oc.env:"):
        return len(ref) + 3
    name, _, default = ref.removeprefix("oc.env:").partition(",")
    return len(os.environ.get(name.strip(), default))


def _bounded_interpolations(merged: Any) -> None:
    """Refuses a config whose interpolations would resolve to more than MAX_RESOLVED_CHARS
    characters in one value, or take more than MAX_RESOLUTIONS resolutions, before OmegaConf
    resolves any: each value's size and cost are counted from the raw values, each referenced
    key once. A reference that is not a plain absolute key (a resolver, a relative key) counts
    as its own text."""
    raw: dict[str, Any] = {}

    def flatten(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, value in items:
            key = f"{prefix}.{name}" if prefix else str(name)
            if isinstance(value, (dict, list)):
                flatten(value, key)
            raw[key] = value

    flatten(OmegaConf.to_container(merged, resolve=False), "")
    sizes: dict[str, tuple[int, int]] = {}  # key: (characters, resolutions)

    def size(key: str) -> tuple[int, int]:
        if key not in sizes:
            sizes[key] = (0, 1)  # (a cycle: OmegaConf says so itself)
            value = raw[key]
            if not isinstance(value, str) or "${" not in value:
                sizes[key] = (len(str(value)), 1)
            else:
                chars, calls = len(_REFERENCE.sub("", value)), 1
                for ref in _REFERENCE.findall(value):
                    got = size(ref) if ref in raw else (_reference_chars(ref), 1)
                    chars, calls = chars + got[0], calls + got[1]
                sizes[key] = (chars, calls)
            chars, calls = sizes[key]
            if chars > MAX_RESOLVED_CHARS or calls > MAX_RESOLUTIONS:
                raise ConfigError(
                    f"{key}: its interpolations resolve to {chars} characters in {calls} "
                    f"resolutions (at most {MAX_RESOLVED_CHARS} and {MAX_RESOLUTIONS}): a value "
                    "naming another many times, which names another many times?"
                )
        return sizes[key]

    for key in raw:
        size(key)


def _checked(merged: Any, schema: type[T]) -> T:
    """The dataclass of a merged config with every value set, ``pkg://`` paths resolved and
    (a `JarlConfig`) its numbers checked."""
    try:
        cfg: Any = OmegaConf.to_object(merged)
        OmegaConf.structured(cfg)  # a container where a mapping's value must be a string, ...
    except OmegaConfBaseException as e:
        raise ConfigError(_bad_value(schema, e)) from None
    cfg = resolve_packaged(cfg)
    problems = check_ranges(cfg) if isinstance(cfg, JarlConfig) else []
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def _foreign_overrides(overrides: Sequence[str], base: Any, layers: Sequence[Any]) -> list[str]:
    """Each registered framework's ``to_jarl`` (verl's: `jax_agent_rl.compat.verl.keys.to_jarl`)
    over the config before the overrides, each of its keys' jarl key told on stderr."""

    @functools.cache  # merged only if a conversion reads a value
    def config() -> Any:
        try:
            return OmegaConf.merge(base, *layers)
        except OmegaConfBaseException:  # a bad YAML file: `load_config` says why when it merges
            return base

    for keys in foreign_keys():
        overrides = keys.to_jarl(
            overrides,
            lambda key: OmegaConf.select(config(), key, throw_on_missing=False),
            lambda line: print(line, file=sys.stderr),
        )
    return list(overrides)


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (for run folders and ``--dry-run``), which `load_config`
    reads back as the same values: a string holding ``${`` (a prompt given as ``\\${x}``) is
    written escaped, where it was written as an interpolation that the run's own
    ``config.yaml`` then failed to resolve (resuming, ``jarl eval RUN``)."""
    values = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False)
    return OmegaConf.to_yaml(OmegaConf.create(_escaped(values)))


def _escaped(value: Any) -> Any:
    """``value`` with every string's ``${`` escaped as OmegaConf reads it: ``\\${`` for a
    literal ``${``, each backslash before it doubled."""
    if isinstance(value, str):
        return _INTERPOLATION_START.sub(lambda m: m[1] * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def _full_key(e: OmegaConfBaseException) -> str:
    for key in (getattr(e, "full_key", None), getattr(e, "key", None)):
        if key:
            return str(key)
    return "<root>"


def _bad_value(schema: type, e: OmegaConfBaseException) -> str:
    """One line for a value OmegaConf refused: the key, the value and what the key takes."""
    key = _full_key(e)
    shown = _shown(str(getattr(e, "value", None)))
    expected = _expected(schema, key)
    if expected is None:  # not a typed field (a section given a value, ...): OmegaConf's words
        return f"bad value for config key {key!r}: {(e.msg or type(e).__name__).splitlines()[0]}"
    return f"{key}={shown}: expected {expected}"


def _shown(text: str, limit: int = 80) -> str:
    """``text`` quoted, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _expected(schema: type, dotted: str) -> str | None:
    """What the field ``dotted`` of ``schema`` takes, in words; None for no typed field."""
    hint: Any = schema
    for part in dotted.split("."):
        if typing.get_origin(hint) is dict:  # a mapping's entry: its value type
            hint = typing.get_args(hint)[1]
        elif dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        else:
            return None
    if hint is None:
        return None
    return "a section (key: value lines)" if dataclasses.is_dataclass(hint) else _describe(hint)


def _describe(hint: Any) -> str:
    """A field's type in words: "a whole number", "one of [...]", "a number or null", ..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return f"one of {list(args)}"
    if type(None) in args:
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    words = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}
    if hint in words:
        return words[hint]
    return {dict: "a mapping", list: "a list"}.get(typing.get_origin(hint), str(hint))


def _allowed_keys(schema: type, dotted: str) -> list[str]:
    """Field names of the dataclass that holds ``dotted``'s last part (through a mapping's
    entries: ``policies.<name>.model``)."""
    cls: Any = schema
    for part in dotted.split(".")[:-1]:
        if typing.get_origin(cls) is dict:  # a mapping's entry: its value type
            inner = typing.get_args(cls)[1]
        else:
            inner = typing.get_type_hints(cls).get(part)
        nested = dataclasses.is_dataclass(inner) or typing.get_origin(inner) is dict
        if inner is None or not nested:
            break
        cls = inner
    if not dataclasses.is_dataclass(cls):  # (a mapping's own keys are free)
        return []
    return sorted(f.name for f in dataclasses.fields(cls))
