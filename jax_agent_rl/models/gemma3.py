"""Gemma 3 (text: ``gemma3_text``, the 1B model and the 4B's language part) as a `Policy`,
added through the model seam alone: its own parameters, forward and HF table; the engine,
the learner and the weight push reach it only through `policy.Policy`.

What sets it apart from the Llama-style `decoder` (transformers' ``Gemma3ForCausalLM``):

- **Local and global layers.** Most layers attend within a sliding window (``sliding_window``
  positions: a query at p reads keys at p - W + 1 .. p); every sixth (``layer_types``) attends
  to the whole context. Each kind has its own RoPE base (``rope_local_base_freq`` 10k, the
  global layers' ``rope_theta`` 1M, the 4B's with linear scaling by 8). The window is passed
  to the shared attention of each path (training, prefill chunks, decode, ragged steps), which
  masks it; the KV pool keeps every position of a local layer too (no ring buffer: memory
  as for a global layer).
- **Its norms.** RMSNorm scales by ``1 + w`` (weights start at 0) in fp32; four per layer
  (before and after the attention, before and after the MLP: the sublayer's output is normed
  before the residual add), and RMSNorm on the queries and keys per head.
- **GeGLU** MLP (``gelu_pytorch_tanh``), the **embedding scaled by sqrt(hidden_size)** (in the
  weights' dtype), the **head tied** to the embedding, the scores scaled by
  ``query_pre_attn_scalar ** -0.5``.
- No logit soft-capping (Gemma 2's; Gemma 3 sets both to null and so must a checkpoint).

Not carried: LoRA adapters and experts (it declares neither); the training fused kernels
(windowed layers train on the XLA attention loop on every platform).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.models.checkpoint import TensorRule, hf_tensors_of
from jax_agent_rl.models.config import DType, ModelConfig, register_family
from jax_agent_rl.models.config_checks import (
    UnsupportedConfigError,
    check_positive,
    check_size,
    flag,
    shown,
)
from jax_agent_rl.models.contract import NO_ROUTING, Forward, Packed, Paged, Routing, WholeParams
from jax_agent_rl.models.decoder import (
    Initializer,
    ParamSpec,
    attention,
    checked_against,
    exact_training_attention,
    is_spec,
    layer_list,
    lm_logits,
    matmul,
    rope,
    serving_layout,
    stacked_layers,
)
from jax_agent_rl.models.paged import KVPages
from jax_agent_rl.models.rope import MAX_POSITIONS, rope_inv_freq
from jax_agent_rl.models.sharding import Sharder

MODEL_TYPE: Literal["gemma3_text"] = "gemma3_text"
SLIDING, GLOBAL = "sliding_attention", "full_attention"

# config.json fields that do not change the forward pass
_METADATA = frozenset(
    {
        "_name_or_path", "architectures", "attention_dropout", "bos_token_id",
        "cache_implementation", "chunk_size_feed_forward", "dtype", "eos_token_id",
        "final_logit_softcapping", "attn_logit_softcapping", "id2label", "initializer_range",
        "is_encoder_decoder", "label2id", "output_attentions", "output_hidden_states",
        "pad_token_id", "problem_type", "return_dict", "torch_dtype", "transformers_version",
        "use_cache", "_sliding_window_pattern", "sliding_window_pattern",
    }
)  # fmt: skip
_FIELDS = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
        "rope_theta", "rope_local_base_freq", "rope_scaling", "attention_bias",
        "query_pre_attn_scalar", "sliding_window", "layer_types", "use_bidirectional_attention",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Gemma3Layout:
    """What Gemma 3 adds to the sizes of its `ModelConfig`: per layer whether it is local
    (``sliding``), the window, each kind's RoPE (base and linear scaling factor) and the
    scores' scalar."""

    sliding: tuple[bool, ...]
    sliding_window: int
    local_theta: float = 10000.0
    global_theta: float = 1000000.0
    global_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (None: a global layer)."""
        return self.sliding_window if self.sliding[i] else None

    def extra_params(self, c: ModelConfig) -> int:
        """Parameters beyond `ModelConfig.num_params`' decoder count: the norms after the
        attention and after the MLP."""
        return 2 * c.num_layers * c.hidden_size

    def to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The ``config.json`` of ``c`` (this its ``arch``), transformers 5's layout."""
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": self.global_theta}
        if self.global_factor != 1.0:
            full.update(rope_type="linear", factor=self.global_factor)
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": MODEL_TYPE,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": c.tie_embeddings,
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": self.local_theta},
                GLOBAL: full,
            },
            "attention_bias": False,
            # (an int in transformers' config class, which refuses 256.0)
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar),
            "sliding_window": self.sliding_window,
            "layer_types": [SLIDING if s else GLOBAL for s in self.sliding],
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "dtype": c.dtype,
        }

    def inv_freq(self, head_dim: int, i: int) -> np.ndarray:
        """Layer ``i``'s RoPE inverse frequencies (HF's: linear scaling divides them)."""
        if self.sliding[i]:
            return rope_inv_freq(head_dim, self.local_theta, None)
        inv = rope_inv_freq(head_dim, self.global_theta, None)
        return (inv / np.float32(self.global_factor)).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma3Layer:
    """All layers' weights stacked on a leading L axis (letters of `decoder`)."""

    attn_norm: Any  # [L, D]  input_layernorm
    q: Any  # [L, D, H, K]
    k: Any  # [L, D, G, K]
    v: Any  # [L, D, G, K]
    q_norm: Any  # [L, K]
    k_norm: Any  # [L, K]
    o: Any  # [L, H, K, D]
    post_attn_norm: Any  # [L, D]  post_attention_layernorm
    mlp_norm: Any  # [L, D]  pre_feedforward_layernorm
    gate: Any  # [L, D, F]
    up: Any  # [L, D, F]
    down: Any  # [L, F, D]
    post_mlp_norm: Any  # [L, D]  post_feedforward_layernorm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma3Weights:
    embed: Any  # [V, D]
    layers: Gemma3Layer | tuple[Gemma3Layer, ...]  # a tuple in `Gemma3Policy.serving_layout`
    final_norm: Any  # [D]
    lm_head: Any = None  # [D, V]: an untied head (Gemma 3 ties it); the serving copy


