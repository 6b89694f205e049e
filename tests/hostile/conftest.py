"""Fixtures the adversarial passes share: a small ChatML tool tokenizer and a real engine that
the loops and harnesses under test never ask to generate (they play the model themselves). A
module's own fixture of the same name takes their place."""

from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, init_params
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)


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
    engine = Engine(cfg, max_concurrent_decodes=1, max_len=256, sharder=one_device_sharder())
    yield EmbeddedBackend(engine, init_params(jax.random.key(0), cfg, sharder=one_device_sharder()))
