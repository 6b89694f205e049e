"""Model shapes by name, for planning without a checkpoint at hand (``jarl plan --model``).

Each preset is the architecture part of the model's ``config.json`` on the Hugging Face Hub
(Qwen/Qwen2.5-<size>-Instruct and Qwen/Qwen3-<size>: the dense models; Qwen/Qwen3-30B-A3B: the
mixture of experts; google/gemma-3-1b-it and google/gemma-3-4b-it's text part: Gemma 3, in the
Hub's older config layout), read by
`ModelConfig.from_hf` as a checkpoint's would be. Only shapes matter to a plan: no weights.
"""

from __future__ import annotations

from typing import Any

from jax_agent_rl.models import ModelConfig


def _qwen25(hidden: int, mlp: int, layers: int, heads: int, kv: int, tied: bool) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": 151936 if tied else 152064,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
    }


def _qwen3(hidden: int, mlp: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "hidden_act": "silu",
    }


def _gemma3(
    hidden: int, mlp: int, layers: int, heads: int, kv: int, vocab: int, window: int
) -> dict[str, Any]:
    return {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 256,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": 256,
        "sliding_window": window,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": 32768,
    }


# name -> config.json (architecture fields) of the Hub checkpoint
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, tied=True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, tied=True),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, tied=True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, tied=False),
    "qwen2.5-14b": {**_qwen25(5120, 13824, 48, 40, 8, tied=False), "rms_norm_eps": 1e-5},
    "qwen2.5-32b": {**_qwen25(5120, 27648, 64, 40, 8, tied=False), "rms_norm_eps": 1e-5},
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    # 128 experts of width 768, 8 per token, every layer sparse: 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": {
        **_qwen3(2048, 6144, 48, 32, tied=False),
        "model_type": "qwen3_moe",
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
    # local layers of a 512-position window, every sixth global
    "gemma3-1b": _gemma3(1152, 6912, 26, 4, 1, 262144, 512),
    # the 4B's language model: a 1024-position window, the global layers' RoPE scaled by 8
    "gemma3-4b": {
        **_gemma3(2560, 10240, 34, 8, 4, 262208, 1024),
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
    },
}


def preset_model(name: str) -> ModelConfig:
    """The preset ``name``'s shapes; a `ValueError` naming the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is not a preset: use one of {', '.join(PRESETS)}")
    return ModelConfig.from_hf(PRESETS[name])