HF_RULES = (
    TensorRule("model.embed_tokens.weight", "embed"),
    TensorRule("model.norm.weight", "final_norm"),
    TensorRule("lm_head.weight", "lm_head", "linear"),
    TensorRule("model.layers.{i}.input_layernorm.weight", "layers.attn_norm"),
    TensorRule("model.layers.{i}.self_attn.q_proj.weight", "layers.q", "linear"),
    TensorRule("model.layers.{i}.self_attn.k_proj.weight", "layers.k", "linear"),
    TensorRule("model.layers.{i}.self_attn.v_proj.weight", "layers.v", "linear"),
    TensorRule("model.layers.{i}.self_attn.q_norm.weight", "layers.q_norm"),
    TensorRule("model.layers.{i}.self_attn.k_norm.weight", "layers.k_norm"),
    TensorRule("model.layers.{i}.self_attn.o_proj.weight", "layers.o", "linear", in_axes=2),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", "layers.post_attn_norm"),
    TensorRule("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.mlp_norm"),
    TensorRule("model.layers.{i}.mlp.gate_proj.weight", "layers.gate", "linear"),
    TensorRule("model.layers.{i}.mlp.up_proj.weight", "layers.up", "linear"),
    TensorRule("model.layers.{i}.mlp.down_proj.weight", "layers.down", "linear"),
    TensorRule("model.layers.{i}.post_feedforward_layernorm.weight", "layers.post_mlp_norm"),
)


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return 0.02 * jax.random.normal(key, shape, dtype)


