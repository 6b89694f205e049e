"""A policy against the engine's shared KV pages: can one trajectory read, overwrite or steer
another's cached keys and values? Pages are shared only under a prefix key that names every
token before the page's end, and a sequence writes only into pages of its own; so a request
gives the tokens it gives alone, whatever other trajectories sent before or beside it."""

import asyncio
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("shared") / "tiny", TINY_QWEN2)


def _backend(checkpoint: Path) -> EmbeddedBackend:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    return EmbeddedBackend(
        Engine(
            cfg, max_concurrent_decodes=4, max_len=256, page_size=16, sharder=one_device_sharder()
        ),
        w,
    )


def _alone(checkpoint: Path, request: GenerateRequest) -> tuple[int, ...]:
    backend = _backend(checkpoint)
    result = asyncio.run(backend.generate(request))
    asyncio.run(backend.close())
    return result.token_ids


def test_a_trajectory_cannot_reach_anothers_continuation(checkpoint: Path) -> None:
    """Trajectories that share a prompt's first pages and differ after (inside a partial
    page, and right at a page boundary), one of them claiming the other's session id, and
    one resending the other's whole history with a changed token in its middle: each gets
    its own tokens, never the other's."""
    base = tuple(int(t) for t in np.random.default_rng(0).integers(1, 500, 40))
    victim = GenerateRequest("v", (*base, 7, 8, 9), GREEDY, session_id="victim")
    backend = _backend(checkpoint)
    first = asyncio.run(backend.generate(victim))
    history = (*victim.prompt_ids, *first.token_ids)
    tampered = list(history)
    tampered[20] = (tampered[20] + 1) % 500  # inside a full, cached page
    attacks = [
        GenerateRequest("a1", (*base, 7, 8, 10), GREEDY, session_id="victim"),  # its session
        GenerateRequest("a2", base[:32], GREEDY),  # ends at a page boundary
        GenerateRequest("a3", tuple(tampered), GREEDY, prefix_session="victim"),
        GenerateRequest("a4", (*base[:16], *base[:24]), GREEDY),  # a page, then a repeat
    ]

    async def together() -> list:
        return list(await asyncio.gather(*(backend.generate(r) for r in attacks)))

    results = asyncio.run(together())
    again = asyncio.run(backend.generate(GenerateRequest("v2", history, GREEDY)))
    asyncio.run(backend.close())
    for request, result in zip(attacks, results, strict=True):
        assert result.token_ids == _alone(checkpoint, request), request.request_id
    assert again.token_ids == _alone(checkpoint, GenerateRequest("v2", history, GREEDY))
