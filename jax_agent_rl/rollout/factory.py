"""Builds the configured rollout backend (the one place that knows every backend)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jax_agent_rl.config import RolloutSection
from jax_agent_rl.models import ModelConfig, Weights
from jax_agent_rl.rollout.protocol import RolloutBackend


def make_backend(
    rollout: RolloutSection,
    model: ModelConfig,
    params: Weights,
    *,
    checkpoint: str | Path,
    dtype: str,
    version: int = 0,
    seed: int = 0,
) -> RolloutBackend:
    """``rollout.backend`` serving ``params`` (already in ``dtype``) as weight ``version``.

    ``checkpoint`` is the HF folder the params came from: engines that load their own copy
    (vLLM) start from it and then receive ``params``.
    """
    if rollout.backend == "embedded":
        from jax_agent_rl.engine import Engine
        from jax_agent_rl.rollout.embedded import EmbeddedBackend

        engine = Engine(
            dataclasses.replace(model, dtype=dtype),  # type: ignore[arg-type]
            max_concurrent_decodes=rollout.max_concurrent,
            max_len=rollout.max_model_len,
        )
        return EmbeddedBackend(
            engine,
            params,
            weight_version=version,
            steps_per_call=rollout.steps_per_call,
            seed=seed,
            warmup=True,
        )
    if rollout.backend == "vllm":
        from gpu_backend.backend import DEFAULT_PYTHON, VLLMBackend

        return VLLMBackend(
            checkpoint,
            model,
            params=params,
            python=rollout.vllm_python or DEFAULT_PYTHON,
            replicas=rollout.replicas,
            devices=[d for d in rollout.vllm_devices.split(",") if d],
            kv_cache_bytes=rollout.vllm_kv_cache_mb * 2**20 or None,
            max_model_len=rollout.max_model_len,
            max_num_seqs=rollout.max_concurrent,
            dtype=dtype,
            weight_version=version,
            seed=seed,
        )
    raise ValueError(f"rollout.backend={rollout.backend!r} is not available in this build")
