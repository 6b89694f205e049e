"""The policy a run trains and its first parameters: the HF checkpoint ``model.path`` (with
``model.lora``'s adapters, `learners.with_run_lora`), or the custom policy ``model.module``
names (`models.policy`, `module_model`), initialised by its own initialisers from
``trainer.seed``. Reading the weights is the one heavy step: `run_policy`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_agent_rl.config import JarlConfig
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.models import ModelConfig, Sharder, init_params, load_hf
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.learners import with_run_lora
from jax_agent_rl.usercode.load import load_function


def module_model(cfg: JarlConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The `ModelConfig` of the custom policy ``model.module`` names (its ``policy.cfg``, in
    float32 as the learner holds it), made for ``tokenizer``'s vocabulary; a `ConfigError`
    when the function returns no policy or one whose vocabulary the tokenizer overruns."""
    spec = cfg.model.module
    policy = load_function(spec, "model.module")(tokenizer.vocab_size)
    model = getattr(policy, "cfg", None)  # (a user's object, not yet known to be a Policy)
    if not isinstance(model, ModelConfig) or model.module is not policy:
        raise ConfigError(
            f"model.module={spec!r} returned {policy!r}, not a policy (models.policy.Policy: "
            "e.g. models.nnx_policy.NnxPolicy over a Flax NNX module)"
        )
    if model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.module={spec!r}: its vocabulary ({model.vocab_size}) is smaller than the "
            f"tokenizer's ({tokenizer.vocab_size}, model.path={cfg.model.path!r})"
        )
    return dataclasses.replace(model, dtype="float32")


def run_policy(cfg: JarlConfig, model: ModelConfig, sharder: Sharder) -> Any:
    """The float32 parameters of the run's ``model`` (`train.parts`: the checkpoint's with
    ``model.lora``'s adapters, or the custom policy's), laid out by ``sharder``: the
    checkpoint's weights, or the custom policy's own initialisers from ``trainer.seed``."""
    if not cfg.model.module:
        return with_run_lora(cfg, *load_hf(cfg.model.path, "float32", sharder=sharder))[1]
    return init_params(jax.random.key(cfg.trainer.seed), model, sharder)
