"""Model configuration for the decoder family, built from an HF ``config.json``.

One frozen, hashable dataclass (`ModelConfig`) describes every supported checkpoint; it is a
static argument of every jitted model function. `ModelConfig.from_hf` is strict: a field that
would change the forward pass and that this decoder does not implement is an error naming it,
and so is a field it has never heard of, so a new architecture never loads silently wrong.

``qwen3_moe`` (Qwen3-MoE) is Qwen3 with a sparse MLP in some layers: a router picks
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``
per token. Layer i is sparse unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``; the others are dense MLPs of ``intermediate_size``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import jax.numpy as jnp
import numpy as np

from jax_agent_rl.files import regular_file
from jax_agent_rl.models.config_checks import (
    UnsupportedConfigError,
    check_positive,
    check_size,
    flag,
    shown,
)
from jax_agent_rl.models.lora import MLP_TARGETS, Lora
from jax_agent_rl.models.rope import MAX_POSITIONS, Llama3RopeScaling, rope_from_hf

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"]
DType = Literal["float32", "bfloat16"]

# model_type -> (q/k/v bias by default, q/k RMSNorm)
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
}
_MOE_FAMILIES = frozenset({"qwen3_moe"})
# model_type -> the config.json reader of a family with a module of its own (Gemma 3's:
# `gemma3.config_from_hf`), which registers it (`register_family`) as the package imports it
Reader = Callable[[dict[str, Any], DType], "ModelConfig"]
_OWN_FAMILIES: dict[str, Reader] = {}


def register_family(model_type: str, reader: Reader) -> None:
    """``reader`` reads a config.json of ``model_type`` (`ModelConfig.from_hf` calls it): a
    `ModelConfig` of the family's sizes with its own settings in ``arch``."""
    if model_type in _FAMILIES or _OWN_FAMILIES.get(model_type, reader) is not reader:
        raise ValueError(f"model_type {model_type!r} has a reader already")
    _OWN_FAMILIES[model_type] = reader


# Fields that describe the checkpoint or the HF runtime but do not change the forward pass.
_METADATA_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "attention_dropout",  # never applied: RL and inference run deterministic forwards
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "id2label",
        "initializer_range",
        "is_encoder_decoder",
        "label2id",
        "max_window_layers",  # only read when use_sliding_window is true (rejected below)
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "pretraining_tp",  # a slicing of the same matmuls in HF; mathematically a no-op
        "problem_type",
        "return_dict",
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)
# Qwen3-MoE's fields. ``output_router_logits`` only makes HF return the router's logits;
# ``num_experts`` is also spelt ``num_local_experts`` (transformers >= 5 writes that one).
MOE_FIELDS = frozenset(
    {
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_aux_loss_coef",
        "output_router_logits",
    }
)
# Fields that change the forward pass; each is either read into ModelConfig or checked below.
_MODEL_FIELDS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "max_position_embeddings",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "use_sliding_window",
        "sliding_window",
        "layer_types",
        "use_mrope",
    }
)


# field -> (its config.json key, the largest value accepted). Far above any real checkpoint
# (Llama 3.1 405B: 126 layers, 128 heads, hidden 16384, intermediate 53248; vocabularies reach
# ~260k tokens, contexts 10M positions), and checked before anything is allocated or looped
# over, so that a corrupt or hostile config.json fails at once instead of after a minute of
# loops or an allocation that exhausts the memory.
_SIZE_BOUNDS: dict[str, tuple[str, int]] = {
    "vocab_size": ("vocab_size", 1 << 22),
    "hidden_size": ("hidden_size", 1 << 17),
    "intermediate_size": ("intermediate_size", 1 << 20),
    "num_layers": ("num_hidden_layers", 1024),
    "num_heads": ("num_attention_heads", 1024),
    "num_kv_heads": ("num_key_value_heads", 1024),
    "head_dim": ("head_dim", 1024),
    "max_position_embeddings": ("max_position_embeddings", MAX_POSITIONS),
}
# the same for Qwen3-MoE's sizes, checked when the family has experts (DeepSeek-V3: 256
# experts of 8 per token; Qwen3-235B-A22B: 128 of 8)
_MOE_BOUNDS: dict[str, tuple[str, int]] = {
    "num_experts": ("num_experts", 1 << 14),
    "num_experts_per_tok": ("num_experts_per_tok", 1 << 14),
    "moe_intermediate_size": ("moe_intermediate_size", 1 << 20),
    "decoder_sparse_step": ("decoder_sparse_step", 1024),
}


