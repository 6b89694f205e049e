"""Checks of the files that come with a checkpoint or a tokenizer, before they are read."""

from __future__ import annotations

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
