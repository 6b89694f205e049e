"""HF checkpoints written on this machine by transformers itself, for tests, demos and benchmarks.

`write_hf_checkpoint` builds a random-init model of one family with transformers'
``save_pretrained``; nothing is downloaded. Every parameter gets a non-trivial random value
(biases and norm scales included, which HF initialises to 0 and 1), so parity checks exercise
every term of the forward pass. Needs the ``parity`` extra (torch, transformers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax_agent_rl.models.config import MOE_FIELDS

# Small members of each family; every one uses grouped-query attention.
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        # original context 16 so the scaling changes the frequencies seen in short tests
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads, as in real Qwen3 configs
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
}

# A small Qwen3-MoE: 8 experts of which 2 per token; layer 1 is a dense MLP (mlp_only_layers).
TINY_MOE: dict[str, Any] = dict(
    model_type="qwen3_moe",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)

# The conformance and tiny benchmark model: ~0.9M parameters, head_dim 64 (vLLM's CPU attention
# needs 64 or more, and vLLM's Qwen2 takes head_dim as hidden / heads, ignoring the config's
# head_dim), GQA, q/k/v bias, tied embeddings.
TINY_QWEN2: dict[str, Any] = dict(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # two, so the engine's tests can shard them over a tensor axis
    head_dim=64,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)

# The conformance suite's Qwen3-MoE: TINY_QWEN2's attention shape (head_dim 64, as vLLM's CPU
# attention needs), 8 experts of which 2 per token, layer 1 a dense MLP (mlp_only_layers)
TINY_QWEN3_MOE: dict[str, Any] = {
    **TINY_MOE,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}

# Small Gemma 3 text models (`gemma3`): local layers of a 5-position window (short tests cross
# it and page boundaries), a global layer between; the 1B's shape (scores scaled by
# head_dim ** -0.5, no RoPE scaling) and the 4B's (query_pre_attn_scalar apart from head_dim,
# the global layers' RoPE scaled linearly by 8).
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"
TINY_GEMMA3: dict[str, dict[str, Any]] = {
    "gemma3-1b": dict(
        model_type="gemma3_text",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=5,
        layer_types=[_LOCAL, _LOCAL, _GLOBAL, _LOCAL],
        rope_parameters={
            _LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
            _GLOBAL: {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        max_position_embeddings=256,
    ),
    "gemma3-4b": dict(
        model_type="gemma3_text",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=[_LOCAL, _GLOBAL, _LOCAL],
        rope_parameters={
            _LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
            _GLOBAL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        max_position_embeddings=256,
    ),
}

# The demo model's size (`cli.demo.MODEL`) in Gemma 3's layout, with a window of 16 positions
# (the demo's prompts are ~200 tokens): the RL run of tests/train/test_gemma3_run.py and the TPU
# plan of tests/plan/test_plan.py; ``vocab_size`` is the tokenizer's.
DEMO_GEMMA3: dict[str, Any] = dict(
    model_type="gemma3_text",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=16,
    layer_types=[_LOCAL, _GLOBAL, _LOCAL],
    rope_parameters={
        _LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
        _GLOBAL: {"rope_type": "default", "rope_theta": 1000000.0},
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)

# The benchmark model: Qwen2-style, ~40M parameters.
SMALL_QWEN2: dict[str, Any] = dict(
    model_type="qwen2",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def dense_twin(moe: dict[str, Any]) -> dict[str, Any]:
    """The dense Qwen3 model (HF fields) of a Qwen3-MoE's active parameter count, to time a
    MoE against: the same attention, norms, embeddings and head, and in every layer a dense
    MLP whose width is the MoE's active MLP parameters per token (a sparse layer's router,
    D x E, and k experts, 3 x D x moe_intermediate_size each; a dense layer's 3 x D x
    intermediate_size) over 3 x D x layers, rounded: the twin's active parameters differ from
    the MoE's by at most 1.5 x D x layers (the rounding)."""
    from jax_agent_rl.models.config import ModelConfig

    cfg = ModelConfig.from_hf(moe)
    D, L = cfg.hidden_size, cfg.num_layers
    sparse = sum(cfg.moe_layers)
    expert = D * cfg.num_experts + 3 * cfg.num_experts_per_tok * D * cfg.moe_intermediate_size
    mlp = sparse * expert + (L - sparse) * 3 * D * cfg.intermediate_size
    fields = {k: v for k, v in moe.items() if k not in MOE_FIELDS}  # Qwen3-MoE's fields dropped
    return {**fields, "model_type": "qwen3", "intermediate_size": round(mlp / (3 * D * L))}


def write_hf_checkpoint(path: str | Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Writes ``config`` (HF fields, ``model_type`` included) as a random-init fp32 checkpoint."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    fields = dict(config)
    config_class = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    path = Path(path)
    model.save_pretrained(path)
    return path
