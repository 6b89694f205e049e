"""Chat templates rendered as transformers renders them, bounded in work and in size.

A chat template comes with a checkpoint, from wherever the checkpoint came from, and Jinja is a
programming language: its sandbox keeps a template away from Python's internals, but not from
looping for ever (two nested ``range(99999)`` loops) or from building a string that fills the
memory. Every render here has two bounds; a template that would pass one fails with a
`ChatTemplateError` naming the template and the bound:

- work: at most `MAX_STEPS` steps. A step is one iteration of a ``{% for %}`` loop (recursive
  loops included), one call (function, method, filter, test; a macro call is `MACRO_STEPS`),
  one ``+ * ** %`` or one comparison, plus one per `CHUNK` characters (or items) a call or
  comparison reads or the template writes (to its output or to the buffer of a macro, block or
  ``{% set %}``), and one per item of every list, tuple or dict it builds;
- size: at most `MAX_CHARS` characters (or items, counted to the bottom of nested lists and
  dicts) in the output and in every value the template builds. What an operation would build is
  checked before it runs where the operation multiplies its inputs (``*``, ``**``, a number
  given as a width or a count, a format width, ``replace``, ``join``, ``indent``, ``wordwrap``,
  ``expandtabs``, ``lipsum``), and once it returns otherwise.

A real chat template takes a few steps per message and renders the same text as in
transformers: the environment has the same settings, globals and filters, only counted.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

Message = dict[str, Any]

MAX_STEPS = 1_000_000
MAX_CHARS = 1 << 24  # 16 Mi characters: a prompt of several million tokens
CHUNK = 64  # characters or items read or written per step
MACRO_STEPS = 8  # a macro call runs a template body: it costs as much as several other steps
_MAX_INT_BITS = 4096  # integers a template computes (a real one counts messages)
_MAX_JSON_INDENT = 64

# Filters the code generator puts in; a template cannot name them ('-' is no identifier).
_COUNTED = "jarl-counted"  # the iterable of a loop: one step per item
_READ = "jarl-read"  # an operand of a comparison: one step per CHUNK it reads
_SIZED = "jarl-sized"  # a value built by ``~``, a literal or a slice: its size is checked

_WIDTH = re.compile(r"\d+")


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not compile, rejects the messages, or exceeds the
    bounds on its work and size."""


