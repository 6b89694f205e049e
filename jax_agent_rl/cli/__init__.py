"""The ``jarl`` command line (``python -m jax_agent_rl.cli``): `main` reads the arguments with
`build_parser` and runs the command's handler, which imports what it needs when it runs.

Modules: `commands` (the parser and most commands), `serve_tools` (``jarl serve-tools``),
`view` (``jarl view``), `compile_cache` (compiled programs kept between runs).
"""

from jax_agent_rl.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
