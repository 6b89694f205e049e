"""Tests of the vllm backend, on vLLM's CPU build."""

from pathlib import Path
from typing import Any

from jax_agent_rl.backends.vllm.backend import VLLMBackend
from jax_agent_rl.models import ModelConfig

# the tiny model's KV cache, fixed and small: no dependence on the machine's free RAM (2 KiB per
# token: room for several whole sequences)
KV_CACHE_BYTES = 32 * 2**20


def tiny_engines(checkpoint: Path, max_model_len: int, **settings: Any) -> VLLMBackend:
    """Engines of ``checkpoint`` with room for 4 sequences and the small KV cache; ``settings``
    go to `VLLMBackend` as they are."""
    return VLLMBackend(
        checkpoint,
        ModelConfig.from_pretrained(checkpoint),
        max_model_len=max_model_len,
        max_num_seqs=4,
        kv_cache_bytes=KV_CACHE_BYTES,
        **settings,
    )
