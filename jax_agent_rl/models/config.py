"""Model configuration for the decoder family, built from an HF ``config.json``.

One frozen, hashable dataclass (`ModelConfig`) describes every supported checkpoint; it is a
static argument of every jitted model function. `ModelConfig.from_hf` is strict: a field that
would change the forward pass and that this decoder does not implement is an error naming it,
and so is a field it has never heard of, so a new architecture never loads silently wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal, cast

import jax.numpy as jnp
import numpy as np

from jax_agent_rl.files import regular_file

Family = Literal["llama", "qwen2", "qwen3"]
DType = Literal["float32", "bfloat16"]

# model_type -> (q/k/v bias by default, q/k RMSNorm)
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}

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
    "max_position_embeddings": ("max_position_embeddings", 1 << 24),
}


class UnsupportedConfigError(ValueError):
    """An HF config field (named in the message) that this decoder cannot honour."""


# The smallest normal float32 (and bfloat16): a smaller rms_norm_eps is flushed to zero on
# devices that flush denormals (XLA's CPU backend does), and an all-zero row then divides by 0.
_MIN_EPS = 2.0**-126
# The largest float32: RoPE's frequencies are computed in float32 from rope_theta.
_MAX_THETA = float(np.finfo(np.float32).max)


def _shown(value: object, limit: int = 60) -> str:
    """``value``'s repr for a one-line message, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for Python to print
        return f"<a {type(value).__name__} too long to print>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_size(key: str, value: object, bound: int) -> int:
    """``value`` as a size: a whole number (not a bool) from 1 to ``bound``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
        raise UnsupportedConfigError(
            f"{key}={_shown(value)} is not a size this decoder accepts: expected a whole number "
            f"from 1 to {bound}"
        )
    return value


def _check_positive(key: str, value: object, above: float = 0.0, below: float = math.inf) -> float:
    """``value`` as a float: a finite number (not a bool) above ``above`` and below ``below``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        x = float(value) if abs(value) < 1e308 else math.inf
        if math.isfinite(x) and above < x < below:
            return x
    limit = "" if below == math.inf else f" and below {below:g}"
    raise UnsupportedConfigError(
        f"{key}={_shown(value)}: expected a finite number above {above:g}{limit}"
    )


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name, value in _llama3_values("rope_parameters", dataclasses.asdict(self)).items():
            object.__setattr__(self, name, value)