def _zeros(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def param_specs(cfg: ModelConfig) -> Gemma3Weights:
    """Every parameter declared once (HF's init: N(0, 0.02) matrices, norms at 0, i.e. 1 + 0)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, G, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def p(shape: tuple[int, ...], axes: tuple[str | None, ...], init: Initializer = _normal):
        return ParamSpec(shape, axes, init)

    def norm(size: int, axis: str) -> ParamSpec:
        return p((L, size), ("layers", axis), _zeros)

    return Gemma3Weights(
        embed=p((V, D), ("vocab", "embed")),
        layers=Gemma3Layer(
            attn_norm=norm(D, "embed"),
            q=p((L, D, H, K), ("layers", "embed", "heads", "head_dim")),
            k=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
            v=p((L, D, G, K), ("layers", "embed", "kv_heads", "head_dim")),
            q_norm=norm(K, "head_dim"),
            k_norm=norm(K, "head_dim"),
            o=p((L, H, K, D), ("layers", "heads", "head_dim", "embed")),
            post_attn_norm=norm(D, "embed"),
            mlp_norm=norm(D, "embed"),
            gate=p((L, D, F), ("layers", "embed", "mlp")),
            up=p((L, D, F), ("layers", "embed", "mlp")),
            down=p((L, F, D), ("layers", "mlp", "embed")),
            post_mlp_norm=norm(D, "embed"),
        ),
        final_norm=p((D,), ("embed",), _zeros),
        lm_head=None if cfg.tie_embeddings else p((D, V), ("embed", "vocab")),
    )


def gemma_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` all in fp32, then rounded once
    to x's dtype (Llama rounds before the scale; HF's ``Gemma3RMSNorm`` after)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _scan_windows(layout: Gemma3Layout) -> jax.Array:
    """Per layer the window the training scan masks with: a global layer's reaches every
    position (`MAX_POSITIONS`, above any context)."""
    return jnp.asarray(
        [layout.sliding_window if s else MAX_POSITIONS for s in layout.sliding], jnp.int32
    )


@dataclasses.dataclass(frozen=True)
class Gemma3Policy(WholeParams):
    """Gemma 3's text decoder of ``cfg`` (its `Gemma3Layout` the config's ``arch``) as a
    `policy.Policy` (module docstring)."""

    cfg: ModelConfig

    def __post_init__(self) -> None:
        if not isinstance(self.cfg.arch, Gemma3Layout):
            raise UnsupportedConfigError(f"a {self.cfg.family} config is not Gemma 3's")
        if self.cfg.lora is not None:
            raise UnsupportedConfigError(
                "LoRA adapters on Gemma 3 are not supported: train it whole (no model.lora)"
            )

    @property
    def layout(self) -> Gemma3Layout:
        layout: Gemma3Layout = self.cfg.arch
        return layout

    # --------------------------------------------------------------------- parameters

    def specs(self) -> Gemma3Weights:
        return param_specs(self.cfg)

    def init(self, key: jax.Array, dtype: Any) -> Gemma3Weights:
        leaves, treedef = jax.tree.flatten(self.specs(), is_leaf=is_spec)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(
            treedef, [s.initial(k, dtype) for s, k in zip(leaves, keys, strict=True)]
        )

    def checked(self, params: Any) -> Gemma3Weights:
        w = params
        if isinstance(w.layers, tuple):  # the serving layout back to the declared one
            head = None if self.cfg.tie_embeddings else w.lm_head
            w = dataclasses.replace(w, layers=stacked_layers(w.layers), lm_head=head)
        checked: Gemma3Weights = checked_against(self.specs(), w)
        return checked

    def in_dtype(self, dtype: str) -> Gemma3Policy:
        return Gemma3Policy(dataclasses.replace(self.cfg, dtype=dtype))  # type: ignore[arg-type]

    def serving_layout(self, params: Any) -> Any:
        """`decoder.serving_layout` (the same fields: layers as a tuple of per-layer trees,
        the tied head as a [D, V] copy)."""
        return serving_layout(params)

    # ------------------------------------------------------------------------ forward

    def _embed(self, w: Gemma3Weights, tokens: jax.Array, sharder: Sharder) -> jax.Array:
        x = w.embed[tokens]
        x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), x.dtype)
        return sharder.constrain(x, ("batch", "seq", "act_embed"))

    def _layer(
        self,
        lw: Gemma3Layer,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: jax.Array,
        attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
        sharder: Sharder,
    ) -> jax.Array:
        """One layer over ``x`` [B, T, D]: ``attend(q, k, v)`` its attention."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        with jax.named_scope("attention"):
            h = gemma_norm(x, lw.attn_norm, eps)
            q = gemma_norm(matmul("btd,dhk->bthk", h, lw.q), lw.q_norm, eps)
            k = gemma_norm(matmul("btd,dgk->btgk", h, lw.k), lw.k_norm, eps)
            v = matmul("btd,dgk->btgk", h, lw.v)
            q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
            if self.layout.query_pre_attn_scalar != c.head_dim:  # attention scales by K**-0.5
                q = q * jnp.asarray(math.sqrt(c.head_dim / self.layout.query_pre_attn_scalar))
            out = matmul("bthk,hkd->btd", attend(q, k, v), lw.o)
            x = x + gemma_norm(out, lw.post_attn_norm, eps)
        with jax.named_scope("mlp"):
            B, T, D = x.shape
            h = gemma_norm(x, lw.mlp_norm, eps).reshape(B * T, D)
            gate = jax.nn.gelu(matmul("nd,df->nf", h, lw.gate), approximate=True)
            out = matmul("nf,fd->nd", gate * matmul("nd,df->nf", h, lw.up), lw.down)
            x = x + gemma_norm(out.reshape(B, T, D), lw.post_mlp_norm, eps)
        return sharder.constrain(x, ("batch", "seq", "act_embed"))

    def forward(
        self,
        params: Any,
        rows: Packed | Paged,
        *,
        sharder: Sharder,
        remat: bool = False,
        routing: Routing = NO_ROUTING,
    ) -> Forward:
        """The contract's forward (`contract`): `Packed` rows under ``lax.scan`` over the
        stacked layers (each layer's window and RoPE frequencies scanned with it), `Paged`
        rows layer by layer over the pool (each layer's window static)."""
        if routing.asked:
            raise UnsupportedConfigError("routing asked of Gemma 3, which has no experts")
        c, w = self.cfg, params
        x = self._embed(w, rows.tokens, sharder)
        inv = [jnp.asarray(self.layout.inv_freq(c.head_dim, i)) for i in range(c.num_layers)]
        if isinstance(rows, Paged):
            chunk = rows.attention(sharder, exact=bool(c.exact_pages))
            for i, lw in enumerate(layer_list(w.layers)):
                paged = partial(chunk.attend, i, sliding_window=self.layout.window(i))
                x = self._layer(lw, x, chunk.positions, inv[i], paged, sharder)
            h = gemma_norm(x, w.final_norm, c.rms_norm_eps)
            return Forward(h, KVPages(k=chunk.k, v=chunk.v))
        packed = rows

        def layer(x: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, None]:
            lw, window, inv_freq = xs

            def attn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
                if c.exact_pages:
                    return exact_training_attention(
                        q, k, v, packed.segments, c.exact_pages, packed.window, sharder,
                        packed.positions, window,
                    )  # fmt: skip
                return attention(
                    q, k, v, packed.segments, packed.window, sharder=sharder,
                    reach_bt=packed.reach, positions_bt=packed.positions, sliding_window=window,
                )  # fmt: skip

            return self._layer(lw, x, packed.positions, inv_freq, attn, sharder), None

        body = jax.checkpoint(layer) if remat else layer
        xs = (stacked_layers(w.layers), _scan_windows(self.layout), jnp.stack(inv))
        x, _ = jax.lax.scan(body, x, xs)
        return Forward(gemma_norm(x, w.final_norm, c.rms_norm_eps))

    def head_vd(self, params: Any) -> jax.Array:
        head: jax.Array = params.embed if params.lm_head is None else params.lm_head.T
        return head

    def logits(self, params: Any, h_btd: jax.Array) -> jax.Array:
        return lm_logits(params, h_btd)  # (the decoder's: the same embed / lm_head fields)

    # ---------------------------------------------------------------------------- HF

    def hf_rules(self) -> tuple[TensorRule, ...]:
        return HF_RULES

    def hf_tensors(self, params: Any, on_device: bool = False) -> Iterator[tuple[str, Any]]:
        return hf_tensors_of(self.cfg, self.specs(), HF_RULES, params, on_device)