class _Render:
    """What one render has spent so far; ``origin`` names the template in errors."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.steps = 0

    def spend(self, steps: int) -> None:
        self.steps += steps
        if self.steps > MAX_STEPS:
            raise ChatTemplateError(
                f"{self.origin} takes more than {MAX_STEPS} steps (loop iterations, calls and "
                f"operators, plus one per {CHUNK} characters read or written): a chat template "
                "renders a conversation in far fewer, so it is stopped here"
            )

    def fits(self, size: int, what: str) -> None:
        if size > MAX_CHARS:
            raise ChatTemplateError(
                f"{self.origin} builds {what} of more than {MAX_CHARS} characters or items, "
                "over the bound on a chat template's output and values"
            )

    def number(self, n: Any, what: str) -> None:
        """A count or width given to ``what``: it sizes what gets built."""
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_CHARS:
            raise ChatTemplateError(
                f"{self.origin} gives {what} the number {n}, over the bound of {MAX_CHARS} on "
                "the characters or items a chat template builds"
            )


_CURRENT: contextvars.ContextVar[_Render] = contextvars.ContextVar("chat_template_render")


_TEXT = (str, bytes, range)
_CONTAINERS = (list, tuple, set, frozenset, dict)
_READABLE = (str, bytes, range, dict, list, tuple, set, frozenset)


def _size(x: Any) -> int:
    """Characters and items in ``x``, nested containers (and namespaces) counted to the bottom
    each time they are referenced, as printing ``x`` would write them, counted until past
    `MAX_CHARS`. Each item visited is a step, so a value that holds one list many times over,
    or holds itself, runs out of steps rather than time."""
    render = _CURRENT.get()
    total, stack = 0, [x]
    while stack and total <= MAX_CHARS:
        v = stack.pop()
        if isinstance(v, Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")  # what its repr prints
        if isinstance(v, _TEXT):
            total += len(v)
        elif isinstance(v, _CONTAINERS):
            total += len(v)
            render.spend(len(v))
            if total <= MAX_CHARS:
                stack += [*v.keys(), *v.values()] if isinstance(v, dict) else v
    return total


def _length(x: Any) -> int:
    """What reading ``x`` once costs: its characters or items (top level)."""
    return len(x) if isinstance(x, _READABLE) else 0


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    render = _CURRENT.get()
    for item in iterable:
        render.spend(1)
        yield item


def _args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    return [*args, *kwargs.values()]


def _format_widths(render: _Render, fmt: Any, what: str) -> None:
    """A ``%`` or ``str.format`` format string: its widths and precisions are counts."""
    if isinstance(fmt, str):
        for digits in _WIDTH.findall(fmt):
            if len(digits) > 8:  # an int of over 8 digits exceeds MAX_CHARS anyway
                render.number(10**9, what)
            render.number(int(digits), what)


def _repeats(render: _Render, name: str, target: Any, args: Sequence[Any]) -> list[Any]:
    """Checks what a call that repeats a string per match, item or line would build, before it
    runs; returns ``args`` (an iterable argument read into a list, so it can be measured)."""
    args = list(args)
    if not isinstance(target, str):
        return args
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        matches = target.count(old) if old else len(target) + 1
        matches = matches if count < 0 else min(matches, count)
        grows = max(len(new) - len(old), 0) if isinstance(new, str) else 0
        render.fits(len(target) + matches * grows, "the result of replace")
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], str) else args[0]
        args[0] = items
        render.fits(_size(items) + len(target) * len(items), "the result of join")
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        render.fits(len(target) + target.count("\t") * max(tab, 0), "the result of expandtabs")
    elif name in ("format", "format_map"):
        _format_widths(render, target, "a format width")
    return args


def _filter_precheck(render: _Render, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """The filters that repeat a string per item or line (``args[0]`` is the filtered value)."""
    value = args[0] if args else None
    if name == "join" and value is not None:
        args[0] = items = value if isinstance(value, str) else list(value)
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        render.fits(_size(items) + _length(sep) * len(items), "the result of join")
    elif name == "replace" and len(args) >= 3 and isinstance(value, str):
        count = args[3] if len(args) > 3 else kwargs.get("count")
        _repeats(render, "replace", value, [args[1], args[2], -1 if count is None else count])
    elif name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        per_line = width if isinstance(width, int) else _length(width)
        render.fits(len(value) + (value.count("\n") + 1) * per_line, "the result of indent")
    elif name == "wordwrap" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
        lines = len(value) // max(width, 1) + value.count("\n") + 1 if isinstance(width, int) else 1
        render.fits(len(value) + lines * max(_length(wrap), 2), "the result of wordwrap")
    elif name == "format" and value is not None:
        _format_widths(render, value, "a format width")


def _bounded_filter(name: str, func: Any, what: str) -> Callable[..., Any]:
    """``func`` (a filter or test) counted and checked; Jinja's pass-context/environment
    marker is copied by `functools.wraps`, so the first argument may be one of those."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        render = _CURRENT.get()
        passed, rest = list(args[:skip]), [_iterable(a) for a in args[skip:]]
        render.spend(1 + sum(map(_length, _args(rest, kwargs))) // CHUNK)
        for n in _args(rest[1:], kwargs):
            render.number(n, f"{what} {name!r}")
        _filter_precheck(render, name, rest, kwargs)
        result = func(*passed, *rest, **kwargs)
        size = _size(result)
        render.spend(size // CHUNK)
        render.fits(size, f"the result of {what} {name!r}")
        return result

    return bounded


def _iterable(x: Any) -> Any:
    """An iterator (a lazy filter's result) counted per item as it is read."""
    return _counted(x) if isinstance(x, Iterator) else x


class _Buffer(list[str]):
    """The buffer of a macro, block or ``{% set %}``: what is written to it is counted."""

    def append(self, text: str) -> None:
        _written(len(text))
        super().append(text)

    def extend(self, texts: Iterable[str]) -> None:
        texts = list(texts)
        _written(sum(map(len, texts)))
        super().extend(texts)


def _written(n: int) -> None:
    _CURRENT.get().spend(1 + n // CHUNK)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, with the iterable of every loop counted per item, the operands
    of every comparison counted as read, every ``~``, literal and slice checked for size, and
    buffers counted."""

    def visit_Template(  # noqa: N802 - the name Jinja's visitor dispatches on
        self, node: nodes.Template, frame: Frame | None = None
    ) -> None:
        def wrap(expr: nodes.Node, name: str) -> nodes.Filter:
            return nodes.Filter(expr, name, [], [], None, None, lineno=expr.lineno)

        def builds(expr: object) -> bool:  # a value made here, with no call to measure it
            return (
                isinstance(expr, nodes.Concat | nodes.List | nodes.Dict)
                or (isinstance(expr, nodes.Tuple) and expr.ctx == "load")
                or (isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Slice))
            )

        every = list(node.find_all(nodes.Node))  # before any is wrapped
        for parent in [node, *every]:  # such values, wrapped where their parents hold them
            for field in parent.fields:
                child = getattr(parent, field)
                if builds(child):
                    setattr(parent, field, wrap(child, _SIZED))
                elif isinstance(child, list):
                    child[:] = [wrap(c, _SIZED) if builds(c) else c for c in child]
        for loop in (n for n in every if isinstance(n, nodes.For)):
            loop.iter = wrap(loop.iter, _COUNTED)
        for compare in (n for n in every if isinstance(n, nodes.Compare)):
            compare.expr = wrap(compare.expr, _READ)
            for operand in compare.ops:
                operand.expr = wrap(operand.expr, _READ)
        super().visit_Template(node, frame)

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.jarl_buffer()")


def _read(x: Any) -> Any:
    _CURRENT.get().spend(1 + _length(x) // CHUNK)
    return x


def _sized(x: Any) -> Any:
    render = _CURRENT.get()
    size = _size(x)
    render.spend(1 + size // CHUNK)
    render.fits(size, "a value built with '~', a literal or a slice")
    return x


def _raise(message: str) -> None:
    raise ChatTemplateError(f"{_CURRENT.get().origin}: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: no HTML escaping (Jinja's built-in tojson escapes <, >, &).
    if isinstance(indent, int) and indent > _MAX_JSON_INDENT:  # repeated per line and level
        raise ChatTemplateError(
            f"{_CURRENT.get().origin} gives tojson(indent={indent}), over the bound of "
            f"{_MAX_JSON_INDENT} on a chat template's JSON indent"
        )
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Environment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, every operation counted and size-checked."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        # Not optimized: constant folding would run filters while compiling, outside a render.
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
            optimized=False,
        )
        self.filters["tojson"] = _tojson
        self.filters = {
            name: _bounded_filter(name, f, "the filter") for name, f in self.filters.items()
        }
        self.tests = {name: _bounded_filter(name, f, "the test") for name, f in self.tests.items()}
        self.filters[_COUNTED] = _counted
        self.filters[_READ] = _read
        self.filters[_SIZED] = _sized
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.jarl_buffer = _Buffer

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        render = _CURRENT.get()
        render.spend(1 + (_length(left) + _length(right)) // CHUNK)
        ints = all(isinstance(x, int) for x in (left, right))
        if operator == "*" and ints:
            if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                render.fits(MAX_CHARS + 1, f"an integer of over {_MAX_INT_BITS} bits")
        elif operator == "*":
            times = left if isinstance(left, int) else right if isinstance(right, int) else 1
            seq = right if times is left else left
            render.fits(_size(seq) * max(times, 0), "a repeated string or list")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * left.bit_length() > _MAX_INT_BITS:
                render.fits(MAX_CHARS + 1, f"an integer of over {_MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _format_widths(render, left, "a % format width")
            values = right.values() if isinstance(right, dict) else right
            for n in values if isinstance(right, dict | tuple) else [right]:
                render.number(n, "a % format")
        result = super().call_binop(context, operator, left, right)
        size = _size(result)
        render.spend(size // CHUNK)
        render.fits(size, f"the result of {operator!r}")
        return result

    def call(
        __self,  # noqa: N805 - Jinja's own signature: the names must not clash with kwargs
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        render = _CURRENT.get()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (_counted(args[0]), *args[1:])
        bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        name = getattr(__obj, "__name__", "")
        cost = MACRO_STEPS if isinstance(__obj, Macro) else 1
        render.spend(cost + sum(map(_length, [bound, *_args(args, kwargs)])) // CHUNK)
        for n in _args(args, kwargs):
            render.number(n, f"a call of {name or type(__obj).__name__}")
        args = tuple(_repeats(render, name, bound, args))
        if __obj is generate_lorem_ipsum:
            words = kwargs.get("n", args[0] if args else 5) * kwargs.get("max", 100)
            render.fits(words * 16, "lipsum text")
        result = super().call(__context, __obj, *args, **kwargs)
        size = _size(result)
        render.spend(size // CHUNK)
        render.fits(size, f"the result of {name or 'a call'}")
        return result


def render_template(
    template: str,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    origin: str = "the chat template",
    **template_kwargs: Any,
) -> str:
    """A chat template rendered as transformers renders it (before any tokenizer exists,
    e.g. to build the corpus a tokenizer is trained on), within the bounds of this module;
    ``origin`` names the template in errors."""
    compiled = _compile(template, origin)
    render = _Render(origin)
    token = _CURRENT.set(render)
    try:
        out: list[str] = []
        total = 0
        for text in compiled.generate(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        ):
            total += len(text)
            render.fits(total, "an output")
            render.spend(1 + len(text) // CHUNK)
            out.append(text)
        return "".join(out)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{origin} failed: {e}") from e
    except Exception as e:  # the template's own error (1 + 'a', 1 // 0, endless recursion)
        raise ChatTemplateError(f"{origin} failed: {type(e).__name__}: {e}") from e
    finally:
        _CURRENT.reset(token)


_COMPILED: dict[str, jinja2.Template] = {}


def _compile(source: str, origin: str) -> jinja2.Template:
    if source not in _COMPILED:
        try:
            _COMPILED[source] = _Environment().from_string(source)
        except (jinja2.TemplateSyntaxError, RecursionError) as e:  # or nests too deep
            raise ChatTemplateError(f"{origin} does not compile: {e!r}") from e
    return _COMPILED[source]
