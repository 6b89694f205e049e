"""Checks of the files that come with a checkpoint or a tokenizer, before they are read, and of
the run's JSONL logs, before they are appended to.

The one module at the package's root: the models and the tokenizer (the lowest packages) read
through it, as the run's logs (`jax_agent_rl.train`) append through it, so it sits below every
package; in either of those it would make the other import it, and the tokenizer import JAX."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def regular_file(path: Path, folder: str) -> bool:
    """Whether ``path`` is there; raises ValueError if it is there but is no regular file once
    links are followed (as the Hugging Face cache links its files): a FIFO would block the read
    for ever, a device never end it. ``folder`` names what should hold it, for the message."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file: {folder} holds plain files")
    return True


def drop_cut_line(path: Path) -> None:
    """Drops the last line of the JSONL file ``path`` if no newline ends it: a record cut short
    by a process killed while writing it (a trace record takes several writes). Records
    appended then start a line of their own; appended to the cut one, they made a line of half
    a record and a whole one, and readers refused the file."""
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        if end == 0 or os.pread(f.fileno(), 1, end - 1) == b"\n":
            return
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 2**16)
            newline = os.pread(f.fileno(), end - start, start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            end = start
        f.truncate(0)