# ------------------------------------------------------------------------- config.json

# the largest RoPE base: the frequencies are computed in float32 (as `ModelConfig`'s rope_theta)
_MAX_THETA = float(np.finfo(np.float32).max)


def config_from_hf(hf: dict[str, Any], dtype: DType = "float32") -> ModelConfig:
    """A ``gemma3_text`` config.json (either transformers' layout) as a `ModelConfig` with
    its `Gemma3Layout`, read as transformers 5 reads it; a field it does not know or cannot
    honour is an `UnsupportedConfigError` naming it."""
    unknown = sorted(set(hf) - _FIELDS - _METADATA)
    if unknown:
        raise UnsupportedConfigError(
            f"unknown {MODEL_TYPE} config field(s) {unknown}: refusing to guess their effect"
        )
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(field) is not None:
            raise UnsupportedConfigError(
                f"{field}={shown(hf[field])}: Gemma 3 has no soft-capping (null); a Gemma 2 "
                "checkpoint is not supported"
            )
    _require(hf, "hidden_activation", "gelu_pytorch_tanh")
    _require(hf, "attention_bias", False)
    _require(hf, "use_bidirectional_attention", False, null=True)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "sliding_window"):  # fmt: skip
        if field not in hf:
            raise UnsupportedConfigError(f"config.json lacks the required field {field!r}")
    layers = check_size("num_hidden_layers", hf["num_hidden_layers"], 1024)
    heads = check_size("num_attention_heads", hf["num_attention_heads"], 1024)
    hidden = check_size("hidden_size", hf["hidden_size"], 1 << 17)
    head_dim = hf.get("head_dim", 256)
    local, theta, factor = _rope(hf)
    layout = Gemma3Layout(
        sliding=_layer_kinds(hf, layers),
        sliding_window=check_size("sliding_window", hf["sliding_window"], MAX_POSITIONS),
        local_theta=local,
        global_theta=theta,
        global_factor=factor,
        # (below 1 the scores' scale sqrt(head_dim / scalar) grows without bound: inf in fp32)
        query_pre_attn_scalar=_at_least(
            "query_pre_attn_scalar", hf.get("query_pre_attn_scalar", 256), 1.0, below=1e9
        ),
    )
    return ModelConfig(
        family=MODEL_TYPE,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        # transformers' default for Gemma 3 is 4, not one per head; null (and 0, false, "")
        # is no size: `ModelConfig` refuses it by name
        num_kv_heads=hf.get("num_key_value_heads", 4),
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        tie_embeddings=flag(hf, "tie_word_embeddings", True),
        qk_norm=True,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        dtype=dtype,
        arch=layout,
    )


