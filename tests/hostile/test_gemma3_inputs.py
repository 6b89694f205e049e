"""A hostile Gemma 3 checkpoint folder (`models.gemma3`): config.json and safetensors come from
wherever the user downloaded them, so each bad value is an `UnsupportedConfigError` naming
its config.json key (or a `CheckpointError` naming the tensor), one line, and a value
transformers 5 would read otherwise than we do is refused rather than read differently.

What got through before (config.json of the older layout unless said):

- ``rope_scaling`` a string, list, number or true: a TypeError ('str' object is not a mapping);
  ``""``, ``[]``, ``0``, ``false``: read as absent.
- ``num_key_value_heads`` 0, false, ``""``, ``[]``, ``{}``: read as one per attention head;
  absent: one per head too, where transformers' Gemma 3 default is 4.
- Beside ``rope_parameters`` (transformers 5's layout), ``rope_theta``,
  ``rope_local_base_freq`` and ``rope_scaling`` were ignored whatever they held (NaN, strings,
  other bases), where transformers fills the gaps of rope_parameters with them.
- ``rope_scaling: {"type": "linear", "factor": 4}`` scaled the global layers by 4, where
  transformers 5 reads rope_type alone (default: no scaling); a ``rope_theta`` inside
  rope_scaling lost silently to the top-level one (transformers: the inner one wins).
- ``sliding_window_pattern`` beside ``layer_types``, and ``_sliding_window_pattern`` beside
  either, were never checked (strings, NaN, 10**310 loaded); ``_sliding_window_pattern`` alone
  set the pattern, which transformers ignores (every 6th layer global).
- A local RoPE base above float32's range (1e39, 1e300: every frequency 0), a linear factor
  near 0 (1e-300: infinite frequencies) and ``query_pre_attn_scalar`` near 0 (1e-300: the
  scores scaled by inf) loaded.
- ``attention_bias: 0`` / ``0.0``, ``use_bidirectional_attention: 0`` and
  ``hidden_activation: null`` loaded (transformers refuses each).
- A bad ``rope_theta`` was reported as ``rope_scaling.rope_theta``, a key no config.json has.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_agent_rl.models import CheckpointError, ModelConfig, UnsupportedConfigError, load_hf
from jax_agent_rl.models.hf_local import TINY_GEMMA3, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder

pytestmark = pytest.mark.timeout(120)

L, G = "sliding_attention", "full_attention"
NEW = TINY_GEMMA3["gemma3-1b"]  # transformers 5's layout: rope_parameters, layer_types
# the Hub's layout: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern
OLD = {
    **{k: v for k, v in NEW.items() if k not in ("rope_parameters", "layer_types")},
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window_pattern": 3,
}
BIG = 10**310  # (a 310-digit number crashed a config loader of wave 4)
NAN, INF = float("nan"), float("inf")


def _refused(hf: dict[str, Any], named: str) -> str:
    """``hf``'s refusal: an `UnsupportedConfigError` itself, one line, naming ``named``."""
    with pytest.raises(UnsupportedConfigError) as e:
        ModelConfig.from_hf(hf)
    message = str(e.value)
    assert e.type is UnsupportedConfigError
    assert "\n" not in message and named in message, message
    return message


def _with(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(base), **fields}


# -- every field with junk of every kind ------------------------------------------------------

SIZES = ["64", [64], {"n": 64}, True, False, None, 64.5, 64.0, NAN, INF, -INF, -1, 0, BIG, 1e308]
NUMBERS = ["1e-6", [1], {}, True, None, NAN, INF, -INF, -1, 0, BIG, 1e308, -1e308]
PATTERNS = ["6", True, None, 0, -1, 6.0, NAN, BIG, 1025]


SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "max_position_embeddings",
)
OTHER_JUNK: dict[str, list[Any]] = {
    "tie_word_embeddings": ["true", 1, 0, None, [], {}],
    "attention_bias": ["false", 0, 0.0, None, True, []],
    "use_bidirectional_attention": ["false", 0, 0.0, True, []],
    "hidden_activation": [None, "gelu", "GELU_PYTORCH_TANH", "silu", 1, []],
    "final_logit_softcapping": [0, False, 30.0, NAN, "none", BIG],
    "attn_logit_softcapping": [0, False, 50.0, INF, [], BIG],
    "model_type": ["Gemma3_text", "GEMMA3_TEXT", "gemma3", "gemma2", " gemma3_text", None],
    "layer_types": [L, True, {}, [[L]] * 4, [NAN] * 4, [{}] * 4, [L] * 3, [L] * 5, []],
    "rope_parameters": [[], "x", True, 1.0, BIG, {"rope_type": "default"}, {G: []}],
    "rope_scaling": ["linear", [1], True, 1.5, BIG, "", [], False, 0],
}
MORE_JUNK: dict[str, list[Any]] = {
    "model_type": [["gemma3_text"]],
    "layer_types": [[L] * 100_000, ["chunked_attention"] * 4],
    "rope_parameters": [{"chunked_attention": {}}, {L: "default"}],
}


def _sweep() -> list[Any]:
    """(config.json, the key its refusal names) for each junk value of each field."""
    out: list[tuple[str, dict[str, Any], str]] = []
    for field in SIZE_FIELDS:
        out += [(f"{field}={v!r:.12}", _with(NEW, **{field: v}), field) for v in SIZES]
    for field in ("rms_norm_eps", "query_pre_attn_scalar"):
        out += [(f"{field}={v!r:.12}", _with(NEW, **{field: v}), field) for v in NUMBERS]
    for field in ("rope_theta", "rope_local_base_freq"):
        out += [(f"old-{field}={v!r:.12}", _with(OLD, **{field: v}), field) for v in NUMBERS]
    for field in ("sliding_window_pattern", "_sliding_window_pattern"):
        out += [(f"{field}={v!r:.12}", _with(NEW, **{field: v}), field) for v in PATTERNS]
        out += [(f"old-{field}={v!r:.12}", _with(OLD, **{field: v}), field) for v in PATTERNS]
    for field, values in OTHER_JUNK.items():
        base = OLD if field == "rope_scaling" else NEW
        junk = [*values, *MORE_JUNK.get(field, [])]
        out += [(f"{field}={v!r:.12}", _with(base, **{field: v}), field) for v in junk]
    for kind in (L, G):
        for v in [*NUMBERS, 1, 1.0, 1e39]:  # (above 1 and within float32)
            rope = {kind: {"rope_type": "default", "rope_theta": v}}
            key = f"rope_parameters.{kind}.rope_theta"
            out.append((f"{kind}.theta={v!r:.12}", _with(NEW, rope_parameters=rope), key))
    for v in [*NUMBERS, 0.5, 1e-300, 1e6]:  # (from 1, transformers' bound, up to 1e6)
        rope = {G: {"rope_type": "linear", "factor": v}}
        old = {"rope_type": "linear", "factor": v}
        key = f"rope_parameters.{G}.factor"
        out.append((f"factor={v!r:.12}", _with(NEW, rope_parameters=rope), key))
        out.append((f"old-factor={v!r:.12}", _with(OLD, rope_scaling=old), "rope_scaling.factor"))
    for v in ["yarn", "dynamic", "llama3", None, 1, ["linear"]]:
        rope = {G: {"rope_type": v, "factor": 4.0}}
        key = f"rope_parameters.{G}.rope_type"
        out.append((f"rope_type={v!r:.12}", _with(NEW, rope_parameters=rope), key))
    return [pytest.param(hf, named, id=name) for name, hf, named in out]


@pytest.mark.parametrize(("hf", "named"), _sweep())
def test_junk_in_any_field_is_refused_naming_its_key(hf: dict[str, Any], named: str) -> None:
    _refused(hf, named)


# -- what got through before (module docstring) ------------------------------------------------


