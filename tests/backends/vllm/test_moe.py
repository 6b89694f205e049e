"""vLLM serves Qwen3-MoE: the checkpoint ``jarl checkpoint make --preset tiny-moe`` writes, the
same greedy tokens as our engine, and a push of new expert weights changes vLLM's tokens to
the engine's under the same weights (the expert tensors go by their HF names, one per
expert, and vLLM stacks them into its fused w13 / w2). The whole conformance suite also runs
on a Qwen3-MoE (`tests/conformance`)."""

import asyncio
import dataclasses
from pathlib import Path

import jax
import pytest

from jax_agent_rl.backends.vllm.backend import VLLMBackend
from jax_agent_rl.cli.demo import make_checkpoint
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import Weights, load_hf
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from tests.processes import group_gone

MAX_LEN = 128
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True)
PROMPTS = [(5, 6, 7, 8, 9), (300, 12, 77, 1000, 4, 4, 19)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "tiny-moe"
    make_checkpoint(out, "tiny-moe")
    return out


def _new_experts(w: Weights) -> Weights:
    """The experts redrawn at transformers' scale for a random checkpoint (N(0, 1/fan_in)),
    every other weight kept: the preset's N(0, 0.02) experts barely move its outputs."""
    layers = w.layers
    keys = jax.random.split(jax.random.key(1), 3)
    fields = ("expert_gate", "expert_up", "expert_down")
    new = {
        name: jax.random.normal(k, x.shape) * x.shape[-2] ** -0.5
        for name, k, x in zip(fields, keys, (getattr(layers, f) for f in fields), strict=True)
    }
    return dataclasses.replace(w, layers=dataclasses.replace(layers, **new))


async def _greedy(backend: object, tag: str) -> list[tuple[int, ...]]:
    results = [
        await backend.generate(GenerateRequest(f"{tag}{i}", p, GREEDY))  # type: ignore[attr-defined]
        for i, p in enumerate(PROMPTS)
    ]
    return [r.token_ids for r in results]


def test_vllm_serves_the_tiny_moe_and_takes_pushed_experts(checkpoint: Path) -> None:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    assert cfg.num_experts == 8 and cfg.moe_layers == (True, False, True)
    engine = EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=2, max_len=MAX_LEN, sharder=one_device_sharder()),
        w,
        seed=0,
    )
    vllm = VLLMBackend(
        checkpoint, cfg, max_model_len=MAX_LEN, max_num_seqs=2, kv_cache_bytes=32 * 2**20
    )
    new = _new_experts(w)
    try:

        async def scenario() -> dict[str, list[tuple[int, ...]]]:
            out = {"engine": await _greedy(engine, "e"), "vllm": await _greedy(vllm, "v")}
            await engine.update_weights(new, version=1)
            await vllm.update_weights(new, version=1)
            out["engine_new"] = await _greedy(engine, "E")
            out["vllm_new"] = await _greedy(vllm, "V")
            return out

        got = asyncio.run(scenario())
    finally:
        asyncio.run(vllm.close())
        asyncio.run(engine.close())
    assert all(group_gone(pid) for pid in vllm.pids)
    assert got["vllm"] == got["engine"]
    assert got["vllm_new"] == got["engine_new"]
    assert got["vllm_new"] != got["vllm"]  # the pushed experts changed what vLLM samples
    assert any(len(set(tokens)) > 2 for tokens in got["vllm_new"])  # not one token repeated
