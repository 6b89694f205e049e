"""XLA's programs kept between runs: JAX's persistent compilation cache, on by default.

A run compiles dozens of programs (the engine's prefill and decode buckets, the learner's
update): minutes on a CPU host, and as long again in the next run of the same config without a
cache. `enable` turns JAX's persistent cache on before JAX starts, in a folder shared by the
user's runs (`default_folder`: ``$XDG_CACHE_HOME/jax_agent_rl/xla-<cpu kind>``, else
``~/.cache/...``), through the environment, so the run's child processes (the processes of a
multi-process run, Ray actors, tool servers that compile) read and write it too. JAX keys an
entry on the program, its compile options, the devices and jaxlib's version; XLA:CPU compiles
for the host's instruction set, which the key does not hold, so the folder is named by the
CPU's model and flags (`cpu_kind`) and a cache copied from another machine is not read.

A folder already set in ``JAX_COMPILATION_CACHE_DIR`` is used as it is.
(`progress.CacheHits` counts the programs loaded from the cache for the progress lines.)
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

ENV = "JAX_COMPILATION_CACHE_DIR"
# programs that compile faster than this are not written (JAX's own floor is 1 s; the engine's
# small buckets compile in ~0.5 s on a CPU host, and a run has dozens of them)
MIN_COMPILE_S = "0.2"


def cpu_kind() -> str:
    """The host CPU's model and instruction-set flags, hashed (12 hex digits)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    kind = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(kind).encode()).hexdigest()[:12]


def default_folder() -> Path:
    """Where a run keeps its compiled programs unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jax_agent_rl" / f"xla-{cpu_kind()}"


def enable(folder: Path | None) -> Path | None:
    """Turns the persistent cache on in ``folder`` (None: off), for this process and the ones
    it starts; a folder already in ``JAX_COMPILATION_CACHE_DIR`` wins. Call before JAX starts
    a backend. Returns the folder in use, or None. A folder that cannot be made (or written)
    leaves the cache off, said on stderr: a run does not fail for want of a cache."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"this user may not write {folder}")
    except OSError as e:
        why = e.strerror or str(e)
        print(f"jarl: note: compile cache {folder}: {why}; compiling without one", file=sys.stderr)
        return None
    os.environ[ENV] = str(folder)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", MIN_COMPILE_S)
    import jax  # (the environment is read when jax is imported; set it too if it was)

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    return folder
