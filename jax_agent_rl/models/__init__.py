"""The model families (the decoder's: Llama 3, Qwen2/Qwen2.5, Qwen3, Qwen3-MoE; Gemma 3's:
`Gemma3Policy`): config, weights, forward, HF checkpoints; LoRA adapters (`Lora`;
`jax_agent_rl.models.adapters` for PEFT folders and merging); the model seam the engine and
the learner run (`Policy`, the object a run builds and hands them; `policy_of` of a bare
`ModelConfig` is its family's; and the forward's contract: `Packed` or `Paged` rows in, a
`Forward` out, `Routing` for experts; a Flax NNX module's adapter:
`jax_agent_rl.models.nnx_policy`, which imports flax)."""

from jax_agent_rl.models.checkpoint import CheckpointError
from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.config_checks import UnsupportedConfigError
from jax_agent_rl.models.contract import NO_ROUTING, Forward, Packed, Paged, Routing
from jax_agent_rl.models.decoder import (
    KVPages,
    Layer,
    ParamSpec,
    Weights,
    abstract_params,
    checked_weights,
    forward,
    init_pages,
    lm_logits,
    page_shardings,
    param_shardings,
    param_specs,
)
from jax_agent_rl.models.gemma3 import Gemma3Policy
from jax_agent_rl.models.hf_checkpoint import hf_tensors, load_hf, save_hf
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.policy import (
    DecoderPolicy,
    Policy,
    UnsupportedPolicyError,
    abstract_policy,
    init_params,
    init_policy,
    policy_of,
    policy_shardings,
)
from jax_agent_rl.models.rope import Llama3RopeScaling
from jax_agent_rl.models.sharding import (
    MESH_AXES,
    Sharder,
    ShardingRules,
    inference_mesh,
    make_mesh,
    one_device_sharder,
    request_cpu_devices,
)

__all__ = [
    "MESH_AXES",
    "NO_ROUTING",
    "CheckpointError",
    "DecoderPolicy",
    "Forward",
    "Gemma3Policy",
    "KVPages",
    "Layer",
    "Llama3RopeScaling",
    "Lora",
    "ModelConfig",
    "Packed",
    "Paged",
    "ParamSpec",
    "Policy",
    "Routing",
    "Sharder",
    "ShardingRules",
    "UnsupportedConfigError",
    "UnsupportedPolicyError",
    "Weights",
    "abstract_params",
    "abstract_policy",
    "checked_weights",
    "forward",
    "hf_tensors",
    "inference_mesh",
    "init_pages",
    "init_params",
    "init_policy",
    "lm_logits",
    "load_hf",
    "make_mesh",
    "one_device_sharder",
    "page_shardings",
    "param_shardings",
    "param_specs",
    "policy_of",
    "policy_shardings",
    "request_cpu_devices",
    "save_hf",
]
