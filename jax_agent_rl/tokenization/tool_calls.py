"""Tool-call parsers: model text in, tool calls (or what was wrong with them) out.

A parser reads the text of one model turn. Calls inside a ``<think>...</think>`` block are
reasoning, not calls. A malformed call (bad JSON, not an object, no name, a call cut off by the
token budget) is returned as a `ParsedCall` with ``error`` set, so the loop can answer it with a
tool message saying what was wrong; nothing raises.

Two families:

- chat style (``hermes``, ``llama3_json``): calls are part of the assistant message, results
  come back as ``tool`` messages rendered by the chat template;
- code-block style (``python_tag``, ``tool_tag``, ``fenced_python``): tool-integrated
  reasoning, the model writes code between tags, generation stops at the closing tag
  (``stop_tokens``), and the result is appended inline as an ``<output>`` block in the
  same assistant turn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Literal, Protocol

from jax_agent_rl.console.visible import lone_surrogate

Style = Literal["chat", "inline"]
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
# how deep a tool call's JSON may nest (the call's object is one level): far past any tool's
# schema, and far short of the recursion limit every JSON reader and writer on the way to a
# tool server hits (its client encodes the call three levels deeper, in a deeper stack)
MAX_JSON_DEPTH = 100


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any
    error: str | None = None  # set when the call is malformed; ``name`` may be "" then


class ToolCallParser(Protocol):
    name: str
    style: Style
    stop_tokens: tuple[str, ...]  # tokens that end generation when a call is complete

    def parse(self, text: str) -> list[ParsedCall]: ...

    def needs_more(self, text: str) -> bool:
        """True when generation stopped inside an unfinished block that must be continued."""
        ...


class InlineToolCallParser(ToolCallParser, Protocol):
    def format_output(self, result_text: str) -> str:
        """The text appended after a code block, carrying its result."""
        ...


def strip_reasoning(text: str) -> str:
    return _THINK.sub("", text)


def _decode(raw: str) -> tuple[Any, str | None]:
    """``json.loads(raw)``, or None and what was wrong with it.

    Besides malformed JSON, decoding can fail on text a policy may well write: nesting past the
    recursion limit (RecursionError), an integer of more than 4,300 digits (ValueError), or a
    document too large for memory; all of them are the model's error, never the loop's crash.
    So are values Python's JSON reads but no strict JSON writer takes back (the tool server's
    client sends UTF-8 without NaN): ``NaN``, ``Infinity``, a number past float's range that
    Python reads as infinity (``1e999``), lone surrogates (``"\\ud800"``), and nesting past
    `MAX_JSON_DEPTH` (read here, it failed to encode deeper in the client's stack: a transport
    failure, which takes the episode out of training).
    """
    try:
        obj = json.loads(raw, parse_constant=no_json_constant, parse_float=finite_json_float)
        depth = _depth(obj)
        if depth > MAX_JSON_DEPTH:
            return None, f"nested {depth} levels deep, past the {MAX_JSON_DEPTH} levels a call has"
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at char {e.pos}"
    except (ValueError, RecursionError, MemoryError) as e:
        return None, f"{type(e).__name__}: {e}"
    where = lone_surrogate(obj)  # (no JSON writer to a tool server takes one)
    if where is not None:
        return None, f"a lone surrogate {where} of a string is not text"
    return obj, None


def _depth(value: Any) -> int:
    """How deep ``value``'s lists and objects nest (a number or string: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend(
                (child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def no_json_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity``, which
    Python's reader takes and no strict JSON writer writes, are an error."""
    raise ValueError(f"{name} is not a JSON number")


def finite_json_float(text: str) -> float:
    """``json.loads``'s ``parse_float``: a number past float's range (``1e999``, which
    Python's reader takes as infinity) is an error."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text:.40} is past a float's range")
    return value


def _json_call(
    raw: str, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",)
) -> ParsedCall:
    obj, error = _decode(raw)
    if error is not None:
        return ParsedCall("", None, f"the tool call is not valid JSON ({error})")
    if not isinstance(obj, dict):
        return ParsedCall("", None, "the tool call must be a JSON object")
    name = obj.get(name_key)
    if not isinstance(name, str) or not name:
        return ParsedCall("", None, f"the tool call has no {name_key!r} string")
    args_key = next((k for k in args_keys if k in obj), None)
    args = obj.get(args_key, {}) if args_key else {}
    if isinstance(args, str):  # some models double-encode arguments
        args, error = _decode(args)
        if error is not None:
            return ParsedCall(
                name, None, f"the arguments of {name} are a string, not JSON ({error})"
            )
    return ParsedCall(name, args)


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Hermes)."""

    name = "hermes"
    style: Style = "chat"
    stop_tokens: tuple[str, ...] = ()
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for m in self._block.finditer(strip_reasoning(text)):
            if not m.group(2):
                calls.append(ParsedCall("", None, "the tool call was cut off before </tool_call>"))
            else:
                calls.append(_json_call(m.group(1).strip()))
        return calls

    def needs_more(self, text: str) -> bool:
        del text
        return False


class Llama3JsonParser:
    """Llama 3.1 JSON tool calls: the message is ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``; several calls may be separated by ``;``."""

    name = "llama3_json"
    style: Style = "chat"
    stop_tokens: tuple[str, ...] = ()

    def parse(self, text: str) -> list[ParsedCall]:
        body = strip_reasoning(text).strip().removeprefix("<|python_tag|>").strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        if not body.startswith("{"):
            return []
        return [
            _json_call(part.strip(), args_keys=("parameters", "arguments"))
            for part in _split_top_level(body, ";")
        ]

    def needs_more(self, text: str) -> bool:
        del text
        return False


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside JSON strings, objects and arrays. Inside a
    string, a character after a backslash is escaped: ``\\"`` does not close it (read as a
    close, the brackets and separators after it were counted outside the string, and a call
    holding ``"s = '\\"}}'; t = 1"`` was split into two malformed ones)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


