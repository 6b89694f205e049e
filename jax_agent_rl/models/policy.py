"""The model seam: what the engine, the learner and the weight push need of a policy.

A `Policy` is an object the run builds (`train.run_policy`) and hands to the engine, the
learner and the weight push. Its ``cfg`` (`ModelConfig`) states the sizes the rest of the
run reads (the KV layout: ``num_layers`` pools of ``num_kv_heads`` x ``head_dim``;
``vocab_size``, ``hidden_size``, ``dtype``) and holds no code. This package's decoder
families are `DecoderPolicy`, a thin object over `decoder`'s functions, and a bare
`ModelConfig` stands for its family's (`policy_of`: what a test or a bench passes the engine).
A custom policy (``model.module`` of a run: `nnx_policy.NnxPolicy` adapts a Flax NNX module)
implements the same methods.

What the two hot paths need, and no more:
- the parameter tree, declared once (`specs`: `decoder.ParamSpec` leaves with logical axes),
  from which shardings, checkpoint restore targets and weight-push targets derive
  (`policy_shardings`, `abstract_policy`), and its random initialisation (``init``: traced
  once under `init_policy`'s jit); ``in_dtype``: the same policy at another dtype (the
  learner holds float32, the engine serves in the run's ``model.dtype``);
- ``forward``: one contract (`contract`): the learner's `Packed` rows or the engine's
  `Paged` rows in, a `Forward` out (final hidden [B, T, D], the updated pages of `Paged`
  rows, the `Routing` asked for);
- its capabilities, which the engine and the learner ask rather than a model family:
  ``experts`` (routing to record, replay and check) and ``adapted`` (LoRA: the optimizer
  updates and the push sends the ``trained`` part alone; the KL reference is the ``base``);
- ``head_vd`` ([V, D], what the learner's chunked logprobs read) and ``logits`` (the
  engine's sampling head, fp32);
- ``serving_layout`` / ``checked`` (the engine's copy of pushed weights, and their check);
- ``hf_tensors``: the HF export table (the vLLM push and ``jarl export`` read it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jax_agent_rl.models import decoder
from jax_agent_rl.models.adapters import adapters_of, base_of, with_adapters
from jax_agent_rl.models.checkpoint import DECODER_RULES, TensorRule, hf_tensors_of
from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.contract import NO_ROUTING, Experts, Forward, Packed, Paged, Routing
from jax_agent_rl.models.gemma3 import Gemma3Policy
from jax_agent_rl.models.sharding import Sharder


class UnsupportedPolicyError(ValueError):
    """A feature a custom policy does not implement (LoRA, experts, HF export...)."""


class Policy(Protocol):
    """A model as the engine, the learner and the weight push use it (module docstring)."""

    @property
    def cfg(self) -> ModelConfig: ...

    def specs(self) -> Any: ...

    def init(self, key: jax.Array, dtype: Any) -> Any: ...

    def checked(self, params: Any) -> Any: ...

    def in_dtype(self, dtype: str) -> Policy:
        """The same policy with parameters and compute in ``dtype`` (its ``cfg.dtype``)."""
        ...

    def serving_layout(self, params: Any) -> Any: ...

    @property
    def experts(self) -> Experts | None:
        """Its experts (None: it has none): the engine records each token's, the learner
        replays them (`Routing`) and checks a batch's rows against them."""
        ...

    @property
    def adapted(self) -> bool:
        """Whether it trains adapters on frozen base weights (LoRA): the learner updates and
        pushes only `trained`, and its KL reference is its own `base`."""
        ...

    def trained(self, params: Any) -> Any:
        """The part of ``params`` the optimizer updates: the adapters of an adapted policy,
        else every parameter."""
        ...

    def with_trained(self, params: Any, part: Any) -> Any:
        """``params`` with its `trained` part replaced by ``part``."""
        ...

    def base(self, params: Any) -> Any:
        """``params`` without adapters (the same arrays): an adapted policy's frozen base."""
        ...

    def forward(
        self,
        params: Any,
        rows: Packed | Paged,
        *,
        sharder: Sharder,
        remat: bool = False,
        routing: Routing = NO_ROUTING,
    ) -> Forward: ...

    def head_vd(self, params: Any) -> jax.Array: ...

    def logits(self, params: Any, h_btd: jax.Array) -> jax.Array: ...

    def hf_tensors(self, params: Any, on_device: bool = False) -> Iterator[tuple[str, Any]]: ...


