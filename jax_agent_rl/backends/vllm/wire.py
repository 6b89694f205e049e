"""What both sides of the vLLM backend share: message framing and the weight-buffer layout.

Messages are JSON objects, each framed by a 4-byte big-endian length, over the engine
process's stdin (to it) and a pipe standing in for its stdout (from it). Weights never travel
as messages: the sender writes every tensor, back to back and 64-byte aligned, into one file
under ``/dev/shm`` (memory, not disk) and sends its index; each receiver maps the file and
reads the tensors in place. Standard library and numpy only: this module is imported by both
interpreters.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_HEADER = struct.Struct(">I")
_ALIGN = 64
SHM_DIR = Path("/dev/shm")


def write_message(stream: BinaryIO, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_message(stream: BinaryIO) -> dict[str, Any] | None:
    """The next message, or ``None`` at end of stream (the other side is gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_tensors(path: Path, tensors: Iterable[tuple[str, np.ndarray]]) -> list[dict[str, Any]]:
    """Writes ``tensors`` into one file at ``path``; returns the index a receiver reads it by.

    Each index entry: name, dtype (numpy's name: ``float32``, ``bfloat16``, ...), shape, offset.
    """
    index: list[dict[str, Any]] = []
    offset = 0
    with path.open("wb") as f:
        for name, array in tensors:
            offset = -(-offset // _ALIGN) * _ALIGN
            f.seek(offset)
            data = np.ascontiguousarray(array)
            f.write(data.reshape(-1).view(np.uint8).data)
            index.append(
                {
                    "name": name,
                    "dtype": data.dtype.name,
                    "shape": list(data.shape),
                    "offset": offset,
                }
            )
            offset += data.nbytes
    return index


def map_tensors(path: str, index: list[dict[str, Any]]) -> Iterator[Any]:
    """The tensors ``write_tensors`` wrote, as ``(name, bytes, dtype name, shape)``; the bytes
    are views into the mapped file (no copy), which stays mapped while any view lives."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = memoryview(buffer)
    for entry in index:
        n = int(np.prod(entry["shape"], dtype=np.int64)) * _itemsize(entry["dtype"])
        start = entry["offset"]
        yield entry["name"], view[start : start + n], entry["dtype"], tuple(entry["shape"])


def update_tensors(
    path: Path, index: list[dict[str, Any]], tensors: Iterable[tuple[str, np.ndarray]]
) -> tuple[list[str], int]:
    """Writes into the file ``write_tensors`` wrote at ``path`` (its ``index``) the elements of
    ``tensors`` whose bits differ from what it holds; returns the names of the tensors that
    changed and the bytes written. ``tensors`` must be those of ``index``, in its order, each
    of its dtype and shape, or a `ValueError` says which is not (before anything is written)."""
    arrays = [(name, np.ascontiguousarray(array)) for name, array in tensors]
    if len(arrays) != len(index):
        raise ValueError(f"{len(arrays)} tensors for a file of {len(index)}")
    for (name, array), entry in zip(arrays, index, strict=True):
        if (name, array.dtype.name, list(array.shape)) != (
            entry["name"],
            entry["dtype"],
            entry["shape"],
        ):
            raise ValueError(
                f"tensor {name} {array.dtype.name}{list(array.shape)} where the file holds "
                f"{entry['name']} {entry['dtype']}{entry['shape']}"
            )
    changed, written = [], 0
    fd = os.open(path, os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        for (name, array), entry in zip(arrays, index, strict=True):
            bits = np.dtype(f"u{_itemsize(entry['dtype'])}")
            new = array.reshape(-1).view(bits)
            old = np.frombuffer(buffer, bits, new.size, entry["offset"])
            differ = old != new
            n = int(differ.sum())
            if n:
                old[differ] = new[differ]
                changed.append(name)
                written += n * bits.itemsize
            del old  # (the map closes once no view of it is left)
    finally:
        buffer.close()
    return changed, written


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
