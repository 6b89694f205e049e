"""Which policy answers may reach a reasoning-gym scorer that evaluates its answer as Python.

Some of reasoning-gym's scorers (0.1.25) hand the answer to ``eval`` (those that read a list
the model wrote: `EVAL_TASKS`) or to sympy's ``parse_expr``, which ``eval``s it too, after
rewriting its tokens (those that read an expression: `SYMPY_TASKS`). The answer is the policy's
text, and the scorer runs in the trainer's process: ``__import__('os')...`` in an answer ran
there, with every power the process has (raising its own reward by patching the scorer,
another episode's, ending the run), and ``9**9**9**9`` held the interpreter's lock for good.
So an answer reaches such a scorer only when `harmless` says it runs no code and stays small:

- for `EVAL_TASKS`, a Python literal (numbers, strings, names, lists, tuples, sets, dicts, a
  sign on a number), or text that is no Python expression at all (``eval`` refuses it before running
  anything, and the scorer then compares the text);
- for `SYMPY_TASKS`, an arithmetic expression: numbers up to `MAX_INTEGER`, names (a variable,
  ``pi``), ``+ - * / // % ^`` and ``**`` whose exponent is a number within `MAX_EXPONENT` (or
  a ratio of two, or a name) and whose base holds no power, calls of the functions in
  `FUNCTIONS`, at most `MAX_NODES` syntax nodes. Text that is no Python expression is refused
  too: sympy's rewriting turns some of it into code (``...!`` becomes ``factorial(...)``).

Anything else scores 0 without calling the scorer.
"""

from __future__ import annotations

import ast
from typing import Any

EVAL_TASKS = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
SYMPY_TASKS = frozenset(
    {
        "countdown",
        "intermediate_integration",
        "polynomial_multiplication",
        "puzzle24",
        "simple_integration",
    }
)
FUNCTIONS = frozenset(
    {
        *("sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan"),
        *("sinh", "cosh", "tanh", "asinh", "acosh", "atanh"),
        *("exp", "log", "ln", "sqrt", "Abs", "abs"),
    }
)
MAX_NODES = 1000
MAX_INTEGER = 10**18
MAX_EXPONENT = 100
MAX_ARGUMENTS = 2

_LITERAL = (ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Load)
_SIGN = (ast.UAdd, ast.USub)
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitXor)


def harmless(task: str, answer: str) -> bool:
    """Whether ``answer`` may reach ``task``'s scorer (see the module docstring)."""
    if task not in EVAL_TASKS and task not in SYMPY_TASKS:
        return True
    try:  # (eval drops leading spaces and tabs)
        tree = ast.parse(answer.lstrip(" \t"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # eval fails as well
        return task in EVAL_TASKS
    if task in EVAL_TASKS:
        return all(_literal(node) for node in ast.walk(tree))
    nodes = list(ast.walk(tree))
    return len(nodes) <= MAX_NODES and all(_arithmetic(node) for node in nodes)


def _literal(node: ast.AST) -> bool:
    """One node of a literal `harmless` lets ``eval`` read: a name counts (a word the model
    answered: it only looks the name up), nothing that calls or reaches into an object."""
    if isinstance(node, ast.Name):
        return not node.id.startswith("_")
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, _SIGN) and isinstance(node.operand, ast.Constant)
    return isinstance(node, (*_LITERAL, *_SIGN))


def _arithmetic(node: ast.AST) -> bool:
    """One node of an expression `harmless` lets sympy read (its children are checked on
    their own)."""
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.Name):
        return not node.id.startswith("_")
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return _small_exponent(node.right) and not _holds_power(node.left)
        return isinstance(node.op, _ARITHMETIC)
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Name)
            and node.func.id in FUNCTIONS
            and not node.keywords
            and len(node.args) <= MAX_ARGUMENTS
            and not any(isinstance(a, ast.Starred) for a in node.args)
        )
    return isinstance(node, (ast.Expression, ast.UnaryOp, ast.Load, ast.Pow, *_SIGN, *_ARITHMETIC))


def _number(value: object) -> bool:
    """An int within `MAX_INTEGER` or a float (a string would be parsed as an expression in
    turn by the sympy function it is given to; a bool is no number here)."""
    if type(value) is int:
        return abs(value) <= MAX_INTEGER
    return type(value) is float


def _small_exponent(node: ast.AST) -> bool:
    """A name, or a number within `MAX_EXPONENT` (signed), or a ratio of two: a power can
    then have at most `MAX_EXPONENT` times the digits of its base."""
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _SIGN):
        return _small_exponent(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return all(isinstance(n, ast.Constant) for n in (node.left, node.right)) and all(
            _small_exponent(n) for n in (node.left, node.right)
        )
    value: Any = node.value if isinstance(node, ast.Constant) else None
    return _number(value) and abs(value) <= MAX_EXPONENT


def _holds_power(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) for n in ast.walk(node))