OLD_ALONE = {k: v for k, v in OLD.items() if k != "sliding_window_pattern"}
LINEAR_4 = {"rope_type": "linear", "factor": 4.0}
# (name of the attack, config.json, the key its refusal names)
GOT_THROUGH: list[tuple[str, dict[str, Any], str]] = [
    ("rope_scaling-str-TypeError", _with(OLD, rope_scaling="linear"), "rope_scaling"),
    ("rope_scaling-list-TypeError", _with(OLD, rope_scaling=[1]), "rope_scaling"),
    ("rope_scaling-number-TypeError", _with(OLD, rope_scaling=8.0), "rope_scaling"),
    ("rope_scaling-empty-str-ignored", _with(OLD, rope_scaling=""), "rope_scaling"),
    ("rope_scaling-0-ignored", _with(OLD, rope_scaling=0), "rope_scaling"),
    ("kv-heads-0-read-as-heads", _with(NEW, num_key_value_heads=0), "num_key_value_heads"),
    ("kv-heads-false-read-as-heads", _with(NEW, num_key_value_heads=False), "num_key_value_heads"),
    ("kv-heads-empty-read-as-heads", _with(NEW, num_key_value_heads=""), "num_key_value_heads"),
    ("kv-heads-null", _with(NEW, num_key_value_heads=None), "num_key_value_heads"),
    ("rope_theta-nan-beside-rope_parameters", _with(NEW, rope_theta=NAN), "rope_theta"),
    ("rope_theta-str-beside-rope_parameters", _with(NEW, rope_theta="1e6"), "rope_theta"),
    ("rope_theta-other-beside-rope_parameters", _with(NEW, rope_theta=5e5), "rope_theta"),
    (
        "local-base-other-beside-rope_parameters",
        _with(NEW, rope_local_base_freq=777.0),
        "rope_local_base_freq",
    ),
    (
        "local-base-list-beside-rope_parameters",
        _with(NEW, rope_local_base_freq=[1]),
        "rope_local_base_freq",
    ),
    (
        "rope_scaling-beside-rope_parameters",
        _with(NEW, rope_scaling=LINEAR_4),
        "rope_scaling.rope_type",
    ),
    ("rope_scaling-junk-beside-rope_parameters", _with(NEW, rope_scaling="junk"), "rope_scaling"),
    (
        "type-linear-that-transformers-5-ignores",
        _with(OLD, rope_scaling={"type": "linear", "factor": 4.0}),
        "rope_scaling.type",
    ),
    (
        "type-and-rope_type-disagree",
        _with(OLD, rope_scaling={**LINEAR_4, "type": "default"}),
        "rope_scaling.type",
    ),
    (
        "rope_theta-inside-rope_scaling-disagrees",
        _with(OLD, rope_scaling={**LINEAR_4, "rope_theta": 5e5}),
        "rope_scaling.rope_theta",
    ),
    (
        "pattern-str-beside-layer_types",
        _with(NEW, sliding_window_pattern="six"),
        "sliding_window_pattern",
    ),
    (
        "written-pattern-nan-beside-layer_types",
        _with(NEW, _sliding_window_pattern=NAN),
        "_sliding_window_pattern",
    ),
    (
        "written-pattern-huge-beside-pattern",
        _with(OLD, _sliding_window_pattern=BIG),
        "_sliding_window_pattern",
    ),
    (
        "written-pattern-alone-that-transformers-ignores",
        _with(OLD_ALONE, _sliding_window_pattern=2),
        "_sliding_window_pattern",
    ),
    (
        "local-base-above-float32",
        _with(NEW, rope_parameters={L: {"rope_theta": 1e39}}),
        f"rope_parameters.{L}.rope_theta",
    ),
    (
        "local-base-1e300",
        _with(NEW, rope_parameters={L: {"rope_theta": 1e300}}),
        f"rope_parameters.{L}.rope_theta",
    ),
    ("old-local-base-1e300", _with(OLD, rope_local_base_freq=1e300), "rope_local_base_freq"),
    (
        "factor-near-0-infinite-frequencies",
        _with(NEW, rope_parameters={G: {"rope_type": "linear", "factor": 1e-300}}),
        f"rope_parameters.{G}.factor",
    ),
    (
        "scalar-near-0-infinite-scores",
        _with(NEW, query_pre_attn_scalar=1e-300),
        "query_pre_attn_scalar",
    ),
    ("scalar-denormal", _with(NEW, query_pre_attn_scalar=5e-324), "query_pre_attn_scalar"),
    ("attention_bias-0", _with(NEW, attention_bias=0), "attention_bias"),
    ("attention_bias-0.0", _with(NEW, attention_bias=0.0), "attention_bias"),
    ("bidirectional-0", _with(NEW, use_bidirectional_attention=0), "use_bidirectional_attention"),
    ("activation-null", _with(NEW, hidden_activation=None), "hidden_activation"),
]


