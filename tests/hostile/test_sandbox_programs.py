"""The python sandbox runs a program as ``python -c`` runs it. It ran code in a bare dict named
``__main__`` while ``sys.modules["__main__"]`` was the fork server's own module: ordinary code
that looks its own names up by module failed: ``pickle`` of its classes and functions (so
``multiprocessing.Pool.map`` of a function it defines), ``typing.get_type_hints`` of its
forward references, ``import __main__``; and ``unittest.main()`` and ``doctest.testmod()``
looked for tests in the fork server's module, found none and reported success ("Ran 0
tests ... OK"): a policy checking its code with tests was told they passed. Code now runs
in a fresh module that is ``sys.modules["__main__"]``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from jax_agent_rl.tools.sandbox import Limits, PythonSandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[PythonSandbox]:
    sb = PythonSandbox(size=1, limits=Limits(cpu_s=10, memory_mb=512, processes=8), timeout_s=60.0)
    yield sb
    sb.close()


OWN_NAMES = {
    "pickle": (
        "import pickle\nclass P:\n    x = 1\nprint(type(pickle.loads(pickle.dumps(P()))).__name__)",
        "P",
    ),
    "multiprocessing": (
        "import multiprocessing\ndef sq(x):\n    return x * x\n"
        "with multiprocessing.Pool(2) as p:\n    print(p.map(sq, [1, 2, 3]))",
        "[1, 4, 9]",
    ),
    "type hints": (
        "import typing\nclass Node:\n    nxt: 'Node'\n"
        "print(typing.get_type_hints(Node)['nxt'].__name__)",
        "Node",
    ),
    "import __main__": ("import __main__\nX = 5\nprint(__main__.X)", "5"),
    # these found nothing and said so quietly: "Ran 0 tests ... OK", "attempted=0"
    "unittest.main": (
        "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n"
        "        self.assertEqual(1 + 1, 2)\n"
        "print(unittest.main(exit=False, argv=['x']).result.testsRun)",
        "1",
    ),
    "doctest.testmod": (
        'def f(x):\n    """\n    >>> f(2)\n    4\n    """\n    return x * x\n'
        "import doctest\nprint(doctest.testmod().attempted)",
        "1",
    ),
}


@pytest.mark.parametrize("name", sorted(OWN_NAMES))
def test_code_finds_its_own_names_through_its_main_module(
    sandbox: PythonSandbox, name: str
) -> None:
    code, printed = OWN_NAMES[name]
    result = asyncio.run(sandbox.run(code))
    assert (result.exit_code, result.stdout.strip()) == (0, printed), result.stderr


@pytest.mark.parametrize(
    ("code", "status"), [(3, 3), (256 + 7, 7), (-1, 255), (2**64 + 5, 5), ("'bye'", 1)]
)
def test_an_exit_status_is_its_low_byte_as_the_kernel_keeps_it(
    sandbox: PythonSandbox, code: object, status: int
) -> None:
    """``sys.exit(2**64)`` overflowed the fork server's ``os._exit`` and printed the fork
    server's own traceback (its file and line numbers) as the execution's stderr."""
    done = asyncio.run(sandbox.run(f"import sys\nsys.exit({code})"))
    assert done.exit_code == status and "Traceback" not in done.stderr, done.as_text()
    assert done.stderr == ("bye\n" if code == "'bye'" else ""), done.as_text()
