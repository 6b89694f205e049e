"""The suite's compile level (tests/conftest.py): a module not marked ``compute_bound`` has
its XLA programs compiled at LLVM O0 without XLA:CPU's fusion emitters, and the processes it
starts inherit the choice."""

import os
import subprocess
import sys

import jax
from jax._src import compiler

from tests.conftest import _FULL_OPTIMIZATION_ONLY, FAST_COMPILE


def test_an_unmarked_module_compiles_at_o0_and_its_child_processes_too() -> None:
    want = not _FULL_OPTIMIZATION_ONLY  # JAX_DISABLE_MOST_OPTIMIZATIONS=0: all optimized
    assert jax.config.values["jax_disable_most_optimizations"] is want
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import jax, os; print(jax.config.values['jax_disable_most_optimizations'], "
            "'--xla_cpu_use_fusion_emitters=false' in os.environ.get('XLA_FLAGS', ''))",
        ],
        env=os.environ,
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == [str(want), str(want)]
    overrides = dict(compiler.get_compile_options(1, 1).env_option_overrides)
    assert (overrides == FAST_COMPILE) is want