@dataclasses.dataclass(frozen=True)
class DecoderPolicy:
    """The Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE decoder of ``cfg`` (`decoder`) as a `Policy`."""

    cfg: ModelConfig

    def specs(self) -> decoder.Weights:
        return decoder.param_specs(self.cfg)

    def init(self, key: jax.Array, dtype: Any) -> decoder.Weights:
        return decoder.initial_params(self.cfg, key, dtype)

    def checked(self, params: Any) -> decoder.Weights:
        return decoder.checked_weights(self.cfg, params)

    def in_dtype(self, dtype: str) -> DecoderPolicy:
        return DecoderPolicy(dataclasses.replace(self.cfg, dtype=dtype))  # type: ignore[arg-type]

    def serving_layout(self, params: Any) -> decoder.Weights:
        return decoder.serving_layout(params)

    @property
    def experts(self) -> Experts | None:
        c = self.cfg
        sparse = sum(c.moe_layers)
        return Experts(sparse, c.num_experts_per_tok, c.num_experts) if sparse else None

    @property
    def adapted(self) -> bool:
        return self.cfg.lora is not None

    def trained(self, params: Any) -> Any:
        return adapters_of(params) if self.adapted else params

    def with_trained(self, params: Any, part: Any) -> Any:
        return with_adapters(base_of(params), part) if self.adapted else part

    def base(self, params: Any) -> Any:
        return base_of(params) if self.adapted else params

    def forward(
        self,
        params: Any,
        rows: Packed | Paged,
        *,
        sharder: Sharder,
        remat: bool = False,
        routing: Routing = NO_ROUTING,
    ) -> Forward:
        return decoder.forward(
            params, self.cfg, rows, sharder=sharder, remat=remat, routing=routing
        )

    def head_vd(self, params: Any) -> jax.Array:
        head: jax.Array = params.embed if params.lm_head is None else params.lm_head.T
        return head

    def logits(self, params: Any, h_btd: jax.Array) -> jax.Array:
        return decoder.lm_logits(params, h_btd)

    def hf_rules(self) -> tuple[TensorRule, ...]:
        return DECODER_RULES

    def hf_tensors(self, params: Any, on_device: bool = False) -> Iterator[tuple[str, Any]]:
        if self.cfg.lora is not None:
            raise ValueError(
                "the weights carry LoRA adapters, which an HF checkpoint has no tensor for: "
                "merge them into the base (adapters.merge) or write them as a PEFT adapter "
                "(save_peft)"
            )
        return hf_tensors_of(self.cfg, self.specs(), DECODER_RULES, params, on_device)


def family_policy(cfg: ModelConfig) -> DecoderPolicy | Gemma3Policy:
    """The policy of ``cfg``'s family: Gemma 3's (`gemma3`), else the decoder's."""
    return Gemma3Policy(cfg) if cfg.family == "gemma3_text" else DecoderPolicy(cfg)


def policy_of(model: ModelConfig | Policy) -> Policy:
    """``model`` itself if it is a policy; a `ModelConfig`'s family's (`family_policy`)."""
    return family_policy(model) if isinstance(model, ModelConfig) else model


def policy_shardings(policy: Policy, sharder: Sharder) -> Any:
    """NamedShardings of ``policy``'s parameters (`Policy.specs`)."""
    return decoder.spec_shardings(policy.specs(), sharder)


def abstract_policy(policy: Policy, sharder: Sharder) -> Any:
    """ShapeDtypeStructs of ``policy``'s parameters in its dtype (restore and push targets)."""
    return decoder.spec_structs(policy.specs(), policy.cfg.jnp_dtype, sharder)


def init_policy(key: jax.Array, policy: Policy, sharder: Sharder) -> Any:
    """``policy``'s own random initialisation (`Policy.init`) in its dtype, laid out by
    ``sharder``."""
    init = jax.jit(policy.init, static_argnums=1, out_shardings=policy_shardings(policy, sharder))
    return init(key, policy.cfg.jnp_dtype)


def init_params(key: jax.Array, cfg: ModelConfig, sharder: Sharder) -> Any:
    """Random weights of ``cfg``'s family (HF's scheme: `Policy.init`) in its dtype, laid out
    by ``sharder``."""
    return init_policy(key, family_policy(cfg), sharder)


def head_logits(head_vd: jax.Array, h_btd: jax.Array) -> jax.Array:
    """Logits [B, T, V] in fp32 from a head [V, D] (a custom policy's `Policy.logits`)."""
    return jnp.einsum("btd,vd->btv", h_btd, head_vd, preferred_element_type=jnp.float32)
