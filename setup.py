"""Packaging beyond pyproject.toml: the wheel (and an editable install) also puts
``jax_agent_rl-verl-shim.pth`` into site-packages, so that the `verl` shim is on hand in every
Python of the environment (see jax_agent_rl_verl_shim/__init__.py)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "jax_agent_rl-verl-shim.pth"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth at the top of the wheel: in build_lib for a wheel; for an editable
    install straight into the editable wheel (install_lib), as setuptools does with data files,
    since it maps only packages from build_lib."""

    def run(self) -> None:
        super().run()
        top = self.get_finalized_command("install").install_lib if self.editable_mode else None
        self.copy_file(PTH, str(Path(top or self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