@pytest.mark.parametrize(
    ("hf", "named"), [pytest.param(hf, named, id=name) for name, hf, named in GOT_THROUGH]
)
def test_attacks_that_got_through_are_refused(hf: dict[str, Any], named: str) -> None:
    _refused(hf, named)


def test_a_bad_rope_theta_is_named_as_config_json_spells_it() -> None:
    """It was ``rope_scaling.rope_theta='1e6'``: a key no config.json has."""
    assert _refused(_with(OLD, rope_theta="1e6"), "rope_theta").startswith("rope_theta='1e6'")


# -- JSON literals from the file itself --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('"query_pre_attn_scalar": NaN', "query_pre_attn_scalar"),
        ('"query_pre_attn_scalar": -Infinity', "query_pre_attn_scalar"),
        ('"sliding_window": Infinity', "sliding_window"),
        ('"sliding_window": 1e999', "sliding_window"),
        (f'"num_key_value_heads": {BIG}', "num_key_value_heads"),
        (f'"head_dim": {BIG}', "head_dim"),
        ('"rms_norm_eps": NaN', "rms_norm_eps"),
        (f'"sliding_window_pattern": {BIG}', "sliding_window_pattern"),
        (
            '"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": NaN}}',
            "rope_parameters.full_attention.factor",
        ),
        (
            '"rope_parameters": {"sliding_attention": {"rope_theta": Infinity}}',
            "rope_parameters.sliding_attention.rope_theta",
        ),
        (
            '"rope_parameters": {"full_attention": {"rope_theta": 1e308}}',
            "rope_parameters.full_attention.rope_theta",
        ),
        ('"layer_types": [NaN, NaN, NaN, NaN]', "layer_types"),
        ('"final_logit_softcapping": NaN', "final_logit_softcapping"),
    ],
)
def test_json_literals_in_the_file_are_refused_naming_the_key(
    text: str, named: str, tmp_path: Path
) -> None:
    key = text.split(":", maxsplit=1)[0].strip('"')
    body = json.dumps({k: v for k, v in NEW.items() if k != key})[:-1] + ", " + text + "}"
    (tmp_path / "config.json").write_text(body)
    with pytest.raises(UnsupportedConfigError) as e:
        ModelConfig.from_pretrained(tmp_path)
    assert e.type is UnsupportedConfigError
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and named in message
    assert "\n" not in message


# -- what transformers reads, we read ----------------------------------------------------------


def _read(hf: dict[str, Any]) -> tuple[Any, ...]:
    cfg = ModelConfig.from_hf(hf)
    a = cfg.arch
    return a.sliding, a.local_theta, a.global_theta, a.global_factor, cfg.num_kv_heads


