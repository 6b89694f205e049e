"""The learner a run trains with, from its config: `make_learner` (the trainer's, with the
state it starts from), and the settings it is made of (`learner_settings`,
`micro_batch_rows`), which ``jarl plan`` reads to compile the same steps abstractly; the
model a run trains (`run_model`: the checkpoint's, with ``model.lora``'s adapters) and its
adapters on loaded weights (`with_run_lora`: fresh ones, or an adapter folder's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_agent_rl.config import JarlConfig, LoraSection
from jax_agent_rl.models import ModelConfig, Policy, Sharder, Weights
from jax_agent_rl.models.adapters import init_adapters, load_peft, peft_lora, with_adapters
from jax_agent_rl.models.lora import TARGETS, Lora
from jax_agent_rl.rl.learner import Learner, critic_from_policy
from jax_agent_rl.rl.objectives import SamplingSpec
from jax_agent_rl.rl.update import LearnerState


def lora_of(section: LoraSection) -> Lora | None:
    """``model.lora`` as the decoder's `Lora` (``None``: rank 0 and no adapter folder, no
    adapters). With ``adapter_path``, the folder's (`peft_lora`): rank 0 takes it as it is;
    otherwise ``rank``, ``alpha`` and ``targets`` must be the folder's, a `ValueError` naming
    each that is not."""
    asked = Lora(section.rank, section.alpha, tuple(section.targets)) if section.rank else None
    if not section.adapter_path:
        return asked
    lora = peft_lora(section.adapter_path)
    if asked is None:
        return lora
    ordered = [t for t in TARGETS if t in asked.targets]  # (the folder's are in this order)
    mine = {"rank": asked.rank, "alpha": asked.alpha, "targets": ordered}
    theirs = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}
    differ = [
        f"model.lora.{key}={mine[key]!r} where its adapter_config.json has {theirs[key]!r}"
        for key in mine
        if mine[key] != theirs[key]
    ]
    if differ:
        raise ValueError(
            f"model.lora.adapter_path={section.adapter_path!r}: "
            + "; ".join(differ)
            + ": set them so, or model.lora.rank=0 to take the folder's"
        )
    return lora


def run_model(cfg: JarlConfig, checkpoint: ModelConfig) -> ModelConfig:
    """The model a run trains: the checkpoint's, with ``model.lora``'s adapters if any, its
    logprobs exact in the engine's pages where ``model.exact_logprobs``."""
    exact = cfg.engine.page_size if cfg.model.exact_logprobs else 0
    return dataclasses.replace(checkpoint, lora=lora_of(cfg.model.lora), exact_pages=exact)


def with_run_lora(
    cfg: JarlConfig, checkpoint: ModelConfig, params: Weights
) -> tuple[ModelConfig, Weights]:
    """`run_model` and the checkpoint's ``params`` with its adapters: those of
    ``model.lora.adapter_path`` (`load_peft`, fp32), else fresh ones (PEFT's init, seeded by
    ``trainer.seed``); both as they are without ``model.lora``."""
    model = run_model(cfg, checkpoint)
    if model.lora is None:
        return model, params
    path = cfg.model.lora.adapter_path
    if path:
        _, adapters = load_peft(path, checkpoint)
    else:
        adapters = init_adapters(jax.random.key(cfg.trainer.seed), model)
    return model, with_adapters(params, adapters)


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
    s = cfg.sampling
    return {
        "algo": cfg.algorithm,
        "optim": optim,
        "sampling": SamplingSpec(s.temperature, s.top_k, s.top_p),
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
    policy: Policy,
    params: Any,
    sharder: Sharder,
    *,
    lr: float | None = None,
    warmup: int | None = None,
    decay_steps: int | None = None,
    micro_batch_size: int | None = None,
    reference: Any | None = None,
) -> tuple[Learner, LearnerState]:
    """The learner and the state it starts from: ``params`` (with a critic of them for GAE)
    and the KL ``reference``; the keyword arguments override the RL settings (SFT)."""
    learner = Learner(
        policy,
        micro_batch_size=micro_batch_size or micro_batch_rows(cfg),
        sharder=sharder,
        **learner_settings(cfg, lr=lr, warmup=warmup, decay_steps=decay_steps),
    )
    critic = critic_from_policy(params) if cfg.algorithm.adv_estimator == "gae" else None
    return learner, learner.init_state(params, critic=critic, reference=reference)