def _llama3_values(key: str, values: dict[str, Any]) -> dict[str, Any]:
    """`Llama3RopeScaling`'s fields checked, the factors as floats; errors name ``key.field``."""
    out = dict(values)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):  # stored as floats
        out[name] = _check_positive(f"{key}.{name}", values[name])
    low, high = out["low_freq_factor"], out["high_freq_factor"]
    if high <= low:  # the smooth interpolation divides by their difference
        raise UnsupportedConfigError(
            f"{key}.high_freq_factor={high} must exceed low_freq_factor={low}"
        )
    _check_size(
        f"{key}.original_max_position_embeddings",
        values["original_max_position_embeddings"],
        _SIZE_BOUNDS["max_position_embeddings"][1],
    )
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One Llama 3 / Qwen2 / Qwen3 architecture; ``dtype`` is the parameter and compute dtype."""

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
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        for field, (key, bound) in _SIZE_BOUNDS.items():
            _check_size(key if key == field else f"{key} ({field})", getattr(self, field), bound)
        # stored as floats (config.json may write 10000 for 10000.0)
        eps = _check_positive("rms_norm_eps", self.rms_norm_eps, above=_MIN_EPS, below=1.0)
        object.__setattr__(self, "rms_norm_eps", eps)
        # theta <= 1 would make RoPE's wavelengths shrink (or stay) along the head: no model has
        theta = _check_positive("rope_theta", self.rope_theta, above=1.0, below=_MAX_THETA)
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
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.num_layers * per_layer + self.vocab_size * d + head + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: DType = "float32") -> ModelConfig:
        """Builds the config from a parsed HF ``config.json``; raises on anything unsupported."""
        if not isinstance(hf, dict):
            raise UnsupportedConfigError(
                f"expected a JSON object of config fields, got the {type(hf).__name__} {_shown(hf)}"
            )
        model_type = hf.get("model_type")
        if not isinstance(model_type, str) or model_type not in _FAMILIES:
            raise UnsupportedConfigError(
                f"model_type={_shown(model_type)} is not supported (supported: {sorted(_FAMILIES)})"
            )
        unknown = sorted(set(hf) - _METADATA_FIELDS - _MODEL_FIELDS)
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
                f"layer_types={_shown(layer_types)}: only a list of 'full_attention'"
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
        hidden = _check_size("hidden_size", hf["hidden_size"], _SIZE_BOUNDS["hidden_size"][1])
        num_heads = _check_size(
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
        theta, scaling = _rope(hf)
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
            tie_embeddings=_flag(hf, "tie_word_embeddings", False),
            qkv_bias=_flag(hf, "attention_bias", default_bias),
            qk_norm=qk_norm,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            dtype=dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: DType = "float32") -> ModelConfig:
        """Reads ``config.json`` from a local checkpoint folder; an error (one line) names the
        file: no UTF-8, no JSON, JSON nested too deeply, or a value `from_hf` refuses."""
        config_file = Path(path) / "config.json"
        if not regular_file(config_file, "a checkpoint folder"):
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
        arch = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }
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
        if self.family != "qwen2":  # Qwen2's bias is fixed by the architecture, not a field
            hf["attention_bias"] = self.qkv_bias
        elif not self.qkv_bias:
            raise UnsupportedConfigError("qwen2 checkpoints always carry q/k/v biases")
        return hf


def _flag(hf: dict[str, Any], field: str, default: bool) -> bool:
    value = hf.get(field, default)
    if not isinstance(value, bool):
        raise UnsupportedConfigError(f"{field}={_shown(value)}: expected true or false")
    return value


def _require(hf: dict[str, Any], field: str, expected: object) -> None:
    if field in hf and hf[field] is not None and hf[field] != expected:
        raise UnsupportedConfigError(
            f"{field}={_shown(hf[field])} is not supported (only {expected!r})"
        )


def _rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Reads RoPE from either layout: ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older checkpoints). Errors name the field as config.json spells it; both
    layouts given must agree, and so must ``rope_type`` and its older spelling ``type``."""
    for field in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(field, {}), dict | None):
            raise UnsupportedConfigError(
                f"{field}={_shown(hf[field])}: expected a JSON object or null"
            )
    given = {f: _rope_fields(f, hf[f]) for f in ("rope_parameters", "rope_scaling") if hf.get(f)}
    for field, params in given.items():
        if params.get("rope_type", "default") not in ("default", "llama3"):
            raise UnsupportedConfigError(
                f"{field}.rope_type={_shown(params['rope_type'])} is not supported (only "
                "'default', 'llama3')"
            )
    if len(given) == 2:
        new, old = given.values()
        clash = sorted(k for k in old if new.get(k, old) != old[k])  # (old: absent from new)
        if clash:
            raise UnsupportedConfigError(
                f"rope_parameters and rope_scaling disagree on {_shown(clash)}: give one"
            )
    field = next(iter(given), "rope_parameters")
    params = dict(given.get(field, {}))
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("rope_theta", theta) != theta:
        raise UnsupportedConfigError(
            f"rope_theta={_shown(hf['rope_theta'])} and {field}.rope_theta={_shown(theta)} "
            "disagree: give one"
        )
    rope_type = params.pop("rope_type", "default")
    if rope_type == "default":
        if params:  # partial_rotary_factor, mrope_section, ...: each changes the forward pass
            raise UnsupportedConfigError(
                f"{field}: fields {_shown(sorted(params))} are not supported with "
                "rope_type 'default'"
            )
        return theta, None
    fields = {f.name for f in dataclasses.fields(Llama3RopeScaling)}
    extra, missing = sorted(set(params) - fields), sorted(fields - set(params))
    if extra or missing:
        raise UnsupportedConfigError(
            f"{field}: llama3 rope scaling: unexpected fields {extra}, missing fields {missing}"
        )
    return theta, Llama3RopeScaling(**_llama3_values(field, params))


def _rope_fields(field: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the older ``type`` read as ``rope_type`` (both given must agree)."""
    out = dict(params)
    if "type" in out:
        older = out.pop("type")
        if out.setdefault("rope_type", older) != older:
            raise UnsupportedConfigError(
                f"{field}.rope_type={_shown(out['rope_type'])} and {field}.type="
                f"{_shown(older)} disagree: give one"
            )
    return out


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], float32, as HF computes them.

    Default: ``1 / theta ** (2i / d)``. Llama 3 scaling divides the low frequencies (wavelength
    above ``L / low_freq_factor``, ``L`` the original context) by ``factor``, keeps the high ones
    (wavelength below ``L / high_freq_factor``) and interpolates smoothly in between.
    """
    d = cfg.head_dim
    inv = (1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(
        np.float32
    )
    s = cfg.rope_scaling
    if s is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
