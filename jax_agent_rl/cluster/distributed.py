"""Multi-controller runs: every host runs the same program as one JAX process.

`initialize` joins the processes (`jax.distributed`): the coordinator and process ids come from
the TPU environment, or from ``--coordinator``, ``--num-processes``, ``--process-id`` (CUDA
nodes, and CPU processes in tests, whose collectives then go over gloo). After it, one mesh
spans the devices of every process, and the learner's state is sharded over it.

What stays per process, and the few host-side exchanges that make it one run:

- `process_mesh`: this process's part of the run's mesh; the embedded engine serves on it,
  and `local_replica` puts the learner's new global params there after every update (a
  collective reshard on the devices, then this process's shards reused as they are: no file,
  no copy through the host).
- `gather_objects` / `agree_max`: Python values of every process (trajectories for metrics and
  traces, batch lengths, refill counts), through the devices' collectives.
- `host_copy`: a global array as one host array on every process (the exported policy).
- `Liveness`: each process beats in the coordinator's key-value store; when a collective
  fails, `silent_processes` names the processes whose beats stopped (a dead host), so the run
  stops with a message naming it instead of an anonymous socket error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jax_agent_rl.models.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How to join the run's processes. ``auto``: let JAX find the cluster (a TPU VM slice,
    a SLURM job step); else the coordinator's ``host:port`` and this process's id (0 hosts the
    coordinator). ``heartbeat_timeout_s``: how long a silent process counts as alive."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    auto: bool = False
    heartbeat_timeout_s: int = 100

    @property
    def multi(self) -> bool:
        return self.auto or self.num_processes > 1

    def problems(self) -> list[str]:
        out = []
        if self.heartbeat_timeout_s < 1:
            out.append(f"--heartbeat-timeout={self.heartbeat_timeout_s} must be >= 1 (seconds)")
        if self.auto:
            if self.coordinator is not None or self.num_processes != 1:
                out.append("--distributed finds the cluster: drop --coordinator, --num-processes")
            return out
        if self.num_processes < 1:
            out.append(f"--num-processes={self.num_processes} must be >= 1")
        elif not 0 <= self.process_id < self.num_processes:
            out.append(f"--process-id={self.process_id} must be in [0, {self.num_processes})")
        if self.num_processes > 1 and not self.coordinator:
            out.append("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
        if self.coordinator and self.num_processes == 1:
            out.append("--coordinator needs --num-processes > 1")
        if self.coordinator:
            out += _address_problems(self.coordinator)
        return out


def _address_problems(coordinator: str) -> list[str]:
    """What makes ``coordinator`` no ``HOST:PORT`` JAX can join (without a port, JAX's
    address parser raised IndexError)."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdecimal():
        return [f"--coordinator={coordinator!r}: expected HOST:PORT (process 0's address)"]
    if not 1 <= int(port) <= 65535:
        return [f"--coordinator={coordinator!r}: expected a port in [1, 65535]"]
    return []


def initialize(group: ProcessGroup) -> int:
    """Joins the processes (before JAX's first operation: no backend is started here), starts
    this one's `Liveness` beat, and returns the number of processes."""
    if not group.multi:
        return 1
    if group.auto:
        jax.distributed.initialize(heartbeat_timeout_seconds=group.heartbeat_timeout_s)
    else:
        jax.distributed.initialize(
            group.coordinator,
            group.num_processes,
            group.process_id,
            heartbeat_timeout_seconds=group.heartbeat_timeout_s,
        )
    Liveness.start()
    return joined_processes()


def joined_processes() -> int:
    """The processes `initialize` joined (1 when it did not), known before a backend starts
    (unlike ``jax.process_count()``, which starts them)."""
    from jax._src.distributed import global_state

    return int(global_state.num_processes) if global_state.client is not None else 1