class TagCodeParser:
    """Tool-integrated reasoning with tags: ``<python>code</python>`` runs ``code`` with the
    python tool; generation stops at the closing tag and the output is appended inline."""

    style: Style = "inline"

    def __init__(self, tag: str = "python", tool_name: str = "python", argument: str = "code"):
        self.name = f"{tag}_tag"
        self.tag, self.tool_name, self.argument = tag, tool_name, argument
        self.stop_tokens = (f"</{tag}>",)
        self._block = re.compile(rf"<{tag}>(.*?)(</{tag}>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        blocks = list(self._block.finditer(strip_reasoning(text)))
        if not blocks:
            return []
        last = blocks[-1]  # earlier blocks already ran in earlier rounds of this turn
        if not last.group(2):
            return [ParsedCall("", None, f"the <{self.tag}> block was cut off")]
        return [ParsedCall(self.tool_name, {self.argument: last.group(1).strip("\n")})]

    def needs_more(self, text: str) -> bool:
        del text
        return False

    def format_output(self, result_text: str) -> str:
        return f"\n<output>\n{result_text}\n</output>\n"


class FencedPythonParser:
    """Tool-integrated reasoning with markdown fences: a ```` ```python ```` block runs; the
    fence token stops generation, so a stop at the *opening* fence is continued."""

    name = "fenced_python"
    style: Style = "inline"
    stop_tokens: tuple[str, ...] = ("```",)

    def __init__(self, tool_name: str = "python", argument: str = "code") -> None:
        self.tool_name, self.argument = tool_name, argument

    def parse(self, text: str) -> list[ParsedCall]:
        body = strip_reasoning(text)
        if body.count("```") % 2:  # an unclosed fence (the turn was cut off)
            return [ParsedCall("", None, "the ```python block was cut off")]
        blocks = re.findall(r"```python\n(.*?)```", body, re.DOTALL)
        if not blocks or not body.rstrip().endswith("```"):
            return []
        return [ParsedCall(self.tool_name, {self.argument: blocks[-1]})]

    def needs_more(self, text: str) -> bool:
        body = strip_reasoning(text)
        return body.rstrip().endswith("```") and body.count("```") % 2 == 1

    def format_output(self, result_text: str) -> str:
        return f"\n```output\n{result_text}\n```\n"


PARSERS: dict[str, Any] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "python_tag": lambda: TagCodeParser("python"),
    "tool_tag": lambda: TagCodeParser("tool"),
    "fenced_python": FencedPythonParser,
}


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; registered: {sorted(PARSERS)}")
    parser: ToolCallParser = PARSERS[name]()
    return parser


def register_parser(name: str, factory: Any) -> None:
    """Adds a user parser (a zero-argument factory returning a ToolCallParser)."""
    if name in PARSERS:
        raise ValueError(f"parser {name!r} is already registered")
    PARSERS[name] = factory
