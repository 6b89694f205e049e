"""Cloud TPU slices by name: how many chips, their HBM, peak bf16 FLOP/s and HBM bandwidth, and
the topology libtpu compiles for (`Topology.devices`: abstract devices on a CPU-only host).

Names: Google's ``<generation>-<N>`` (``v5e-16``, ``v6e-8``: N chips; ``v5p-32``: N
TensorCores, two per chip, so 16 chips) or the topology itself (``v5e:4x4``, ``v5p:2x2x4``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's chip. Google's published figures (cloud.google.com/tpu/docs: the
    v5e, v5p and v6e (Trillium) system architecture pages): HBM per chip, peak bf16 FLOP/s per
    chip, HBM bandwidth per chip."""

    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float  # bytes/s
    cores_per_chip: int  # TensorCores a ``<generation>-<N>`` name counts per chip
    shapes: dict[int, str]  # chips -> the topology of a slice of that many


_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
}
CHIPS = {
    "v5e": Chip(16 * GiB, 197e12, 819e9, 1, _2D),
    "v5p": Chip(95 * GiB, 459e12, 2765e9, 2, _3D),
    "v6e": Chip(32 * GiB, 918e12, 1640e9, 1, _2D),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice: ``generation`` (v5e, v5p, v6e) and its chip grid ``shape`` ("4x4")."""

    generation: str
    shape: str

    @property
    def name(self) -> str:
        """libtpu's name of the topology, ``v5e:4x4``."""
        return f"{self.generation}:{self.shape}"

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    @property
    def chips(self) -> int:
        return math.prod(int(n) for n in self.shape.split("x"))

    @property
    def devices(self) -> list[Any]:
        """The slice's abstract TPU devices (one per chip), for compiling on this host."""
        # libtpu guards a real TPU with a lock file; compiling only, several processes may
        # load it at once (tests, a bench beside a plan)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        if (problem := libtpu_problem()) is not None:
            raise RuntimeError(problem)

        with _without_tpu_vm_warnings():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=self.name)
        return list(desc.devices)


# What libtpu writes on its first load on a host that is no TPU VM (it finds no accelerator
# type or worker hostnames in the VM's metadata): five lines of warnings and an E0000 "error",
# none of which matters to compiling for abstract devices
_TPU_VM_WARNINGS = (
    "could not determine TPU",
    "Logging before InitGoogle()",
    "unexpected worker hostname",
    "=== Source Location Trace: ===",
    "libtpu_init_utils.cc",
)


@contextlib.contextmanager
def _without_tpu_vm_warnings() -> Iterator[None]:
    """Runs the block with the process's stderr (fd 2, where libtpu writes) in a file, then
    writes what it got to stderr but `_TPU_VM_WARNINGS`' lines: `jarl plan` printed them on the
    user's terminal before its report."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode("utf-8", "replace").splitlines(keepends=True):
                if not any(warning in line for warning in _TPU_VM_WARNINGS):
                    sys.stderr.write(line)


def libtpu_problem() -> str | None:
    """Why this environment cannot compile for TPU (no libtpu), or None."""
    if importlib.util.find_spec("libtpu") is None:
        return (
            "compiling for TPU needs libtpu in this environment: run `scripts/setup.sh tpu-plan` "
            "(the pinned release, requirements/tpu-lock.txt)"
        )
    return None


def accepted_topologies() -> list[str]:
    """Every name `parse_topology` accepts, in both spellings."""
    names = []
    for generation, chip in CHIPS.items():
        for chips, shape in chip.shapes.items():
            names.append(f"{generation}-{chips * chip.cores_per_chip}")
            names.append(f"{generation}:{shape}")
    return names


def parse_topology(text: str) -> Topology:
    """The slice ``text`` names (``v5e-16``, ``v5e:4x4``, ``v5p-32``...); a `ValueError`
    naming the accepted names otherwise."""
    generation, sep, rest = text.partition(":" if ":" in text else "-")
    chip = CHIPS.get(generation)
    if chip is not None and sep == ":" and rest in chip.shapes.values():
        return Topology(generation, rest)
    if chip is not None and sep == "-" and rest.isdigit():
        cores = int(rest)
        if cores % chip.cores_per_chip == 0 and cores // chip.cores_per_chip in chip.shapes:
            return Topology(generation, chip.shapes[cores // chip.cores_per_chip])
    raise ValueError(
        f"--topology {text!r} is not a TPU slice this plan knows: use one of "
        + ", ".join(accepted_topologies())
        + " (v5p-N counts TensorCores, two per chip)"
    )
