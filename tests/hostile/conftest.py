"""Fixtures the hostile tests share: a small ChatML tool tokenizer and a real engine that the
loops and harnesses under test never ask to generate (they play the model themselves), and an
agent context with the calculator on them. A module's own fixture of the same name takes
their place."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, init_params
from jax_agent_rl.models.sharding import one_device_sharder
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
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    backend_tok = train_bpe(["The answer is 4."] * 8, 300, CHATML_SPECIAL_TOKENS)
    folder = save_tokenizer(
        tmp_path_factory.mktemp("tok"), backend_tok, chat_template("chatml_tools")
    )
    return Tokenizer.from_pretrained(Path(folder))


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> Iterator[EmbeddedBackend]:
    """A real engine, never asked to generate."""
    yield silent_backend(tokenizer.vocab_size, max_position_embeddings=512)


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
    yield agent_context(tokenizer, LocalTools(ToolRegistry([calculator])))


def silent_backend(vocab_size: int, max_position_embeddings: int = 4096) -> EmbeddedBackend:
    """A real engine of a one-layer model, never asked to generate (the test plays it)."""
    cfg = ModelConfig(
        family="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
    )
    engine = Engine(cfg, max_concurrent_decodes=1, max_len=256, sharder=one_device_sharder())
    return EmbeddedBackend(
        engine, init_params(jax.random.key(0), cfg, sharder=one_device_sharder())
    )


def agent_context(tokenizer: Tokenizer, tools: LocalTools) -> AgentContext:
    """An agent context of ``tools`` over a `silent_backend`: hermes calls, 3 turns."""
    schemas = asyncio.run(tools.schemas())
    config = AgentConfig(max_turns=3, max_model_len=4096, max_response_tokens=4000)
    return AgentContext(
        silent_backend(tokenizer.vocab_size),
        tokenizer,
        tools,
        make_parser("hermes"),
        config,
        TurnBuilder(tokenizer, schemas),
    )
