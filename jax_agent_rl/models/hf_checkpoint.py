"""HF checkpoint folders <-> a policy's parameters: `load_hf` reads a folder's config.json into
a `ModelConfig` (its family's: `ModelConfig.from_hf`) and its safetensors into the parameters
of that config's policy (`policy.policy_of`), by the policy's own HF table (``hf_rules``);
`save_hf` writes them back, so transformers and vLLM load a trained policy. The format's
checks and its tables' machinery are `checkpoint`'s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jax_agent_rl.models.checkpoint import GenerationConfig, read_hf, write_hf
from jax_agent_rl.models.config import DType, ModelConfig
from jax_agent_rl.models.policy import Policy, family_policy, policy_of, policy_shardings
from jax_agent_rl.models.sharding import Sharder


def load_hf(
    path: str | Path, dtype: DType = "float32", *, sharder: Sharder
) -> tuple[ModelConfig, Any]:
    """A local HF checkpoint folder (config.json + safetensors): its config and its policy's
    parameters in ``dtype``, placed with their shardings on ``sharder``'s mesh (`read_hf`:
    every tensor checked from the headers before any data is read)."""
    cfg = ModelConfig.from_pretrained(path, dtype=dtype)
    policy = family_policy(cfg)
    params = read_hf(Path(path), cfg, policy.specs(), policy.hf_rules())
    return cfg, jax.device_put(params, policy_shardings(policy, sharder))


def hf_tensors(
    model: ModelConfig | Policy, weights: Any, on_device: bool = False
) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``weights`` under its HF name and layout (`Policy.hf_tensors`)."""
    return policy_of(model).hf_tensors(weights, on_device)


def save_hf(
    path: str | Path,
    model: ModelConfig | Policy,
    weights: Any,
    max_shard_bytes: int = 2 * 1024**3,
    generation: GenerationConfig | None = None,
) -> None:
    """Writes config.json and safetensors of ``weights`` (sharded with an index when over
    ``max_shard_bytes``); with ``generation``, also its token ids in config.json and
    ``generation_config.json``."""
    policy = policy_of(model)
    write_hf(
        Path(path), policy.hf_tensors(weights), policy.cfg.to_hf(), max_shard_bytes, generation
    )
