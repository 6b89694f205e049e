"""A TPU host's chips split between its JetStream server and the trainer
(``engine.jetstream.chips``): the server opens the listed chips, the trainer the others.

Only one process can open a TPU chip, and the trainer's process opens every chip of its host
unless told otherwise. libtpu reads the chips a process opens from its environment before the
process starts its TPU backend, so each side gets its own:

- ``TPU_VISIBLE_CHIPS``: the host's chip indices the process opens;
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: their extent along x, y, z (a rectangle of the host's grid);
- ``TPU_PROCESS_BOUNDS``: the processes of the slice the process belongs to, along x, y, z;
- ``TPU_PROCESS_PORT`` / ``TPU_PROCESS_ADDRESSES`` / ``CLOUD_TPU_TASK_ID``: the server's own
  libtpu port, and itself as its slice's one process (a slice of its own beside the trainer's);
- ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu otherwise refuses a second process on the host.

What this relies on, read from public code (none of it run here, where there is no TPU):
JAX's own multi-process TPU tests set exactly these variables to give each process of a host its
chips (jax 0.10.2, ``jax/_src/test_multiprocess.py``); vLLM's TPU backend isolates its
data-parallel ranks on one host the same way, each a slice of its own with
``TPU_PROCESS_BOUNDS=1,1,1``, its own ``TPU_PROCESS_PORT`` and ``TPU_PROCESS_ADDRESSES=localhost:
<port>`` (vllm-project/tpu-inference ``tpu_inference/worker/tpu_worker.py``,
``_setup_dp_chip_isolation``); Ray sets ``TPU_VISIBLE_CHIPS`` and the bounds for actors that hold
part of a host (ray ``_private/accelerators/tpu.py``, after jax-ml/jax issue #14977).

Chip ``i`` of a host whose grid is ``X x Y x Z`` (the TPU VM's ``CHIPS_PER_HOST_BOUNDS``) sits at
``(i mod X, (i div X) mod Y, i div XY)``, the order ``jax.devices()`` lists a host's chips (x
fastest). A slice of several hosts (``HOST_BOUNDS``, hosts along x, y, z) runs one trainer
process per host, each beside its own server: the servers are independent slices, but the
trainer's processes form one slice of ``TPU_PROCESS_BOUNDS x TPU_CHIPS_PER_PROCESS_BOUNDS``
chips, so their chips must join into one rectangle of the slice: along every axis on which the
slice has several hosts, the trainer keeps the host's whole extent.

Standard library only: the trainer reads it before JAX starts a backend.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import urllib.request
from collections.abc import Sequence
from pathlib import Path

KEY = "engine.jetstream.chips"
# the TPU VM's description of its host and slice (its `tpu-env` metadata)
HOST_KEY, SLICE_KEY = "CHIPS_PER_HOST_BOUNDS", "HOST_BOUNDS"
_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"

Bounds = tuple[int, int, int]


class ChipSplitError(ValueError):
    """A chip split that cannot be: the message names ``engine.jetstream.chips``."""


@dataclasses.dataclass(frozen=True)
class TpuLayout:
    """A TPU VM's chips: ``host``, one host's chip grid (x, y, z); ``hosts``, the slice's hosts
    along x, y, z."""

    host: Bounds
    hosts: Bounds = (1, 1, 1)

    @property
    def chips(self) -> int:
        return math.prod(self.host)

    def coords(self, chip: int) -> Bounds:
        x, y, _ = self.host
        return chip % x, chip // x % y, chip // (x * y)


@dataclasses.dataclass(frozen=True)
class ChipSplit:
    """The server's chips and the trainer's on one host, each with its rectangle's extent
    (x, y, z), on a slice of ``hosts`` hosts."""

    server_chips: tuple[int, ...]
    server_box: Bounds
    trainer_chips: tuple[int, ...]
    trainer_box: Bounds
    hosts: Bounds

    def server_env(self, port: int) -> dict[str, str]:
        """The server's environment: its chips, as a slice of its own whose libtpu listens on
        ``port`` (the trainer's keeps libtpu's default)."""
        return {
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_VISIBLE_CHIPS": _shown(self.server_chips),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _shown(self.server_box),
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "CLOUD_TPU_TASK_ID": "0",
        }

    def trainer_env(self) -> dict[str, str]:
        """This host's trainer process's environment: the other chips, one process per host
        (libtpu finds the other hosts' processes, and its port, as it does without a split)."""
        return {
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_VISIBLE_CHIPS": _shown(self.trainer_chips),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _shown(self.trainer_box),
            "TPU_PROCESS_BOUNDS": _shown(self.hosts),
        }


# every variable either side sets (the server reports these from its own environment)
TPU_ENV_KEYS = (
    "ALLOW_MULTIPLE_LIBTPU_LOAD",
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_PORT",
    "TPU_PROCESS_ADDRESSES",
    "CLOUD_TPU_TASK_ID",
)


def parse_chips(text: str) -> tuple[int, ...]:
    """``"4,5,6,7"`` as chip indices; a bad list raises naming the key."""
    try:
        chips = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ChipSplitError(
            f"{KEY}={text!r}: expected the host's chip indices, comma-separated (e.g. 4,5,6,7)"
        ) from None
    twice = sorted({c for c in chips if chips.count(c) > 1})
    if twice:
        raise ChipSplitError(f"{KEY}={text!r} lists chip {twice[0]} twice")
    return chips


def _shown(bounds: Sequence[int]) -> str:
    return ",".join(map(str, bounds))


def _extent(chips: Sequence[int], layout: TpuLayout) -> Bounds | None:
    """The rectangle ``chips`` fill (x, y, z extents); None when they fill none."""
    coords = [layout.coords(c) for c in chips]
    lo = [min(c[a] for c in coords) for a in range(3)]
    hi = [max(c[a] for c in coords) for a in range(3)]
    extent = (hi[0] - lo[0] + 1, hi[1] - lo[1] + 1, hi[2] - lo[2] + 1)
    return extent if math.prod(extent) == len(chips) else None  # (the chips are distinct)


def split_chips(text: str, layout: TpuLayout) -> ChipSplit:
    """The chips of ``text`` for the server, the host's others for the trainer, on a host of
    ``layout``. Raises `ChipSplitError` for a split that cannot be: a chip outside the host or
    listed twice, no chip left to the trainer, either side's chips not a rectangle of the host,
    or (several hosts) the trainer's chips of every host not one rectangle of the slice."""
    chips = parse_chips(text)
    n, grid = layout.chips, f"{HOST_KEY}={_shown(layout.host)}"
    outside = [c for c in chips if not 0 <= c < n]
    if outside:
        raise ChipSplitError(
            f"{KEY}={text!r}: chip {outside[0]} is not on this host, whose {n} chips are "
            f"0..{n - 1} ({grid})"
        )
    rest = tuple(c for c in range(n) if c not in chips)
    if not rest:
        raise ChipSplitError(f"{KEY}={text!r} leaves the trainer no chip of the host's {n}")
    box = _extent(chips, layout)
    if box is None:
        raise ChipSplitError(
            f"{KEY}={text!r}: the server's chips are not a rectangle of the host's grid ({grid}; "
            "chip i at x = i mod X, y = i div X mod Y, z = i div XY)"
        )
    kept = _extent(rest, layout)
    if kept is None:
        raise ChipSplitError(
            f"{KEY}={text!r} leaves the trainer chips {_shown(rest)}, which are not a "
            f"rectangle of the host's grid ({grid}): give the server a side or an end of it"
        )
    split = [a for a in range(3) if layout.hosts[a] > 1 and kept[a] != layout.host[a]]
    if split:
        axis = "xyz"[split[0]]
        raise ChipSplitError(
            f"{KEY}={text!r}: on this slice of {_shown(layout.hosts)} hosts ({SLICE_KEY}) the "
            f"trainer's processes form one slice, but their chips {_shown(rest)} of every host "
            f"span {kept[split[0]]} of the host's {layout.host[split[0]]} along {axis}, where "
            "the slice has several hosts: the trainer's chips of all hosts are then no "
            f"rectangle. Keep the trainer the host's whole extent along {axis}, or use a "
            "one-host slice"
        )
    return ChipSplit(chips, box, rest, kept, layout.hosts)


def _bounds(key: str, text: str) -> Bounds:
    try:
        x, y, z = (int(v) for v in text.strip().strip("'\"").split(","))
    except ValueError:
        raise ChipSplitError(f"{KEY}: {key}={text!r} is not x,y,z") from None
    if min(x, y, z) < 1:
        raise ChipSplitError(f"{KEY}: {key}={text!r} is not x,y,z of positive counts")
    return x, y, z


def on_tpu_vm() -> bool:
    """Whether this host has TPU chips (their device files: /dev/accel* on v4 and older,
    /dev/vfio/<group> on v5e and newer)."""
    dev = Path("/dev")
    return any(dev.glob("accel*")) or any(dev.glob("vfio/[0-9]*"))


def _metadata_tpu_env() -> dict[str, str]:
    """The TPU VM's ``tpu-env`` metadata (lines ``KEY: 'value'``), as JAX's Cloud TPU cluster
    detection reads it."""
    request = urllib.request.Request(_METADATA, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def host_layout() -> TpuLayout:
    """This host's chips and its slice's hosts: ``CHIPS_PER_HOST_BOUNDS`` / ``HOST_BOUNDS`` from
    the environment, else from the TPU VM's metadata; raises naming the key off a TPU VM that
    does not say (no TPU here: nothing to split)."""
    env = {k: os.environ[k] for k in (HOST_KEY, SLICE_KEY) if k in os.environ}
    if HOST_KEY not in env:
        if not on_tpu_vm():
            raise ChipSplitError(
                f"{KEY} splits a TPU host's chips, and this host has none (no /dev/accel*, "
                f"/dev/vfio/<n>) nor {HOST_KEY} in the environment: leave {KEY} empty"
            )
        try:
            env = {**_metadata_tpu_env(), **env}
        except OSError as e:
            raise ChipSplitError(f"{KEY}: cannot read the TPU VM's tpu-env metadata: {e}") from e
        if HOST_KEY not in env:
            raise ChipSplitError(f"{KEY}: the TPU VM's tpu-env metadata has no {HOST_KEY}")
    hosts = _bounds(SLICE_KEY, env[SLICE_KEY]) if SLICE_KEY in env else (1, 1, 1)
    return TpuLayout(_bounds(HOST_KEY, env[HOST_KEY]), hosts)


def chip_problems(text: str, processes: int, slots: int) -> list[str]:
    """The pre-run check of ``engine.jetstream.chips=text`` in a run of ``processes``
    processes whose servers decode ``slots`` sequences each: the split on this host, one
    trainer process per host of the slice (each starts its own server on the same chips of its
    host), and the slots split over the server's chips."""
    if not text:
        return []
    try:
        layout = host_layout()
        split = split_chips(text, layout)
    except ChipSplitError as e:
        return [str(e)]
    problems = []
    hosts = math.prod(layout.hosts)
    if processes != hosts:
        problems.append(
            f"{KEY}={text!r}: the run has {processes} processes and the slice {hosts} hosts "
            f"({SLICE_KEY}={_shown(layout.hosts)}): each host runs one trainer process, beside "
            "its own JetStream server on those chips (two processes of a host would start two "
            "servers on them)"
        )
    chips = len(split.server_chips)
    if slots % chips:
        problems.append(
            f"engine.max_concurrent={slots} does not split over the JetStream server's "
            f"{chips} chips ({KEY}={text!r}; its decode slots): use a multiple of {chips}"
        )
    return problems


def trainer_env(text: str) -> dict[str, str]:
    """What `jarl train` sets in its own process before JAX starts: the host's chips the
    server of ``engine.jetstream.chips=text`` leaves to the trainer (empty: nothing)."""
    return split_chips(text, host_layout()).trainer_env() if text else {}


def free_port() -> int:
    """A port free now on this host (the server's libtpu listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
