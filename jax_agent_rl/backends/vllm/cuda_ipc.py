"""The CUDA weight push's transport: the learner's weights handed to another process on the
same node as one CUDA IPC handle, never through the host.

The sender (the learner's process: JAX and torch) takes each HF-layout tensor, a JAX array
on a CUDA device, into torch by DLPack (the same memory, no copy) and copies it into one
flat torch buffer, back to back and 256-byte aligned, with the index `wire.write_tensors`
writes for ``/dev/shm`` (name, dtype, shape, offset). JAX's buffers cannot be shared
themselves: torch's ``reduce_tensor`` shares only what its caching allocator holds. The
buffer goes out as the picklable handle ``torch.multiprocessing.reductions.reduce_tensor``
makes (what verl's ``update_weights_from_tensor`` sends), with the sending GPU's UUID.

The receiver (an engine process: torch) opens the handle on the device with that UUID (its
own index of that GPU: ``CUDA_VISIBLE_DEVICES`` may number it otherwise, but must list it)
and yields ``(name, tensor)`` views into the buffer, as `wire.map_tensors` yields views into
the mapped file: what vLLM's ``reload_weights`` takes. The sender must keep the buffer alive
until the receiver is done (`Export.buffer`).

Which path a push takes (`push_transport`, a pure function of where the learner's weights are
and what each engine sees): this handle when the learner's weights sit on one GPU that every
engine's ``CUDA_VISIBLE_DEVICES`` lists (an IPC handle opens only on a device the process
sees), the ``/dev/shm`` file otherwise (weights on the host or over several GPUs, or an engine
that does not see the learner's GPU; across nodes it would be NCCL, not this).

Standard library at import: JAX and torch are imported by the side that needs them.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

_ALIGN = 256  # cudaMalloc's alignment: every view starts as a fresh allocation would

Transport = Literal["cuda_ipc", "shm"]


def push_transport(
    learner_gpus: Sequence[str], engine_devices: Sequence[str]
) -> tuple[Transport, str]:
    """How a push reaches the engines, and why, in a sentence. ``learner_gpus``: the GPUs
    holding the pushed weights, named as ``CUDA_VISIBLE_DEVICES`` names them (`learner_gpus`;
    empty: not on CUDA); ``engine_devices``: each engine's ``CUDA_VISIBLE_DEVICES`` (""
    inherits the learner's, so it sees the learner's GPUs)."""
    if not learner_gpus:
        return "shm", "the learner's weights are not on a CUDA device: pushes go through /dev/shm"
    if len(learner_gpus) > 1:
        return "shm", (
            f"the learner's weights span GPUs {list(learner_gpus)} (a CUDA IPC push hands one "
            "GPU's buffer): pushes go through /dev/shm"
        )
    gpu = learner_gpus[0]
    blind = [i for i, d in enumerate(engine_devices) if d and gpu not in d.split(",")]
    if blind:
        seen = [engine_devices[i] for i in blind]
        return "shm", (
            f"vLLM engines {blind} do not see the learner's GPU {gpu} (CUDA_VISIBLE_DEVICES "
            f"{seen}; list it after their own for the CUDA path): pushes go through /dev/shm"
        )
    return "cuda_ipc", (
        f"the learner's weights and every vLLM engine share GPU {gpu}: pushes go by CUDA IPC "
        "handle, not through the host"
    )


def learner_gpus(arrays: Iterable[Any], visible: str | None) -> list[str]:
    """The GPUs ``arrays`` (JAX arrays) are on, as ``CUDA_VISIBLE_DEVICES`` names them:
    ``visible`` (the learner process's; None: every GPU, named by index) maps JAX's local
    hardware ids. Empty when none is on a CUDA device."""
    return device_gpus({d for array in arrays for d in array.devices()}, visible)


def device_gpus(devices: Iterable[Any], visible: str | None) -> list[str]:
    """The CUDA ones of ``devices`` (JAX devices), named as in `learner_gpus`."""
    names = None if visible is None else [n.strip() for n in visible.split(",")]
    found = {d.local_hardware_id for d in devices if d.platform == "gpu"}
    return [str(i) if names is None else names[i] for i in sorted(found)]


@dataclasses.dataclass(frozen=True)
class Export:
    """One push: ``payload`` for the message, ``buffer`` to keep alive until it is loaded."""

    payload: str  # base64 of the pickled (handle, device UUID, index)
    buffer: Any  # the flat torch.uint8 CUDA buffer the handle points into
    nbytes: int


def export_tensors(tensors: Iterable[tuple[str, Any]]) -> Export:
    """``tensors``: (HF name, JAX array on one CUDA device). Sender side."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    views = [(name, torch.from_dlpack(array)) for name, array in tensors]
    if not views:
        raise ValueError("no tensors to push")
    device = views[0][1].device
    if device.type != "cuda" or any(t.device != device for _, t in views):
        found = sorted({str(t.device) for _, t in views})
        raise ValueError(f"the CUDA push needs every tensor on one CUDA device; found {found}")
    index: list[dict[str, Any]] = []
    offset = 0
    for name, t in views:
        dtype = str(t.dtype).removeprefix("torch.")
        index.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset})
        offset += -(-t.nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for entry, (_, t) in zip(index, views, strict=True):
        start = entry["offset"]
        buffer[start : start + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    torch.cuda.synchronize(device)  # the receiver reads it from another process
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    payload = pickle.dumps((reduce_tensor(buffer), uuid, index))
    return Export(base64.b64encode(payload).decode("ascii"), buffer, offset)


def import_tensors(payload: str) -> Iterator[tuple[str, Any]]:
    """Every tensor of an `export_tensors` payload, as ``(name, torch tensor)`` views into
    the sender's buffer on the same GPU. Receiver side."""
    import torch

    (rebuild, args), uuid, index = pickle.loads(base64.b64decode(payload))
    device = _device_of(uuid)
    args = list(args)
    args[6] = device  # rebuild_cuda_tensor's storage_device: this process's index of the GPU
    buffer = rebuild(*args)
    for entry in index:
        dtype = getattr(torch, entry["dtype"])
        n = dtype.itemsize * _count(entry["shape"])
        start = entry["offset"]
        yield entry["name"], buffer[start : start + n].view(dtype).view(entry["shape"])


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _device_of(uuid: str) -> int:
    import torch

    seen = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise RuntimeError(
            f"the weights are on GPU {uuid}, which this process does not see (it sees {seen}): "
            "its CUDA_VISIBLE_DEVICES must list the learner's GPU"
        )
    return seen.index(uuid)
