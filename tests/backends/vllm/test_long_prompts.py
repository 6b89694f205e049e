"""Seeded prompts longer than one engine step's default token budget, on vLLM's CPU build.

vLLM prefills such a prompt in chunks by default, and its CPU build cannot rewind a seeded
request's generator after a partial chunk: the engine died, ending every request on it. The
worker turns chunked prefill off on CPU (`jarl_gpu_backend.worker`); seeds are kept."""

import asyncio
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.rollout import GenerateRequest, GenerateResult, SamplingParams
from tests.backends.vllm import tiny_engines
from tests.processes import group_gone

MAX_LEN = 4096
LONG_PROMPT = 3000  # over vLLM's default step budget of 2048 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = dict(TINY_QWEN2, max_position_embeddings=MAX_LEN)
    return write_hf_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny", config)


def test_seeded_long_prompt_beside_a_short_one(checkpoint: Path) -> None:
    rng = np.random.default_rng(0)
    long_prompt = tuple(int(t) for t in rng.integers(0, TINY_QWEN2["vocab_size"], LONG_PROMPT))

    def request(rid: str, prompt: tuple[int, ...], max_tokens: int, seed: int) -> GenerateRequest:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
        return GenerateRequest(rid, prompt, sampling)

    backend = tiny_engines(
        checkpoint,
        MAX_LEN,
    )

    async def scenario() -> tuple[GenerateResult, GenerateResult, GenerateResult, GenerateResult]:
        long, short = await asyncio.gather(
            backend.generate(request("long", long_prompt, 24, seed=1)),
            backend.generate(request("short", (5, 6, 7, 8), 40, seed=2)),
        )
        after = await backend.generate(request("after", (9, 10, 11), 8, seed=3))
        again = await backend.generate(request("again", long_prompt, 24, seed=1))
        return long, short, after, again

    try:
        long, short, after, again = asyncio.run(scenario())
    finally:
        asyncio.run(backend.close())
    assert all(group_gone(pid) for pid in backend.pids)
    assert (long.finish_reason, len(long.token_ids)) == ("length", 24)
    assert (short.finish_reason, len(short.token_ids)) == ("length", 40)
    assert long.logprobs is not None and len(long.logprobs) == 24
    # the engine still serves, and the seed still fixes the tokens
    assert (after.finish_reason, len(after.token_ids)) == ("length", 8)
    assert again.token_ids == long.token_ids
