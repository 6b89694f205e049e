"""How the run's settings become a vLLM engine's arguments: its KV cache in bytes and blocks
(sized as the embedded engine sizes its pool) and each engine's GPUs under tensor
parallelism, the bound on its LoRA adapters' rank."""

from __future__ import annotations

from jax_agent_rl.config import EngineSection
from jax_agent_rl.models import ModelConfig


def kv_cache_bytes(engine: EngineSection, model: ModelConfig, dtype: str) -> int:
    """Each replica's KV cache, as the embedded engine sizes its pool: ``engine.kv_cache_gib``
    in blocks of ``engine.page_size``, or (0) the blocks ``engine.max_concurrent`` sequences
    of ``engine.max_model_len`` need. vLLM's cache holds ``model``'s ``dtype``."""
    import jax.numpy as jnp

    from jax_agent_rl.engine import page_bytes, pool_pages

    r = engine
    width = jnp.dtype(dtype).itemsize
    pages = pool_pages(model, r.page_size, width, r.kv_cache_gib, r.max_concurrent, r.max_model_len)
    return pages * page_bytes(model, r.page_size, width)


# the block sizes vLLM's KV cache takes (its CacheConfig.block_size)
BLOCK_SIZES = (8, 16, 32, 64, 128)


def device_groups(devices: str, tensor_parallel_size: int) -> list[str]:
    """``engine.vllm.devices`` ("4,5,6,7") as each engine's ``CUDA_VISIBLE_DEVICES``, in
    groups of ``tensor_parallel_size`` (["4,5", "6,7"] at 2)."""
    ids = [d for d in devices.split(",") if d]
    step = tensor_parallel_size
    return [",".join(ids[i : i + step]) for i in range(0, len(ids), step)]


# the LoRA ranks vLLM's engine takes as its bound (its LoRAConfig.max_lora_rank)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(model: ModelConfig) -> int | None:
    """The smallest bound vLLM takes that holds ``model``'s adapters' rank (None: no LoRA)."""
    if model.lora is None:
        return None
    fits = [r for r in LORA_RANKS if r >= model.lora.rank]
    if not fits:
        raise ValueError(f"model.lora.rank={model.lora.rank}: vLLM serves ranks up to 512")
    return fits[0]
