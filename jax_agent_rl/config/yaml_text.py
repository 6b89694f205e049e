"""A config file's text: read, checked to be one YAML mapping of bounded depth, every problem
one `ConfigError` line naming the file."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jax_agent_rl.config.errors import ConfigError

# Nesting deeper than this is refused before OmegaConf sees it. The schema is three levels deep
# and its free-form values (env.config, engine.ray.resources) a few more, while OmegaConf
# recurses through several Python frames per level and exhausts the interpreter's stack near
# 150 levels (a RecursionError, not a message).
MAX_DEPTH = 32
# A config file (or one override) of more than this is refused unread: a real one is a few KB,
# and reading one of 100k keys took minutes before any answer
MAX_TEXT_BYTES = 1 << 20
# The interpolations a config may hold: ``${section.key}`` and ``${oc.env:NAME}`` (or
# ``${oc.env:NAME,default}``), with literal arguments. Any other resolver (oc.select, oc.decode,
# oc.create, ...) or one nested in another is refused: ``oc.select``'s fan-out escaped the
# bound on what resolving may take (a 2.1 KB file ran for good), and resolver calls nested
# 200 deep ran OmegaConf's grammar out of the interpreter's stack
_INTERPOLATION = re.compile(r"(?<!\\)\$\{")  # (``\${`` is an escaped, literal one)
_READ = re.compile(r"\$\{(?:[A-Za-z_][\w-]*(?:\.[\w-]+)*|oc\.env:[A-Za-z_]\w*(?:,[^${}\\]*)?)\}")


def read_yaml(path: Path) -> Any:
    """The config file ``path`` as an OmegaConf mapping; a `ConfigError` naming the file if it
    is missing, no UTF-8 text, no single YAML document, nested deeper than `MAX_DEPTH`, or no
    mapping at its top level."""
    where = f"config file {path}"
    if path.is_dir():
        raise ConfigError(f"{where} is a folder: name a YAML file")
    if path.exists() and not path.is_file():  # a FIFO, a device, a socket
        raise ConfigError(f"{where} is not a regular file: name a YAML file")
    if not path.is_file():
        shipped = Path(__file__).resolve().parents[2] / path  # configs/... of the checkout
        hint = f": did you mean {shipped}?" if shipped.is_file() and path != shipped else ""
        raise ConfigError(f"{where} does not exist{hint}")
    try:
        size = path.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise ConfigError(
                f"{where} is {size} bytes: a config is at most {MAX_TEXT_BYTES} (1 MiB)"
            )
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror}") from None
    top = yaml_top(text, where)
    if top == "nothing":
        return OmegaConf.create({})
    if top != "mapping":
        raise ConfigError(
            f"{where} holds a {top} at its top level: expected a mapping of sections "
            "(model:, data:, ...)"
        )
    try:
        return OmegaConf.create(text)
    except RecursionError:  # (what the checks above leave to it: none known)
        raise ConfigError(f"{where}: nested too deep for the config reader") from None
    except yaml.YAMLError as e:  # what OmegaConf's loader adds: duplicate keys, ...
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {(e.msg or type(e).__name__).splitlines()[0]}") from None


def yaml_top(text: str, where: str) -> str:
    """What the YAML ``text`` holds at its top level: mapping, list, scalar or nothing. A
    `ConfigError` (``where`` names the text) if it is no YAML, more than one document, nested
    deeper than `MAX_DEPTH`, or holds a whole number too long for Python to read (more than
    `sys.get_int_max_str_digits` digits: YAML's loader would raise a bare ValueError). Reads
    the parser's events, which keeps no stack of its own, so no depth of nesting can exhaust
    the interpreter's."""
    top, depth, documents = "nothing", 0, 0
    resolver = yaml.resolver.Resolver()
    lines = "\n" in text.rstrip("\n")  # (once: per scalar, it made reading superlinear)
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.ScalarEvent):
                _check_number(event, resolver, where, lines)
                _check_interpolations(event, where, lines)
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    line = event.start_mark.line + 1
                    raise ConfigError(f"{where}: a second YAML document at line {line}")
            elif isinstance(event, yaml.NodeEvent) and depth == 0:
                kinds = {yaml.MappingStartEvent: "mapping", yaml.SequenceStartEvent: "list"}
                top = kinds.get(type(event), "scalar")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1
                    raise ConfigError(
                        f"{where}: nested deeper than {MAX_DEPTH} levels at line {line}"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    return top


def yaml_read(text: str, where: str) -> None:
    """A `ConfigError` (``where`` names the text) if OmegaConf's reader of an override's value
    refuses what `yaml_top`'s parser took: a duplicate key, a recursive alias, a tag it has no
    constructor for, a lone surrogate's escape (``"\\ud83d"``), or a value it reads but cannot
    hold (``!!timestamp 2001-12-14``, ``!!set {a}``); each ended ``jarl`` in a traceback."""
    try:
        OmegaConf.from_dotlist([f"value={text}"])
    except RecursionError:
        raise ConfigError(f"{where}: nested too deep for the config reader") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        problem = (e.msg or type(e).__name__).splitlines()[0]
        raise ConfigError(
            f"{where}: {problem}: give a string, number, boolean, list or mapping"
        ) from None


def _check_interpolations(event: yaml.ScalarEvent, where: str, lines: bool) -> None:
    """A scalar's interpolations must be ones a config reads (`_READ`); ``lines``: say its
    line."""
    for start in _INTERPOLATION.finditer(event.value):
        if not _READ.match(event.value, start.start()):
            shown = event.value[start.start() : start.start() + 40]
            at = f" at line {event.start_mark.line + 1}" if lines else ""
            raise ConfigError(
                f"{where}: {shown!r}{at}: a config reads ${{section.key}} and "
                "${oc.env:NAME} (or ${oc.env:NAME,default}) interpolations only"
            )


def _check_number(
    event: yaml.ScalarEvent, resolver: yaml.resolver.Resolver, where: str, lines: bool
) -> None:
    """A plain scalar that YAML reads as a whole number must have few enough digits for
    Python's ``int`` (a setting's range is far below that anyway); ``lines``: say its line."""
    limit = sys.get_int_max_str_digits()
    if event.style is not None or len(event.value) <= limit:
        return
    if resolver.resolve(yaml.ScalarNode, event.value, (True, False)) == "tag:yaml.org,2002:int":
        digits = sum(c.isdigit() for c in event.value)
        at = f" at line {event.start_mark.line + 1}" if lines else ""
        raise ConfigError(
            f"{where}: a whole number of {digits} digits{at}: too long to be any setting's "
            f"value (at most {limit} digits are read)"
        )


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where."""
    if "node expansion exceeds" in str(e):  # OmegaConf's bound on nodes, aliases expanded
        return (
            "more than 10000 YAML nodes (keys and values, aliases expanded): an alias "
            "expanding many times, or far more keys than a config holds"
        )
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    if isinstance(e, yaml.reader.ReaderError):
        return f"invalid YAML: character {chr(e.character)!r} at offset {e.position} is not allowed"
    return f"invalid YAML: {' '.join(str(e).split())}"
