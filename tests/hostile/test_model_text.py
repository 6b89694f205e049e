"""Whatever a model writes, the agent loop ends the turn with a stop reason or an observation,
never an exception: a deterministic fuzz of `finish_turn` (text -> parse -> tool calls ->
chat-template observation) with every parser, real tools (the calculator, a stateful counter
and the python sandbox) and a real tokenizer and chat template.

Model text is built from the pieces a policy has at hand: tool-call tags, JSON calls with
arbitrary arguments (nested, huge integers, odd types), unclosed blocks, think blocks, special
tokens, and random token ids that decode to anything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.loop import finish_turn
from jax_agent_rl.agent.trajectory import STOP_REASONS, Trajectory
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    TOOL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tool_calls import PARSERS, make_parser
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox, PythonTool
from tests.hostile.conftest import agent_context
from tests.tools.test_tools import Counter

TAGS = ["<think>", "</think>", "<python>", "</python>", "```python\n", "```", "<|python_tag|>"]
SPECIAL = [*CHATML_SPECIAL_TOKENS, *TOOL_TOKENS, *TAGS]
CALLS = [
    '{"name": "calculator", "arguments": {"expression": "6 * 7"}}',
    '{"name": "python", "arguments": {"code": "print(6 * 7)"}}',
    '{"name": "python", "parameters": {"code": "import os\\nos.kill(1, 9)"}}',
    '{"name": "count", "arguments": {}}',
    '{"name": "calculator", "arguments": "{\\"expression\\": \\"1 + 1\\"}"}',
]


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentContext]:
    corpus = [*CALLS, "The answer is 42.", "print(sum(range(10)))"] * 20
    backend_tok = train_bpe(corpus, 400, CHATML_SPECIAL_TOKENS, (*TOOL_TOKENS, *TAGS))
    folder = save_tokenizer(
        tmp_path_factory.mktemp("tok"), backend_tok, chat_template("chatml_tools")
    )
    tokenizer = Tokenizer.from_pretrained(Path(folder))
    sandbox = PythonSandbox(size=1, limits=Limits(cpu_s=1, memory_mb=128), timeout_s=2.0)
    tools = LocalTools(ToolRegistry([calculator, Counter(), PythonTool(sandbox)]))
    yield agent_context(tokenizer, tools)  # (the fuzz plays the model)
    sandbox.close()


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@st.composite
def json_call(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(["calculator", "python", "count", "nope", ""]) | st.text())
    key = draw(st.sampled_from(["arguments", "parameters", "args"]))
    args = draw(
        _json_values | st.dictionaries(st.sampled_from(["expression", "code"]), _json_values)
    )
    return json.dumps({"name": name, key: args})


CODE = [
    "print(6 * 7)",
    "import os\nos.kill(1, 9)\nprint('alive')",
    "raise SystemExit(3)",
    "print('\\x00\\udc80' * 3)",
    "open('/work/answer', 'w').write('42')",
]
HOSTILE = ["[" * 2000, "1" * 5000, '{"', "}", "\\u0000", "\ufffd", "\x00"]


FORMATS = {  # how each parser's calls are written: (opener, closer, body is code)
    "hermes": ("<tool_call>\n", "\n</tool_call>", False),
    "llama3_json": ("<|python_tag|>", "", False),
    "python_tag": ("<python>", "</python>", True),
    "tool_tag": ("<tool>", "</tool>", True),
    "fenced_python": ("```python\n", "```", True),
}


@st.composite
def call_block(draw: st.DrawFn, parser: str) -> str:
    """A call in ``parser``'s format (or another's), well formed, hostile or cut short."""
    if draw(st.integers(0, 3)) == 0:
        parser = draw(st.sampled_from(sorted(FORMATS)))
    opener, closer, code = FORMATS[parser]
    if code:
        body = draw(st.sampled_from(CODE + HOSTILE) | st.text(max_size=40))
    else:
        body = draw(json_call() | st.sampled_from(CALLS + HOSTILE))
    if parser == "llama3_json" and draw(st.booleans()):
        opener = ""
    return opener + body + (closer if draw(st.integers(0, 4)) else "")


def model_text(parser: str) -> st.SearchStrategy[str]:
    """Noise, then calls (for llama3_json, a ';'-joined list that starts the text)."""
    noise = st.lists(
        st.one_of(st.sampled_from(SPECIAL + HOSTILE), st.text(max_size=30)), max_size=3
    ).map("".join)
    calls = st.lists(call_block(parser), min_size=1, max_size=3)
    joiner = "; " if parser == "llama3_json" else "\n"
    lead = st.just("") if parser == "llama3_json" else noise
    return st.tuples(lead, calls, noise).map(lambda t: t[0] + joiner.join(t[1]) + t[2])


def _turn(context: AgentContext, parser: str, data: st.DataObject) -> list[int]:
    """The model's tokens: encoded model text, or raw token ids, optionally ended by eos."""
    if data.draw(st.integers(0, 4)):
        tokens = context.tokenizer.encode(data.draw(model_text(parser)))
    else:
        tokens = data.draw(st.lists(st.integers(0, context.tokenizer.vocab_size - 1), max_size=60))
    if data.draw(st.booleans()):
        tokens = [*tokens, context.builder.eos_id]
    return tokens


@pytest.mark.parametrize("parser", sorted(PARSERS))
@hypothesis.settings(max_examples=60, derandomize=True, deadline=None, database=None)
@hypothesis.given(data=st.data())
def test_any_model_text_ends_the_turn_cleanly(
    context: AgentContext, parser: str, data: st.DataObject
) -> None:
    ctx = AgentContext(
        context.backend,
        context.tokenizer,
        context.tools,
        make_parser(parser),
        context.config,
        context.builder,
    )
    messages: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]
    traj = Trajectory(
        uid="fuzz", group_id="fuzz", prompt_ids=ctx.builder.prompt_ids(messages), messages=messages
    )
    traj.timings["tools_s"] = 0.0
    turn = _turn(ctx, parser, data)
    traj.append(turn, model=True, logprobs=[-1.0] * len(turn))
    finish = data.draw(st.sampled_from(["stop", "length"]))

    async def go() -> str | None:
        try:
            return await finish_turn(ctx, traj, turn, finish)
        finally:
            await ctx.tools.release(traj.uid)

    stop = asyncio.run(go())
    assert stop is None or stop in STOP_REASONS
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.rollout_logprobs)
    assert traj.loss_mask[: len(turn)] == [1] * len(turn)
    assert set(traj.loss_mask[len(turn) :]) <= {0}
    if stop is None:  # the episode goes on: the observation follows the turn, mask 0
        assert len(traj.response_ids) > len(turn) and traj.messages[-1]["role"] == "tool"
    assert traj.tool_errors <= traj.tool_calls
