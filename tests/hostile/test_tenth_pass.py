"""Tenth pass: attacks on what a policy or a user controls, kept as regression tests.

- A tool whose text holds a lone surrogate (a file-listing tool's: ``Path.iterdir`` gives an
  undecodable byte of a file name as one, and the policy's own code can make such a name):
  the result reached the loop as it was, and the tokenizer rendering the observation raised
  ("TextInputSequence must be str"), ending the episode with ``agent_error``. It is now the
  call's error result, naming the tool and the character, and the episode goes on.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry


@tool
def listing(folder: str) -> str:
    """Lists a folder's entries, one a line.

    Args:
        folder: the folder to list
    """
    return "\n".join(sorted(p.name for p in Path(folder).iterdir()))


def test_a_tool_text_holding_a_lone_surrogate_is_the_calls_error(tmp_path: Path) -> None:
    (tmp_path / "plain").touch()
    tools = LocalTools(ToolRegistry([listing]))
    fine = asyncio.run(tools.call("t/0", "listing", {"folder": str(tmp_path)}))
    assert fine.text == "plain" and not fine.error
    (tmp_path / os.fsdecode(b"caf\xe9")).touch()  # (a name no UTF-8 decoder reads)
    result = asyncio.run(tools.call("t/1", "listing", {"folder": str(tmp_path)}))
    assert result.error
    assert result.text == (
        "error: listing returned text holding a lone surrogate '\\udce9' at character 3: not text"
    )
    result.text.encode("utf-8")  # (the tokenizer takes it)
