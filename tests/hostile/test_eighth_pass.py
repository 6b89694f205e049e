"""Eighth pass: attacks on what a policy or a user controls, kept as regression tests.

- react_agent: a call whose arguments hold a key named ``self`` is answered as the loop answers
  any call the tool cannot take (an error observation), never a TypeError out of the graph's
  tool node that ended the episode with ``agent_error``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.langgraph_loop import Episode, episode_tools
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, init_params
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    TOOL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentContext]:
    """A real tokenizer, template, calculator and engine (never asked to generate: the test
    plays the model)."""
    corpus = ['{"name": "calculator", "arguments": {"expression": "6 * 7"}}', "The answer."] * 20
    backend_tok = train_bpe(corpus, 400, CHATML_SPECIAL_TOKENS, TOOL_TOKENS)
    folder = save_tokenizer(
        tmp_path_factory.mktemp("tok"), backend_tok, chat_template("chatml_tools")
    )
    tokenizer = Tokenizer.from_pretrained(Path(folder))
    tools = LocalTools(ToolRegistry([calculator]))
    cfg = ModelConfig(
        family="qwen2",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    backend = EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=1, max_len=256), init_params(jax.random.key(0), cfg)
    )
    schemas = asyncio.run(tools.schemas())
    config = AgentConfig(max_turns=3, max_model_len=512, max_response_tokens=400)
    yield AgentContext(
        backend, tokenizer, tools, make_parser("hermes"), config, TurnBuilder(tokenizer, schemas)
    )


@pytest.mark.parametrize("key", ["self", "arguments", "run_manager", "config"])
def test_a_react_call_with_an_argument_named_self_is_an_error_observation(
    context: AgentContext, key: str
) -> None:
    """The graph's tool node runs the model's call of a listed tool with the arguments it
    wrote; ``self`` among them met ``EpisodeTool._arun``'s own ``self`` (a TypeError out of
    the tool node: the episode ended ``agent_error``). Now every key reaches the executor,
    which refuses the unknown argument as the tool loop does."""
    episode = Episode(context, Trajectory(uid="t", group_id="g", prompt_ids=[]), {})
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode(episode_tools(episode)))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    call = {"name": "calculator", "args": {"expression": "1 + 1", key: 1}, "id": "call_1_0"}
    out = asyncio.run(graph.compile().ainvoke({"messages": [AIMessage("", tool_calls=[call])]}))
    answer = out["messages"][-1]
    assert isinstance(answer, ToolMessage)
    want = f"error: bad arguments for calculator: unknown argument(s) ['{key}']; expected "
    assert answer.content == want + "['expression']"