def _layer_kinds(hf: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer whether it is local: ``layer_types``, else every ``sliding_window_pattern``-th
    layer global (older config.json files; 6 by default). ``_sliding_window_pattern`` is what
    transformers writes back beside ``layer_types`` and never reads: alone, a value of it
    other than transformers' 6 is refused, not guessed at."""
    for field in ("sliding_window_pattern", "_sliding_window_pattern"):
        if field in hf:
            check_size(field, hf[field], 1024)
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern: int = hf.get("sliding_window_pattern", 6)
        if "sliding_window_pattern" not in hf and hf.get("_sliding_window_pattern", 6) != 6:
            raise UnsupportedConfigError(
                f"_sliding_window_pattern={hf['_sliding_window_pattern']} without layer_types: "
                "transformers ignores it and makes every 6th layer global; give layer_types "
                "(or sliding_window_pattern)"
            )
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    if not isinstance(kinds, list) or any(k not in (SLIDING, GLOBAL) for k in kinds):
        raise UnsupportedConfigError(
            f"layer_types={shown(kinds)}: expected a list of {SLIDING!r} and {GLOBAL!r}"
        )
    if len(kinds) != layers:
        raise UnsupportedConfigError(
            f"layer_types has {len(kinds)} entries for num_hidden_layers={layers}"
        )
    return tuple(k == SLIDING for k in kinds)


def _rope(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(local base, global base, global linear factor) as transformers 5 reads them:
    ``rope_parameters`` per layer kind, what it leaves out filled from the older fields
    (``rope_scaling`` and ``rope_theta`` for the global layers, ``rope_local_base_freq`` for
    the local ones); a value given both ways must agree."""
    params = hf.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or set(params) - {SLIDING, GLOBAL}:
        raise UnsupportedConfigError(
            f"rope_parameters={shown(params)}: expected an object of {SLIDING!r} and {GLOBAL!r}"
        )
    scaling = hf.get("rope_scaling")
    if scaling is None:
        scaling = {}
    if not isinstance(scaling, dict):
        raise UnsupportedConfigError(
            f"rope_scaling={shown(scaling)}: expected a JSON object or null"
        )
    older: dict[str, list[tuple[str, str, object]]] = {
        GLOBAL: [(f"rope_scaling.{k}", k, v) for k, v in scaling.items()],
        SLIDING: [],
    }
    if "rope_theta" in hf:
        older[GLOBAL].append(("rope_theta", "rope_theta", hf["rope_theta"]))
    if "rope_local_base_freq" in hf:
        older[SLIDING].append(("rope_local_base_freq", "rope_theta", hf["rope_local_base_freq"]))
    local, local_factor = _rope_of(SLIDING, params.get(SLIDING), older[SLIDING], 10000.0)
    theta, factor = _rope_of(GLOBAL, params.get(GLOBAL), older[GLOBAL], 1000000.0)
    if local_factor != 1.0:
        raise UnsupportedConfigError(
            f"rope_parameters.{SLIDING}: scaling on the local layers is not supported"
        )
    return local, theta, factor


def _rope_of(
    kind: str, given: object, older: list[tuple[str, str, object]], theta: float
) -> tuple[float, float]:
    """(base, linear factor) of one layer kind's RoPE: ``default`` or ``linear`` (``factor``),
    from ``rope_parameters.<kind>`` (``given``) and the older fields ``older`` ((config.json
    key, field, value) each); errors name the key that gave the value."""
    key = f"rope_parameters.{kind}"
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise UnsupportedConfigError(f"{key}={shown(given)}: expected a JSON object")
    fields: dict[str, tuple[str, object]] = {k: (f"{key}.{k}", v) for k, v in given.items()}
    for name, field, value in older:
        if field in fields and fields[field][1] != value:
            raise UnsupportedConfigError(
                f"{fields[field][0]}={shown(fields[field][1])} and {name}={shown(value)} "
                "disagree: give one"
            )
        fields.setdefault(field, (name, value))
    kind_name, rope_type = fields.pop("rope_type", ("rope_type", "default"))
    if "type" in fields:  # transformers 4's spelling: transformers 5 reads rope_type alone here
        name, spelt = fields.pop("type")
        if spelt != rope_type:
            raise UnsupportedConfigError(
                f"{name}={shown(spelt)} but {kind_name}={shown(rope_type)}: transformers 5 "
                "reads rope_type alone here; give rope_type"
            )
    name, value = fields.pop("rope_theta", (f"{key}.rope_theta", theta))
    base = check_positive(name, value, above=1.0, below=_MAX_THETA)
    if rope_type == "default" and not fields:
        return base, 1.0
    if rope_type == "linear" and set(fields) == {"factor"}:
        name, value = fields["factor"]
        # (transformers' own bound: a factor below 1 is no scaling it validates; near 0, inf)
        return base, _at_least(name, value, 1.0, below=1e6)
    raise UnsupportedConfigError(
        f"{kind_name}={shown(rope_type)} with {shown(sorted(n for n, _ in fields.values()))} "
        "is not supported (only 'default', and 'linear' with a factor)"
    )


def _at_least(key: str, value: object, low: float, below: float) -> float:
    """``value`` as a float: a number (not a bool) from ``low`` up to, not including,
    ``below`` (`check_positive`'s, with its lower end included)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and low <= value < below:
        return float(value)
    raise UnsupportedConfigError(
        f"{key}={shown(value)}: expected a finite number from {low:g} up to {below:g}"
    )


def _int_if_whole(x: float) -> float | int:
    return int(x) if x.is_integer() else x


def _require(hf: dict[str, Any], field: str, expected: object, null: bool = False) -> None:
    """``field``, where given, is ``expected`` and of its type (0 is no false: transformers
    refuses it); null only where ``null`` (transformers' default then)."""
    if field not in hf or (null and hf[field] is None):
        return
    value = hf[field]
    if type(value) is not type(expected) or value != expected:
        raise UnsupportedConfigError(f"{field}={shown(value)} is not supported (only {expected!r})")


register_family(MODEL_TYPE, config_from_hf)