# The smallest normal float32 (and bfloat16): a smaller rms_norm_eps is flushed to zero on
# devices that flush denormals (XLA's CPU backend does), and an all-zero row then divides by 0.
_MIN_EPS = 2.0**-126
# XLA options of every program of a model with ``exact_pages`` (the engine's and the learner's):
# by default XLA may keep a bf16 op's result in fp32 into the next op where it fuses the two, so
# the same op rounds or not by how its program fused it (the decode step's and the training
# forward's differed by 0.012 in a logprob on the demo's model); off, every op rounds as written.
# XLA:CPU's MLIR fusion emitters still rounded a bf16 value of one fusion otherwise than of
# another (a decode step's layer output one ulp from the prefill's for the same token: one
# logprob in ~2400 off by 1.5e-3 downstream); its elemental emitters do not
EXACT_OPTIONS = {"xla_allow_excess_precision": False, "xla_cpu_use_fusion_emitters": False}


def compiler_options(cfg: ModelConfig) -> dict[str, Any] | None:
    """The XLA options a program computing ``cfg``'s model compiles with: `EXACT_OPTIONS`
    where its logprobs are to be exact (``exact_pages``), else the defaults."""
    return dict(EXACT_OPTIONS) if cfg.exact_pages else None


# The largest float32: RoPE's frequencies are computed in float32 from rope_theta.
_MAX_THETA = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE architecture; ``dtype`` is the parameter and
    compute dtype. The MoE fields (module docstring) keep their defaults in the dense families.
    ``router_aux_loss_coef`` is HF's weight of the load-balancing loss in its training loss:
    carried so that an exported checkpoint states it; no loss of ours reads it yet. ``lora``:
    the adapters the layers carry (`jax_agent_rl.models.lora`), none in a checkpoint's own
    config (``model.lora`` of a run adds them). ``exact_pages``: 0, or the page size of the
    engine whose logprobs the training forward reproduces bit for bit (`model.exact_logprobs`
    of a run: the training attention reads keys in pages of that size as decode does,
    `models.paged.exact_attention`; `EXACT_OPTIONS` compile both). ``arch``: the settings
    of a family with a module of its own (`_OWN_FAMILIES`; Gemma 3: `gemma3.Gemma3Layout`),
    frozen data, None for the decoder's families; its ``to_hf`` writes its config.json."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    dtype: DType = "float32"
    lora: Lora | None = None
    exact_pages: int = 0
    arch: Any = None

    def __post_init__(self) -> None:
        if (self.arch is None) != (self.family in _FAMILIES):
            raise UnsupportedConfigError(
                f"a {self.family} config {'needs' if self.arch is None else 'takes no'} "
                "architecture settings (arch)"
            )
        for field, (key, bound) in _SIZE_BOUNDS.items():
            check_size(key if key == field else f"{key} ({field})", getattr(self, field), bound)
        # stored as floats (config.json may write 10000 for 10000.0)
        eps = check_positive("rms_norm_eps", self.rms_norm_eps, above=_MIN_EPS, below=1.0)
        object.__setattr__(self, "rms_norm_eps", eps)
        # theta <= 1 would make RoPE's wavelengths shrink (or stay) along the head: no model has
        theta = check_positive("rope_theta", self.rope_theta, above=1.0, below=_MAX_THETA)
        object.__setattr__(self, "rope_theta", theta)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16"):
            raise UnsupportedConfigError(f"dtype={self.dtype!r}: expected 'float32' or 'bfloat16'")
        self._check_moe()
        mlp_targets = sorted(MLP_TARGETS & set(self.lora.targets if self.lora else ()))
        if self.family in _MOE_FAMILIES and mlp_targets:
            raise UnsupportedConfigError(
                f"LoRA targets {mlp_targets} on {self.family}: adapters on the MLPs of a model "
                "with experts are not supported; target the attention projections q, k, v, o"
            )
        self._check_lora_rank()

    def _check_lora_rank(self) -> None:
        """An adapter's rank at most its projection's smaller side, min(in, out), A B's rank
        at most: past it, parameters and no function (a typo's 10**12 ended in a traceback)."""
        if self.lora is None:
            return
        attn, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        d, f = self.hidden_size, self.intermediate_size
        sides = {"q": (d, attn), "k": (d, kv), "v": (d, kv), "o": (attn, d), "gate": (d, f),
                 "up": (d, f), "down": (f, d)}  # fmt: skip
        target = min(self.lora.targets, key=lambda t: min(sides[t]))
        side = min(sides[target])
        if self.lora.rank > side:
            raise UnsupportedConfigError(
                f"LoRA rank={self.lora.rank} exceeds the {target} projection's smaller side "
                f"(in {sides[target][0]}, out {sides[target][1]}): an adapter's A B has rank at "
                f"most min(in, out), so a larger rank adds parameters and nothing else; use a "
                f"rank <= {side}"
            )

    def _check_moe(self) -> None:
        """The MoE fields: all sizes for a MoE family, all at their defaults for a dense one."""
        if self.family not in _MOE_FAMILIES:
            dense = ModelConfig.__dataclass_fields__
            set_fields = [
                f
                for f in (*_MOE_BOUNDS, "norm_topk_prob", "mlp_only_layers", "router_aux_loss_coef")
                if getattr(self, f) != dense[f].default
            ]
            if set_fields:
                raise UnsupportedConfigError(
                    f"{set_fields} are Qwen3-MoE fields; a {self.family} model has no experts"
                )
            return
        for field, (key, bound) in _MOE_BOUNDS.items():
            check_size(key, getattr(self, field), bound)
        if self.num_experts_per_tok > self.num_experts:
            raise UnsupportedConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise UnsupportedConfigError(
                f"norm_topk_prob={shown(self.norm_topk_prob)}: expected true or false"
            )
        layers = self.mlp_only_layers
        if (
            not isinstance(layers, tuple)
            or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
            or not all(0 <= i < self.num_layers for i in layers)
            or len(set(layers)) != len(layers)
        ):
            raise UnsupportedConfigError(
                f"mlp_only_layers={shown(layers)}: expected distinct layer indices from 0 to "
                f"{self.num_layers - 1}"
            )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < 1e6:
            raise UnsupportedConfigError(
                f"router_aux_loss_coef={shown(coef)}: expected a number from 0 to 1e6"
            )
        object.__setattr__(self, "router_aux_loss_coef", float(coef))

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the sparse one (HF's ``Qwen3MoeDecoderLayer`` rule)."""
        return tuple(
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def jnp_dtype(self) -> Any:
        return jnp.float32 if self.dtype == "float32" else jnp.bfloat16

    @property
    def num_params(self) -> int:
        d, f, hk = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hk * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += hk * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hk
        sparse = sum(self.moe_layers)
        moe = d * self.num_experts + 3 * self.num_experts * d * self.moe_intermediate_size
        per_layer = attn + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        mlps = (self.num_layers - sparse) * 3 * d * f + sparse * moe
        own = 0 if self.arch is None else self.arch.extra_params(self)  # (Gemma's 2 norms more)
        return self.num_layers * per_layer + mlps + self.vocab_size * d + head + d + own

    @property
    def active_params(self) -> int:
        """The parameters one token uses: `num_params` less the experts a sparse layer does
        not choose (Qwen3-30B-A3B: 3.3B of 30.5B)."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params - sum(self.moe_layers) * 3 * idle * self.hidden_size * (
            self.moe_intermediate_size
        )

    @property
    def matmul_params_per_token(self) -> int:
        """The matmul weights one token multiplies with, its FLOPs per forward being twice that
        (plus attention's scores): the q/k/v/o projections, each layer's MLP (a sparse layer's
        router and ``num_experts_per_tok`` of its experts) and the head. Qwen3-30B-A3B's
        3.3B active parameters are these plus the embedding table."""
        d, hk = self.hidden_size, self.head_dim
        attn = d * hk * (2 * self.num_heads + 2 * self.num_kv_heads)
        sparse = sum(self.moe_layers)
        moe = d * self.num_experts + 3 * self.num_experts_per_tok * d * self.moe_intermediate_size
        mlps = (self.num_layers - sparse) * 3 * d * self.intermediate_size + sparse * moe
        return self.num_layers * attn + mlps + self.vocab_size * d

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: DType = "float32") -> ModelConfig:
        """Builds the config from a parsed HF ``config.json``; raises on anything unsupported."""
        if not isinstance(hf, dict):
            raise UnsupportedConfigError(
                f"expected a JSON object of config fields, got the {type(hf).__name__} {shown(hf)}"
            )
        model_type = hf.get("model_type")
        if isinstance(model_type, str) and model_type in _OWN_FAMILIES:
            return _OWN_FAMILIES[model_type](hf, dtype)
        if not isinstance(model_type, str) or model_type not in _FAMILIES:
            supported = sorted({*_FAMILIES, *_OWN_FAMILIES})
            raise UnsupportedConfigError(
                f"model_type={shown(model_type)} is not supported (supported: {supported})"
            )
        allowed = _METADATA_FIELDS | _MODEL_FIELDS
        if model_type in _MOE_FAMILIES:
            allowed |= MOE_FIELDS
        unknown = sorted(set(hf) - allowed)
        if unknown:
            raise UnsupportedConfigError(
                f"unknown {model_type} config field(s) {unknown}: refusing to guess their effect"
            )
        default_bias, qk_norm = _FAMILIES[model_type]
        _require(hf, "hidden_act", "silu")
        _require(hf, "mlp_bias", False)
        _require(hf, "use_sliding_window", False)
        _require(hf, "use_mrope", False)
        layer_types = hf.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)
        ):
            raise UnsupportedConfigError(
                f"layer_types={shown(layer_types)}: only a list of 'full_attention'"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        for field in required:
            if field not in hf:
                raise UnsupportedConfigError(f"config.json lacks the required field {field!r}")
        # sizes are checked by __post_init__; these two first, as head_dim may derive from them
        hidden = check_size("hidden_size", hf["hidden_size"], _SIZE_BOUNDS["hidden_size"][1])
        num_heads = check_size(
            "num_attention_heads", hf["num_attention_heads"], _SIZE_BOUNDS["num_heads"][1]
        )
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise UnsupportedConfigError(
                    f"hidden_size={hidden} is not a multiple of num_attention_heads={num_heads} "
                    "and config.json gives no head_dim"
                )
            head_dim = hidden // num_heads
        theta, scaling = rope_from_hf(hf)
        num_kv_heads = hf.get("num_key_value_heads")  # null or absent: one per attention head
        return cls(
            family=cast(Family, model_type),  # one of _FAMILIES, checked above
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=flag(hf, "tie_word_embeddings", False),
            qkv_bias=flag(hf, "attention_bias", default_bias),
            qk_norm=qk_norm,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            **(_moe_fields(hf) if model_type in _MOE_FAMILIES else {}),
            dtype=dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: DType = "float32") -> ModelConfig:
        """Reads ``config.json`` from a local checkpoint folder; an error (one line) names the
        file: no UTF-8, no JSON, JSON nested too deeply, or a value `from_hf` refuses."""
        config_file = Path(path) / "config.json"
        if Path(path).exists() and not Path(path).is_dir():  # ("[Errno 20] Not a directory")
            raise FileNotFoundError(f"{path} is not a folder: expected an HF checkpoint folder")
        if not regular_file(config_file, "a checkpoint folder"):
            if (Path(path) / "adapter_config.json").is_file():  # (`jarl export` of a LoRA run)
                raise FileNotFoundError(
                    f"{path} is a LoRA adapter folder (adapter_config.json), not a checkpoint: "
                    "evaluate the run itself (jarl eval RUN), or its adapters merged into the "
                    "base (jarl export RUN --merge, then --checkpoint that folder)"
                )
            raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
        try:
            hf = json.loads(config_file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UnsupportedConfigError(
                f"{config_file} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
                f"{e.start}"
            ) from None
        except ValueError as e:  # JSONDecodeError, or an integer too long to read
            raise UnsupportedConfigError(f"{config_file} is not valid JSON: {e}") from None
        except RecursionError:
            raise UnsupportedConfigError(f"{config_file} is JSON nested too deeply") from None
        try:
            return cls.from_hf(hf, dtype=dtype)
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"{config_file}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` this config round-trips through (transformers >= 5 layout)."""
        if self.arch is not None:
            hf_of_own: dict[str, Any] = self.arch.to_hf(self)
            return hf_of_own
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling), rope_type="llama3")
        hf: dict[str, Any] = {
            "architectures": [arch[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "dtype": self.dtype,
        }
        if self.family in _MOE_FAMILIES:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        if self.family != "qwen2":  # Qwen2's bias is fixed by the architecture, not a field
            hf["attention_bias"] = self.qkv_bias
        elif not self.qkv_bias:
            raise UnsupportedConfigError("qwen2 checkpoints always carry q/k/v biases")
        return hf


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's fields of ``hf`` as `ModelConfig` keywords (checked by its
    ``__post_init__``): the three sizes are required, the rest default as in HF."""
    experts = {f: hf[f] for f in ("num_experts", "num_local_experts") if f in hf}
    if len(experts) == 2 and hf["num_experts"] != hf["num_local_experts"]:
        raise UnsupportedConfigError(
            f"num_experts={shown(hf['num_experts'])} and num_local_experts="
            f"{shown(hf['num_local_experts'])} disagree: give one"
        )
    for field in ("num_experts_per_tok", "moe_intermediate_size"):
        if field not in hf:
            raise UnsupportedConfigError(f"config.json lacks the required field {field!r}")
    if not experts:
        raise UnsupportedConfigError("config.json lacks the required field 'num_experts'")
    layers = hf.get("mlp_only_layers", [])
    if not isinstance(layers, list):
        raise UnsupportedConfigError(f"mlp_only_layers={shown(layers)}: expected a list")
    return {
        "num_experts": next(iter(experts.values())),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": flag(hf, "norm_topk_prob", False),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(layers),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


def _require(hf: dict[str, Any], field: str, expected: object) -> None:
    if field in hf and hf[field] is not None and hf[field] != expected:
        raise UnsupportedConfigError(
            f"{field}={shown(hf[field])} is not supported (only {expected!r})"
        )
