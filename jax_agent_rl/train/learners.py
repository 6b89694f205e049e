"""The learner a run trains with, from its config: `make_learner` (the trainer's), and the
settings it is made of (`learner_settings`, `micro_batch_rows`), which ``jarl plan`` reads to
compile the same steps abstractly."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_agent_rl.config import JarlConfig
from jax_agent_rl.models import ModelConfig, Sharder
from jax_agent_rl.rl.learner import Learner, critic_from_policy
from jax_agent_rl.rl.objectives import SamplingSpec


def learner_settings(
    cfg: JarlConfig,
    *,
    lr: float | None = None,
    warmup: int | None = None,
    decay_steps: int | None = None,
) -> dict[str, Any]:
    """The learner's step settings (`StepPrograms.of`'s keywords) from ``cfg``; the keyword
    arguments override the RL ones (SFT)."""
    optim = cfg.optim if warmup is None else dataclasses.replace(cfg.optim, warmup_steps=warmup)
    r = cfg.rollout
    return {
        "algo": cfg.algorithm,
        "optim": optim,
        "sampling": SamplingSpec(r.temperature, r.top_k, r.top_p),
        "compute_dtype": cfg.model.dtype,
        "remat": cfg.learner.remat,
        "norm_const": cfg.agent.max_response_tokens,
        "lr": lr,
        "decay_steps": decay_steps,
    }


def micro_batch_rows(cfg: JarlConfig) -> int:
    """Rows of an RL micro-batch: with packing one per data-parallel device (a device's row
    holds ``learner.row_tokens`` tokens), else ``learner.micro_batch_size``."""
    L = cfg.learner
    return cfg.mesh.data * cfg.mesh.fsdp if L.packing else L.micro_batch_size


def sft_micro_batch_rows(cfg: JarlConfig) -> int:
    """Rows of an SFT micro-batch (one demonstration a row)."""
    return min(cfg.sft.batch_size, cfg.learner.micro_batch_size)


def make_learner(
    cfg: JarlConfig,
    model: ModelConfig,
    params: Any,
    sharder: Sharder,
    *,
    lr: float | None = None,
    warmup: int | None = None,
    decay_steps: int | None = None,
    micro_batch_size: int | None = None,
    reference: Any | None = None,
) -> Learner:
    """The learner over ``params`` (and the KL ``reference``); the keyword arguments override
    the RL settings (SFT)."""
    return Learner(
        model,
        params,
        micro_batch_size=micro_batch_size or micro_batch_rows(cfg),
        sharder=sharder,
        critic=critic_from_policy(params) if cfg.algorithm.adv_estimator == "gae" else None,
        reference=reference,
        **learner_settings(cfg, lr=lr, warmup=warmup, decay_steps=decay_steps),
    )
