"""Compiled programs kept between runs (`jax_agent_rl.cli.compile_cache`): a second process
loads what the first compiled, counted for the progress lines (`progress.CacheHits`), in the
user's cache folder by default, and nowhere with ``--no-compile-cache``. Each case runs in a
process of its own with no compilation cache in its environment (the suite's own is unset)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_agent_rl.cli.compile_cache import cpu_kind

PROGRAM = """
import sys
from pathlib import Path
from jax_agent_rl.cli import compile_cache
from jax_agent_rl.console.progress import CacheHits
folder = compile_cache.enable(compile_cache.default_folder())
import jax, jax.numpy as jnp
hits = CacheHits()
f = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) @ x.T, axis=0).sum())
f(jnp.ones((64, 64))).block_until_ready()
hits.close()
print(folder, hits.count)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    # every program is written, however fast it compiled (the product's floor is a setting)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def test_a_second_process_loads_the_program_the_first_compiled(tmp_path: Path) -> None:
    env = _env(tmp_path)
    runs = [
        subprocess.run(
            [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    folder = tmp_path / "xdg" / "jax_agent_rl" / f"xla-{cpu_kind()}"
    # the first compiles every program (the function, and jnp.ones's), the second loads them
    assert [r[0] for r in runs] == [str(folder)] * 2 and any(folder.iterdir())
    assert int(runs[0][1]) == 0 and int(runs[1][1]) >= 1


@pytest.mark.parametrize("flags", [[], ["--no-compile-cache"]])
def test_jarl_sets_the_cache_for_its_children_unless_told_not_to(
    tmp_path: Path, flags: list[str]
) -> None:
    """`jarl config` (no compile at all) with the cache on or off: the folder is made and
    handed to the processes a run starts, through the environment, or nothing is."""
    probe = (
        "import os, sys; from jax_agent_rl.cli import main; "
        "main(sys.argv[1:]); print(os.environ.get('JAX_COMPILATION_CACHE_DIR'))"
    )
    env = _env(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", probe, *flags, "config"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[-1]
    folder = tmp_path / "xdg" / "jax_agent_rl" / f"xla-{cpu_kind()}"
    assert out == ("None" if flags else str(folder))
    assert folder.is_dir() != bool(flags)


def test_a_folder_that_cannot_be_made_leaves_the_cache_off_and_says_so(tmp_path: Path) -> None:
    """A file where the folder should be: the run goes on without a cache, and one line says
    why (no traceback, no silent default)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    probe = (
        "import os, sys; from jax_agent_rl.cli import main; "
        "main(sys.argv[1:]); print(os.environ.get('JAX_COMPILATION_CACHE_DIR'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "--compile-cache", str(blocker / "cc"), "config"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "None"
    assert done.stderr == (
        f"jarl: note: compile cache {blocker / 'cc'}: Not a directory; compiling without one\n"
    )
