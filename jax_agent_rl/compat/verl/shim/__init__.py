"""The `verl` shim: verl tool modules, ``BaseTool`` subclasses, interaction classes and reward
modules import unchanged, with or without verl installed.

The folder ``verl/`` beside this file holds a package named ``verl`` whose modules are the
names such files import (``verl.tools.base_tool``, ``verl.tools.schemas``,
``verl.tools.function_tool``, ``verl.tools.gsm8k_tool`` (verl's own GSM8K tool, which its tool
YAML names), ``verl.utils.rollout_trace``, ``verl.utils.reward_score`` and its
``gsm8k`` / ``math_reward`` / ``math_dapo`` / ``search_r1_like_qa_em``, ``verl.interactions.
base`` and ``verl.interactions.gsm8k_interaction`` (verl's own, which its YAML names)); each
re-exports jax_agent_rl's implementation under verl's name.

`install` appends `VerlShimFinder` to the END of ``sys.meta_path``: Python asks it for ``verl``
only after every regular finder found none, so a real verl anywhere on ``sys.path`` always wins.
Once the shim's ``verl`` is imported, its ``__path__`` serves its submodules; any other
``verl.*`` (``verl.protocol``, trainers, workers) is refused with an ImportError naming the
shim.

`install` runs where user code is loaded (`jax_agent_rl.usercode.load`, through
`jax_agent_rl.config.wings.install_shims`: every module or file a config or YAML names), never on
``import jax_agent_rl`` nor at the environment's start-up, so ``import verl`` fails where verl
is not installed and nothing loaded it. A script of one's own turns it on with ``import
jax_agent_rl.compat.verl.shim as shim; shim.install()``. Turning it on imports only this file
and the two empty packages above it (standard library imports), not the verl wing's hooks.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

SHIM_ROOT = Path(__file__).resolve().parent / "verl"

PROVIDED = (
    "verl.tools.base_tool",
    "verl.tools.schemas",
    "verl.tools.function_tool",
    "verl.tools.gsm8k_tool",
    "verl.utils.rollout_trace",
    "verl.utils.reward_score",
    "verl.utils.reward_score.gsm8k",
    "verl.utils.reward_score.math_reward",
    "verl.utils.reward_score.math_dapo",
    "verl.utils.reward_score.search_r1_like_qa_em",
    "verl.interactions.base",
    "verl.interactions.gsm8k_interaction",
)


def is_shim(module: ModuleType | None) -> bool:
    """Whether ``module`` (e.g. ``sys.modules.get("verl")``) is the shim's ``verl``."""
    return module is not None and Path(getattr(module, "__file__", "") or "").parent == SHIM_ROOT


class VerlShimFinder:
    """A meta path finder for ``verl`` (the shim's package, when no earlier finder has one)
    and for the ``verl.*`` modules the shim lacks (an ImportError that says so)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        del path, target
        if fullname == "verl":
            return importlib.util.spec_from_file_location(
                "verl", SHIM_ROOT / "__init__.py", submodule_search_locations=[str(SHIM_ROOT)]
            )
        if fullname.startswith("verl.") and is_shim(sys.modules.get("verl")):
            raise ModuleNotFoundError(
                f"jax_agent_rl's verl shim provides only {', '.join(PROVIDED)}; install verl "
                f"for {fullname}",
                name=fullname,
            )
        return None


def install() -> None:
    """Appends one `VerlShimFinder` to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, VerlShimFinder) for f in sys.meta_path):
        sys.meta_path.append(VerlShimFinder())
