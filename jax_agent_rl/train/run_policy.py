"""The policy a run trains and its first parameters: the HF checkpoint ``model.path``'s
decoder (with ``model.lora``'s adapters, `learners.with_run_lora`), or the custom policy
``model.module`` names (`models.policy`, `module_policy`), initialised by its own
initialisers from ``trainer.seed``. Reading the weights is the one heavy step:
`run_policy`."""

from __future__ import annotations

from typing import Any

import jax

from jax_agent_rl.config import JarlConfig
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.models import ModelConfig, Policy, Sharder, init_policy, load_hf
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.learners import with_run_lora
from jax_agent_rl.usercode.load import load_function

# what a run calls on a policy (`models.Policy`), checked on a user's object at the start
_POLICY_METHODS = (
    "specs", "init", "checked", "in_dtype", "serving_layout", "trained", "with_trained", "base",
    "forward", "head_vd", "logits", "hf_tensors",
)  # fmt: skip


def module_policy(cfg: JarlConfig, tokenizer: Tokenizer) -> Policy:
    """The custom policy ``model.module`` names (in float32, as the learner holds it), made
    for ``tokenizer``'s vocabulary; a `ConfigError` when the function returns no policy or one
    whose vocabulary the tokenizer overruns."""
    spec = cfg.model.module
    policy = load_function(spec, "model.module")(tokenizer.vocab_size)
    model = getattr(policy, "cfg", None)  # (a user's object, not yet known to be a Policy)
    missing = [m for m in _POLICY_METHODS if not callable(getattr(policy, m, None))]
    if not isinstance(model, ModelConfig) or missing:
        raise ConfigError(
            f"model.module={spec!r} returned {policy!r}, not a policy (models.policy.Policy: "
            "e.g. models.nnx_policy.NnxPolicy over a Flax NNX module)"
            + (f"; it has no {', '.join(missing)}" if missing and model is not None else "")
        )
    if model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.module={spec!r}: its vocabulary ({model.vocab_size}) is smaller than the "
            f"tokenizer's ({tokenizer.vocab_size}, model.path={cfg.model.path!r})"
        )
    checked: Policy = policy.in_dtype("float32")
    return checked


def run_policy(cfg: JarlConfig, policy: Policy, sharder: Sharder) -> Any:
    """The float32 parameters of the run's ``policy`` (`train.parts`: the checkpoint's
    decoder with ``model.lora``'s adapters, or the custom policy), laid out by ``sharder``: the
    checkpoint's weights, or the custom policy's own initialisers from ``trainer.seed``."""
    if not cfg.model.module:
        return with_run_lora(cfg, *load_hf(cfg.model.path, "float32", sharder=sharder))[1]
    return init_policy(jax.random.key(cfg.trainer.seed), policy, sharder)