LOCALS = (True, True, False, True)  # NEW's layer_types, and OLD's every third layer global
# (config.json, what transformers 5.19's Gemma3TextConfig reads from it: per layer whether it
# is local, rope_parameters' sliding and full rope_theta, the full layers' linear factor,
# num_key_value_heads)
AS_TRANSFORMERS: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = [
    ("both-layouts-agree", _with(NEW, rope_theta=1e6, rope_local_base_freq=1e4),
     (LOCALS, 1e4, 1e6, 1.0, 1)),
    ("rope_theta-fills-a-gap", _with(NEW, rope_parameters={L: {}, G: {}}, rope_theta=5e5),
     (LOCALS, 1e4, 5e5, 1.0, 1)),
    ("local-base-fills-a-gap", _with(NEW, rope_parameters={}, rope_local_base_freq=777.0),
     (LOCALS, 777.0, 1e6, 1.0, 1)),
    ("rope_scaling-fills-a-gap",
     _with(NEW, rope_parameters={G: {"rope_theta": 1e6}}, rope_scaling=LINEAR_4),
     (LOCALS, 1e4, 1e6, 4.0, 1)),
    ("rope_theta-in-rope_scaling",
     _with(OLD, rope_scaling={**LINEAR_4, "rope_theta": 5e5}, rope_theta=5e5),
     (LOCALS, 1e4, 5e5, 4.0, 1)),
    ("type-default", _with(OLD, rope_scaling={"type": "default"}), (LOCALS, 1e4, 1e6, 1.0, 1)),
    ("pattern-over-the-written-one",
     _with(OLD, _sliding_window_pattern=6, sliding_window_pattern=2),
     ((True, False, True, False), 1e4, 1e6, 1.0, 1)),
    ("pattern-6-by-default", OLD_ALONE, ((True,) * 4, 1e4, 1e6, 1.0, 1)),
    ("written-pattern-6-alone", _with(OLD_ALONE, _sliding_window_pattern=6),
     ((True,) * 4, 1e4, 1e6, 1.0, 1)),
    ("kv-heads-4-by-default",
     {**{k: v for k, v in NEW.items() if k != "num_key_value_heads"}, "num_attention_heads": 8},
     (LOCALS, 1e4, 1e6, 1.0, 4)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("hf", "expected"), [pytest.param(hf, want, id=name) for name, hf, want in AS_TRANSFORMERS]
)
def test_the_older_fields_read_as_transformers_reads_them(
    hf: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    assert _read(hf) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"query_pre_attn_scalar": 24.5},
        {"query_pre_attn_scalar": 1.0},
        {"global_factor": 2.5},
        {"global_factor": 999_999.0},
        {"local_theta": 777.5, "global_theta": 3.3e38},
        {"sliding_window": 1 << 24, "sliding": (False,) * 4},
        {"sliding": (True,) * 4},
    ],
    ids=repr,
)
def test_odd_but_valid_layouts_round_trip_through_config_json(change: dict[str, Any]) -> None:
    base = ModelConfig.from_hf(NEW)
    layout = dataclasses.replace(base.arch, **change)
    cfg = dataclasses.replace(base, arch=layout, rope_theta=layout.global_theta)
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


# -- hostile safetensors -----------------------------------------------------------------------

EMBED = "model.embed_tokens.weight"
POST_MLP = "model.layers.0.post_feedforward_layernorm.weight"
Edit = Callable[[dict[str, np.ndarray]], None]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 checkpoint written by transformers (tied head: no lm_head.weight)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt", NEW)


def _edited(src: Path, dst: Path, tensors: Edit | None = None, **config: Any) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        hf = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**hf, **config}))
    return dst


def _set(name: str, value: Callable[[dict[str, np.ndarray]], np.ndarray]) -> Edit:
    return lambda t: t.update({name: value(t)})


def _put(name: str, array: np.ndarray) -> Edit:
    return lambda t: t.update({name: array})


