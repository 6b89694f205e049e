"""What a model turn is answered with, as tokens: its tool calls' results (`tool_observation`)
and an environment's messages (`env_observation`), each cut to ``agent.max_observation_chars``
characters before anything tokenizes it (`cut_chars`: a tokenizer reads a 12M-character
observation for half a minute, holding the event loop), the cut marked in the text and counted
in `Trajectory.cut_observations`. Their text is encoded as plain text: special-token text in it
stays text (`jax_agent_rl.tokenization.turns`)."""

from __future__ import annotations

from typing import Any, cast

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.tokenization import Message
from jax_agent_rl.tokenization.tool_calls import InlineToolCallParser, ParsedCall
from jax_agent_rl.tokenization.turns import TruncateSide
from jax_agent_rl.tools.base import ToolResult


def cut_chars(text: str, limit: int, side: TruncateSide = "right") -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` characters, keeping the ``side`` agent settings name
    (right: its start, left: its end, middle: both ends) with a marker where it was cut, and
    whether it was."""
    if len(text) <= limit:
        return text, False
    marker = f"...(cut to {limit} of {len(text)} characters)..."
    keep = max(limit - len(marker), 0)
    if side == "right":
        return text[:keep] + marker, True
    if side == "left":
        return marker + text[len(text) - keep :], True
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :], True


def tool_observation(
    ctx: AgentContext,
    traj: Trajectory,
    turn: list[int],
    text: str,
    calls: list[ParsedCall],
    results: list[ToolResult],
) -> tuple[list[int], list[dict[str, Any]]]:
    """Tokens appended after a model turn with calls, and the messages they stand for."""
    outputs = [_tool_text(ctx, traj, r) for r in results]
    if ctx.parser.style == "inline":
        parser = cast(InlineToolCallParser, ctx.parser)
        blocks = [parser.format_output(out) for out in outputs]
        spans, at = [], 0  # the outputs holding special-token text, read as plain text
        for out, block in zip(outputs, blocks, strict=True):
            if ctx.tokenizer.has_special_text(out):
                start = at + block.index(out)
                spans.append((start, start + len(out)))
            at += len(block)
        joined = "".join(blocks)
        messages = [{"role": "assistant", "content": text}, {"role": "tool", "content": joined}]
        return ctx.tokenizer.encode_plain(joined, spans), messages
    assistant = {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": c.name or "invalid", "arguments": c.arguments},
            }
            for c in calls
        ],
    }
    tool_messages = [
        {"role": "tool", "content": out, "name": c.name}
        for c, out in zip(calls, outputs, strict=True)
    ]
    ids = ctx.builder.close_assistant_turn(turn) + ctx.builder.messages_delta(tool_messages)
    return ids, [assistant, *tool_messages]


def _tool_text(ctx: AgentContext, traj: Trajectory, result: ToolResult) -> str:
    cfg = ctx.config
    text, cut = cut_chars(result.text, cfg.max_observation_chars, cfg.tool_response_truncate)
    traj.cut_observations += cut
    return ctx.builder.truncate_text(text, cfg.max_tool_response_tokens, cfg.tool_response_truncate)


def env_observation(messages: list[Message], limit: int, traj: Trajectory) -> list[Message]:
    """An environment step's ``messages`` with at most ``limit`` characters of content in all
    (``agent.max_observation_chars``; the first ones kept, each cut message counted in
    ``traj``)."""
    left = limit
    out = []
    for m in messages:
        content, cut = cut_chars(m["content"], left)
        traj.cut_observations += cut
        left = max(left - len(content), 0)
        out.append({**m, "content": content})
    return out
