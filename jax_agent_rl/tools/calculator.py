"""A calculator tool: arithmetic evaluated from the parsed syntax tree, never with ``eval``.

Numbers, + - * / // % **, unary signs, parentheses, and a few functions (abs, round, min, max,
sqrt). Results are exact for integers. The model calling it is an optimiser that will find any
input that hangs or crashes it, so every operation's operands are bounded *before* it runs
(one big-int operation holds the GIL, freezing every other coroutine of the rollout):

- the expression: at most `MAX_LENGTH` characters, `MAX_NODES` syntax nodes nested at most
  `MAX_DEPTH` deep (checked on the tree before anything is evaluated);
- integers: at most `MAX_BITS` bits (about 3,900 digits, under Python's 4,300-digit limit on
  printing an int), for constants and for results; a product's or a power's size is estimated
  from its operands (``bits(a) + bits(b)``, ``exp * log2(|base|)``) and refused before it is
  computed;
- floats: finite; a complex result (``(-8) ** 0.5``) is refused;
- ``round``'s ``ndigits``: within ``±MAX_ROUND_DIGITS`` (``round(2, -10**9)`` would build
  ``10**(10**9)``); a function takes at most `MAX_ARGUMENTS` arguments.

Anything else (overflow, a math domain error, a wrong argument) is a `CalculatorError` whose
message the model reads.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from jax_agent_rl.tools.base import ToolResult, tool

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
}
MAX_LENGTH = 1000
MAX_NODES = 500
MAX_DEPTH = 100
MAX_BITS = 13_000
MAX_ROUND_DIGITS = 100
MAX_ARGUMENTS = 20


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises CalculatorError naming what is wrong."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, parser overflow
        raise CalculatorError(f"not an arithmetic expression: {e}") from None
    _check_size(tree.body)
    return _eval(tree.body)


def _check_size(root: ast.AST) -> None:
    """Refuses a tree of more than `MAX_NODES` nodes or deeper than `MAX_DEPTH` (iteratively:
    the check must not itself recurse as deep as the tree)."""
    stack, count = [(root, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise CalculatorError(f"expression has more than {MAX_NODES} parts")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"expression is nested more than {MAX_DEPTH} deep")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _check_growth(node.op, left, right)
        return _apply(_BINARY[type(node.op)], left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _apply(_UNARY[type(node.op)], _eval(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        name = node.func.id
        if len(node.args) > MAX_ARGUMENTS:
            raise CalculatorError(f"{name}: more than {MAX_ARGUMENTS} arguments")
        args = [_eval(a) for a in node.args]
        if name == "round" and len(args) == 2 and abs(args[1]) > MAX_ROUND_DIGITS:
            raise CalculatorError(f"round: ndigits beyond ±{MAX_ROUND_DIGITS}")
        return _apply(_FUNCTIONS[name], *args, name=name)
    raise CalculatorError(f"unsupported syntax: {ast.unparse(node)!r}")


def _check_growth(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuses an integer product or power whose result would exceed `MAX_BITS`, before it
    is computed (a sum or a quotient is at most one bit longer than its operands)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    # a product of an m-bit and an n-bit integer has at least m + n - 1 bits
    if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() - 1 > MAX_BITS:
        raise CalculatorError(f"the product would have more than {MAX_BITS} bits")
    # base ** exp has about exp * log2(|base|) bits (and at least exp when |base| >= 2)
    if (
        isinstance(op, ast.Pow)
        and abs(left) > 1
        and right > 0  # a negative exponent gives a float
        and (right > MAX_BITS or right * math.log2(abs(left)) > MAX_BITS)
    ):
        raise CalculatorError(
            f"the power would have more than {MAX_BITS} bits; use a smaller base or exponent"
        )


def _apply(fn: Callable[..., Any], *args: int | float, name: str = "") -> int | float:
    """``fn(*args)`` with its failures (overflow, domain errors, wrong arguments) as
    CalculatorError (prefixed with the function's ``name``), its result checked."""
    prefix = f"{name}: " if name else ""
    try:
        value = fn(*args)
    except ZeroDivisionError:
        raise CalculatorError(f"{prefix}division by zero") from None
    except (ArithmeticError, RecursionError, MemoryError, TypeError, ValueError) as e:
        raise CalculatorError(f"{prefix}{e or type(e).__name__}") from None
    return _checked(value)


def _checked(value: Any) -> int | float:
    """``value`` if it is an int within `MAX_BITS` or a finite float."""
    if type(value) is int:
        if value.bit_length() > MAX_BITS:
            raise CalculatorError(f"result larger than {MAX_BITS} bits")
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise CalculatorError("result is not a finite number")
        return value
    raise CalculatorError(f"result is not a real number: {value!r}")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


@tool
def calculator(expression: str) -> str | ToolResult:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: Arithmetic with + - * / // % ** and parentheses, e.g. "(17 + 25) * 3".
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return ToolResult(f"error: {e}", error=True)
