"""A calculator tool: arithmetic evaluated from the parsed syntax tree, never with ``eval``.

Numbers, + - * / // % **, unary signs, parentheses, and a few functions (abs, round, min, max,
sqrt). Results are exact for integers; a power's exponent and the size of integers are bounded
so a call cannot hang the process. Anything else is a clear error for the model to read.
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
MAX_EXPONENT = 1000
MAX_DIGITS = 4000
MAX_LENGTH = 1000


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
    return _eval(tree.body)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise CalculatorError("result too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        try:
            return _FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
        except (TypeError, ValueError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"unsupported syntax: {ast.unparse(node)!r}")


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