UNTIED = {"tie_word_embeddings": False}
Q_NORM, K_PROJ = "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_proj.weight"
# (name of the attack, its edit of the tensors, of config.json, what the error says: {} the folder)
TENSOR_ATTACKS: list[tuple[str, Edit | None, dict[str, Any], str]] = [
    ("no-post-feedforward-norm", lambda t: t.pop(POST_MLP), {},
     f"missing tensors in {{}}: ['{POST_MLP}']"),
    ("no-k-norm", lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"), {},
     "missing tensors in {}: ['model.layers.3.self_attn.k_norm.weight']"),
    ("extra-tensor", _put("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)), {},
     "unexpected tensors in {} for a gemma3_text config: ['model.layers.0.mlp.extra.weight']"),
    ("extra-layer", _put("model.layers.4.input_layernorm.weight", np.zeros(64, np.float32)), {},
     "unexpected tensors in {} for a gemma3_text config: ['model.layers.4.input_layernorm"),
    ("a-decoder-bias", _put("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)),
     {}, "unexpected tensors in {} for a gemma3_text config: ['model.layers.0.self_attn.q_proj"),
    ("q-norm-shape", _put(Q_NORM, np.zeros(17, np.float32)), {},
     f"tensor '{Q_NORM}' has shape (17,), config implies (16,)"),
    ("norm-of-two-dims", _put(POST_MLP, np.zeros((64, 1), np.float32)), {},
     f"tensor '{POST_MLP}' has shape (64, 1), config implies (64,)"),
    ("scalar-final-norm", _put("model.norm.weight", np.zeros((), np.float32)), {},
     "tensor 'model.norm.weight' has shape (), config implies (64,)"),
    ("nan-norm", _put(POST_MLP, np.full(64, np.nan, np.float32)), {},
     f"tensor '{POST_MLP}' holds NaN or inf"),
    ("tied-head-differs", _set("lm_head.weight", lambda t: t[EMBED] + 1), {},
     "lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings=true"),
    ("tied-head-nan", _set("lm_head.weight", lambda t: np.full_like(t[EMBED], np.nan)), {},
     "lm_head.weight differs from model.embed_tokens.weight"),
    ("tied-head-shape", _set("lm_head.weight", lambda t: t[EMBED][:-1].copy()), {},
     "tensor 'lm_head.weight' has shape (255, 64), config implies (256, 64)"),
    ("tied-head-transposed", _set("lm_head.weight", lambda t: np.ascontiguousarray(t[EMBED].T)),
     {}, "tensor 'lm_head.weight' has shape (64, 256), config implies (256, 64)"),
    ("untied-without-head", None, UNTIED, "missing tensors in {}: ['lm_head.weight']"),
    ("untied-head-shape", _set("lm_head.weight", lambda t: t[EMBED][:, :-1].copy()), UNTIED,
     "tensor 'lm_head.weight' has shape (256, 63), config implies (256, 64)"),
    ("config-kv-heads-not-the-tensors", None, {"num_key_value_heads": 2},
     f"tensor '{K_PROJ}' has shape (16, 64), config implies (32, 64)"),
    ("no-tensors", lambda t: t.clear(), {}, "missing tensors in {}: ['model.embed_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tensors", "config", "named"),
    [pytest.param(edit, config, named, id=name) for name, edit, config, named in TENSOR_ATTACKS],
)
def test_hostile_tensors_are_a_checkpoint_error_naming_them(
    gemma: Path, tmp_path: Path, tensors: Edit | None, config: dict[str, Any], named: str
) -> None:
    folder = _edited(gemma, tmp_path / "ckpt", tensors, **config)
    with pytest.raises(CheckpointError) as e:
        load_hf(folder, sharder=one_device_sharder())
    assert e.type is CheckpointError
    assert named.format(folder) in str(e.value)


def test_an_untied_head_loads_as_stored(gemma: Path, tmp_path: Path) -> None:
    """tie_word_embeddings false and an lm_head.weight of its own: that head, not the
    embedding (and a tied checkpoint's identical copy loads as tied)."""

    def head(t: dict[str, np.ndarray]) -> np.ndarray:
        return t[EMBED] * 2 + 1

    folder = _edited(gemma, tmp_path / "untied", _set("lm_head.weight", head), **UNTIED)
    cfg, w = load_hf(folder, sharder=one_device_sharder())
    stored = load_file(str(folder / "model.safetensors"))
    assert not cfg.tie_embeddings
    np.testing.assert_array_equal(np.asarray(w.lm_head), stored["lm_head.weight"].T)
    copy_folder = _edited(
        gemma, tmp_path / "copy", _set("lm_head.weight", lambda t: t[EMBED].copy())
    )
    cfg, w = load_hf(copy_folder, sharder=one_device_sharder())
    assert cfg.tie_embeddings and w.lm_head is None