def barrier(name: str) -> None:
    """Every process waits here until all have come (a device collective: no time limit)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
    """Process 0: the one that writes metrics, traces, plots and exports."""
    return jax.process_index() == 0


def ordered_devices() -> list[Any]:
    """All devices, each process's together (process 0's first), so that every process holds
    one contiguous block of a mesh's leading axes."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def process_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of ``mesh`` as a mesh of the same axes: a contiguous block (see
    `ordered_devices`) with whole ``tensor`` groups, folded into ``data`` x 1 x ``tensor``."""
    if jax.process_count() == 1:
        return mesh
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    tensor = mesh.shape["tensor"]
    if not mine or len(mine) % tensor:
        raise ValueError(
            f"process {jax.process_index()} holds {len(mine)} of the mesh's devices: the mesh "
            f"must span every process's devices with whole tensor={tensor} groups"
        )
    return make_mesh(len(mine) // tensor, 1, tensor, devices=mine)


def local_replica(tree: Any, shardings: Any, local: Any) -> Any:
    """``tree`` (global arrays) laid out by ``shardings`` on the global inference mesh (only
    ``tensor`` splits, so every process's devices hold all of it), then as arrays of this
    process's mesh laid out by ``local``: the same device buffers, no host copy. One
    process: ``tree`` as it is."""
    if jax.process_count() == 1:  # the engine lays them out itself, on the same devices
        return tree
    placed = _reshard(tree, shardings)

    def wrap(x: jax.Array, target: NamedSharding) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [s.data for s in x.addressable_shards]
        )

    return jax.tree.map(wrap, placed, local)


_RESHARD: dict[Any, Callable[[Any], Any]] = {}


def _reshard(tree: Any, shardings: Any) -> Any:
    key = jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings))
    if key not in _RESHARD:
        _RESHARD[key] = jax.jit(lambda t: t, out_shardings=shardings)
    return _RESHARD[key](tree)


def host_copy(tree: Any) -> Any:
    """Every leaf whole as a host numpy array, on every process (a collective when a leaf is
    spread over several processes)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every process, in process order (a collective: every process calls it).
    Every device holds every process's bytes for a moment: for small values (totals, flags),
    not for trajectories."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64)).reshape(-1)
    # a power of two: the all-gather compiles once per size class, not once per call
    padded = np.zeros(1 << int(sizes.max() - 1).bit_length(), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded).reshape(len(sizes), -1)
    return [pickle.loads(rows[i, : sizes[i]].tobytes()) for i in range(len(sizes))]


def problems_of_every_process(problems: Sequence[str]) -> list[str]:
    """Every process's problems (a collective), those not found by all processes named by the
    processes that found them: a file missing on one host stops every host, saying which."""
    shares = gather_objects(list(problems))
    finders: dict[str, list[int]] = {}
    for i, share in enumerate(shares):
        for problem in share:
            finders.setdefault(problem, []).append(i)
    return [
        p if len(ids) == len(shares) else f"on process {', '.join(map(str, ids))}: {p}"
        for p, ids in finders.items()
    ]


def check_shared_folder(path: Path, key: str) -> None:
    """Raises unless every process sees one folder at ``path`` (a collective): process 0
    writes a fresh token there, and every process must read it back."""
    if jax.process_count() == 1:
        return
    marker = path / ".jarl-shared"
    if is_primary():
        marker.write_text(secrets.token_hex(16))
    token = gather_objects(marker.read_text() if is_primary() else None)[0]
    seen = marker.read_text() if marker.is_file() else None
    blind = [i for i, ok in enumerate(gather_objects(seen == token)) if not ok]
    if blind:
        raise ValueError(
            f"{key}={path} is not one folder shared by every host: process "
            f"{', '.join(map(str, blind))} does not see process 0's files there. All processes "
            "write the checkpoints there: use a folder every host mounts (docs/tpu.md)"
        )


def same_on_every_process(value: Any, what: str) -> Any:
    """``value``, after checking every process has the same (a collective)."""
    values = gather_objects(value)
    if any(v != values[0] for v in values):
        raise ValueError(f"the processes disagree on {what}: {values} (process 0 first)")
    return value


def agree_max(values: Sequence[int]) -> list[int]:
    """The element-wise maximum over processes of ``values`` (a collective)."""
    if jax.process_count() == 1:
        return list(values)
    got = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return [int(v) for v in np.asarray(got).reshape(-1, len(values)).max(axis=0)]


class Liveness:
    """Each process's beat counter in the coordinator's key-value store, bumped every
    ``INTERVAL_S`` by a daemon thread. A process is silent when its counter does not move
    while others' do: it died (or its host did), since the thread beats through compiles,
    steps and collectives alike."""

    INTERVAL_S = 1.0
    _KEY = "jax_agent_rl/beat/{}"
    _FAILED = "jax_agent_rl/failed/"

    @classmethod
    def start(cls) -> None:
        """Before any backend starts (``jax.process_index()`` would start them)."""
        from jax._src.distributed import global_state

        client = _client()
        key = cls._KEY.format(global_state.process_id)

        def beat() -> None:
            n = 0
            while True:
                n += 1
                # a failed beat (a dropped RPC, or the coordinator gone) is tried again: a
                # process that stopped beating is taken for dead
                with contextlib.suppress(Exception):
                    client.key_value_set(key, str(n), allow_overwrite=True)
                time.sleep(cls.INTERVAL_S)

        threading.Thread(target=beat, name="jarl-liveness", daemon=True).start()

    @classmethod
    def silent_processes(cls, watch_s: float = 10.0) -> list[int] | None:
        """Processes whose beat did not move in ``watch_s`` seconds; None when the coordinator
        (process 0) cannot be reached, which means process 0 is gone."""
        client = _client()
        ids = range(jax.process_count())

        def beats() -> list[str | None]:
            out = []
            for i in ids:
                try:
                    out.append(client.key_value_try_get(cls._KEY.format(i)))
                except Exception as e:  # a process that never beat has no key yet
                    if "NOT_FOUND" not in str(e):
                        raise
                    out.append(None)
            return out

        try:
            before = beats()
            time.sleep(watch_s)
            after = beats()
        except Exception:
            return None
        return [i for i in ids if i != jax.process_index() and before[i] == after[i]]

    @classmethod
    def report_failure(cls, text: str) -> None:
        """Tells the other processes why this one is stopping (read by `failures`)."""
        with contextlib.suppress(Exception):  # the coordinator may be gone already
            _client().key_value_set(f"{cls._FAILED}{jax.process_index()}", text)

    @classmethod
    def await_reports(cls, timeout_s: float = 10.0) -> None:
        """Until every other process has reported a failure, or ``timeout_s`` passed. Process 0
        waits so before it exits: the coordinator goes with it, and JAX aborts a process whose
        coordinator vanished before that process could report and exit by itself."""
        deadline = time.monotonic() + timeout_s
        while len(cls.failures()) < jax.process_count() and time.monotonic() < deadline:
            time.sleep(0.2)

    @classmethod
    def failures(cls) -> dict[int, str]:
        """The processes that reported a failure of their own, and why."""
        try:
            entries = _client().key_value_dir_get(cls._FAILED)
        except Exception:
            return {}
        return {int(key.rsplit("/", 1)[1]): text for key, text in entries}


def is_communication_error(error: BaseException) -> bool:
    """An error from an exchange with other processes (a collective whose peer is gone, the
    coordination service unreachable), rather than this process's own."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error)
    signs = ("Gloo", "onnection", "UNAVAILABLE", "DEADLINE_EXCEEDED", "heartbeat", "coordinat")
    return any(sign in text for sign in signs)


def _client() -> Any:
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return global_state.client


__all__ = [
    "Liveness",
    "ProcessGroup",
    "agree_max",
    "barrier",
    "check_shared_folder",
    "gather_objects",
    "host_copy",
    "initialize",
    "is_communication_error",
    "is_primary",
    "joined_processes",
    "local_replica",
    "ordered_devices",
    "problems_of_every_process",
    "process_mesh",
    "same_on_every_process",
]
