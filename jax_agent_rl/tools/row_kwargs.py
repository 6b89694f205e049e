"""A dataset row's tool kwargs: ``extra_info.tools_kwargs`` is ``{tool name: {"create_kwargs":
{...}}}`` (verl's row layout, which jarl's data keeps) and reaches that tool's ``create``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def create_kwargs_by_tool(extra_info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tool's create kwargs from a dataset row's ``extra_info["tools_kwargs"]`` (verl's
    layout: ``{tool name: {"create_kwargs": {...}}}``); {} when the row has none.

    verl's tool agent loop reads ``create_kwargs`` only. The other keys verl's data scripts
    write (``execute_kwargs``, ``calc_reward_kwargs``, ``release_kwargs``) are accepted when
    empty and refused otherwise, since nothing would read them; so is any other key or shape.
    """
    tools_kwargs = extra_info.get("tools_kwargs") or {}
    where = "extra_info.tools_kwargs"
    if not isinstance(tools_kwargs, Mapping):
        raise ValueError(f"{where} must map tool names to dicts, got {type(tools_kwargs).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for tool, entry in tools_kwargs.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}[{tool!r}] must be a dict, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(TOOLS_KWARGS_KEYS))
        if unknown:
            raise ValueError(
                f"{where}[{tool!r}]: unknown key(s) {unknown}; allowed: {TOOLS_KWARGS_KEYS}"
            )
        unread = sorted(k for k in TOOLS_KWARGS_KEYS[1:] if entry.get(k))
        if unread:
            raise ValueError(
                f"{where}[{tool!r}]: {unread} are not read (verl's tool agent loop reads only "
                "create_kwargs); pass what the tool needs in create_kwargs"
            )
        create = entry.get("create_kwargs") or {}
        if not isinstance(create, Mapping):
            raise ValueError(
                f"{where}[{tool!r}]['create_kwargs'] must be a dict, got {type(create).__name__}"
            )
        out[str(tool)] = dict(create)
    return out
