"""LoRA adapters around a decoder's weights: adding fresh ones, taking them apart from the base
(the learner trains one, the engine receives one), merging them in, and HF PEFT's adapter
folder (``adapter_config.json`` + ``adapter_model.safetensors``) both ways.

PEFT names an adapter's tensors after the module it wraps: for the HF tensor
``model.layers.{i}.self_attn.q_proj.weight`` (`checkpoint._RULES`), A is
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and B
``...lora_B.weight`` [out, r], the ``nn.Linear`` layout: import is transpose + reshape, the
same ``linear`` layout as the base weights. Every tensor is checked (name, shape) before use;
a missing or unexpected one is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_agent_rl.models.checkpoint import (
    CheckpointError,
    TensorRule,
    hf_shape,
    rule_of,
    stored_tensors,
    to_hf,
    to_ours,
)
from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.decoder import Layer, Weights, is_spec, param_shardings, param_specs
from jax_agent_rl.models.lora import TARGETS, Adapter, LayerAdapters, Lora, merged
from jax_agent_rl.models.sharding import Sharder

ADAPTER_CONFIG = "adapter_config.json"
# the largest adapter value `load_peft` takes: far past any trained adapter's (well below 1),
# far below what overflows a layer (a finite 1e30 made every logit NaN)
MAX_ADAPTER_ABS = 1e4
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def adapters_of(w: Weights) -> LayerAdapters:
    """The adapters ``w``'s (stacked) layers carry: a `ValueError` if they carry none."""
    layers = w.layers
    if not isinstance(layers, Layer) or layers.lora is None:
        raise ValueError("these weights carry no LoRA adapters (stacked layers expected)")
    return layers.lora


def base_of(w: Weights) -> Weights:
    """``w`` without its adapters: the base model, its arrays shared, not copied."""
    layers = w.layers
    if isinstance(layers, tuple):
        return dataclasses.replace(
            w, layers=tuple(dataclasses.replace(lw, lora=None) for lw in layers)
        )
    return dataclasses.replace(w, layers=dataclasses.replace(layers, lora=None))


def with_adapters(base: Weights, adapters: LayerAdapters) -> Weights:
    """The base weights (stacked layers) with ``adapters`` in their layers."""
    assert isinstance(base.layers, Layer)
    return dataclasses.replace(base, layers=dataclasses.replace(base.layers, lora=adapters))


def check_adapters(cfg: ModelConfig, adapters: Any) -> None:
    """A `ValueError` unless ``adapters`` are `LayerAdapters` (stacked, as a learner holds them:
    what a LoRA push sends) of the structure and shapes ``cfg`` declares."""
    specs = param_specs(cfg).layers
    want = specs.lora if isinstance(specs, Layer) else None
    if want is None or not isinstance(adapters, LayerAdapters):
        raise ValueError(
            f"a push of LoRA adapters ({type(adapters).__name__}) to an engine whose model "
            f"has {'none' if want is None else 'them'}"
        )
    got: Any = jax.tree.structure(adapters)
    if got != jax.tree.structure(want, is_leaf=is_spec):
        raise ValueError(f"adapters {got} do not match the model's")
    leaves = zip(jax.tree.leaves(want, is_leaf=is_spec), jax.tree.leaves(adapters), strict=True)
    for spec, x in leaves:
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"adapter of shape {x.shape} where {spec.shape} is declared")


def serving_adapters(
    cfg: ModelConfig, adapters: LayerAdapters, sharder: Sharder
) -> tuple[LayerAdapters, ...]:
    """LoRA ``adapters`` (stacked, as a learner holds them: what a LoRA push sends) as an
    engine serves them: checked against ``cfg``'s declaration, cast to its dtype, placed on
    ``sharder``'s mesh and split into each layer's (``jarl plan`` compiles this as a LoRA
    run's weight push)."""
    check_adapters(cfg, adapters)
    cast = jax.tree.map(lambda x: jnp.asarray(x, cfg.jnp_dtype), adapters)
    layout = param_shardings(cfg, sharder).layers
    assert isinstance(layout, Layer)
    cast = jax.device_put(cast, layout.lora)
    return _per_layer(cast)


def served_adapters(
    cfg: ModelConfig, served: Weights, adapters: LayerAdapters, sharder: Sharder
) -> Weights:
    """``served`` (an engine's weights, each layer its own: `decoder.serving_layout`) with new
    LoRA ``adapters`` on its layers (`serving_adapters`); the base arrays are the same ones,
    untouched."""
    layers = served.layers
    assert isinstance(layers, tuple)
    new = zip(layers, serving_adapters(cfg, adapters, sharder), strict=True)
    return dataclasses.replace(served, layers=tuple(dataclasses.replace(w, lora=a) for w, a in new))


@jax.jit
def _per_layer(adapters: LayerAdapters) -> tuple[LayerAdapters, ...]:
    """Stacked [L, ...] adapters as each layer's."""
    n = jax.tree.leaves(adapters)[0].shape[0]
    return tuple(jax.tree.map(lambda x, i=i: x[i], adapters) for i in range(n))


def init_adapters(key: jax.Array, cfg: ModelConfig) -> LayerAdapters:
    """Fresh adapters of ``cfg.lora`` (fp32): A as PEFT initialises it, B zeros."""
    specs = param_specs(cfg).layers
    assert isinstance(specs, Layer) and specs.lora is not None, "cfg carries no lora"
    leaves, treedef = jax.tree.flatten(specs.lora, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [s.initial(k, jnp.float32) for s, k in zip(leaves, keys, strict=True)]
    )


def add_lora(
    key: jax.Array, cfg: ModelConfig, base: Weights, lora: Lora
) -> tuple[ModelConfig, Weights]:
    """``cfg`` with ``lora`` and ``base`` with fresh adapters (`init_adapters`)."""
    if cfg.lora is not None:
        raise ValueError("the model carries LoRA adapters already")
    cfg = dataclasses.replace(cfg, lora=lora)
    return cfg, with_adapters(base, init_adapters(key, cfg))


def merge(cfg: ModelConfig, w: Weights) -> tuple[ModelConfig, Weights]:
    """The base model with every adapter merged in (``W + s A B``, fp32 sums): the same
    function as the unmerged forward, as plain weights (an HF checkpoint, a plain engine)."""
    assert cfg.lora is not None, "cfg carries no lora"
    adapters, layers = adapters_of(w), w.layers
    assert isinstance(layers, Layer)
    new = {
        t: merged(getattr(layers, t), a, cfg.lora.scale)
        for t in TARGETS
        if (a := getattr(adapters, t)) is not None
    }
    layers = dataclasses.replace(layers, lora=None, **new)
    return dataclasses.replace(cfg, lora=None), dataclasses.replace(w, layers=layers)


# ----------------------------------------------------------------------------------- PEFT


def _module(target: str) -> TensorRule:
    """The base weight's rule of ``target`` (its HF name ends in ``.weight``)."""
    return rule_of(f"layers.{target}")


def _peft_entries(
    cfg: ModelConfig,
) -> Iterator[tuple[str, TensorRule, str, str, int, tuple[int, ...]]]:
    """(PEFT name, layout rule, target, "a" or "b", layer, our per-layer shape) of every adapter
    tensor of ``cfg.lora``."""
    assert cfg.lora is not None
    specs = param_specs(cfg).layers
    assert isinstance(specs, Layer) and specs.lora is not None
    for target in cfg.lora.targets:
        base = _module(target)
        module = base.hf.removesuffix(".weight")
        spec = getattr(specs.lora, target)
        for part, name in (("a", "lora_A"), ("b", "lora_B")):
            shape = getattr(spec, part).shape[1:]
            in_axes = len(shape) - 1 if part == "a" else 1
            rule = TensorRule(name, f"{target}.{part}", "linear", in_axes=in_axes)
            for i in range(cfg.num_layers):
                yield f"{_PREFIX}{module.format(i=i)}.{name}.weight", rule, target, part, i, shape


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` for the adapters of ``cfg.lora``."""
    assert cfg.lora is not None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": [_module(t).hf.split(".")[-2] for t in cfg.lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def save_peft(path: str | Path, cfg: ModelConfig, w: Weights, base_model: str = "") -> Path:
    """Writes ``w``'s adapters as a PEFT adapter folder ``path`` (fp32 tensors)."""
    write_peft(path, cfg, adapters_of(w), base_model)
    return Path(path)


def write_peft(
    path: str | Path, cfg: ModelConfig, adapters: LayerAdapters, base_model: str = ""
) -> int:
    """Writes ``adapters`` (stacked, as a learner holds them) as a PEFT adapter folder ``path``
    (fp32 tensors); returns the bytes of its tensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapters = jax.device_get(adapters)
    tensors = {}
    for name, rule, target, part, i, _ in _peft_entries(cfg):
        arr = np.asarray(getattr(getattr(adapters, target), part)[i], np.float32)
        tensors[name] = to_hf(rule, arr)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(cfg, base_model)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sum(x.nbytes for x in tensors.values())


def _lora_of(file: Path) -> Lora:
    """Our `Lora` for a PEFT ``adapter_config.json``; what is malformed, or what we do not
    implement, is a `CheckpointError` naming the file."""
    try:
        config = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    names = {_module(t).hf.split(".")[-2]: t for t in TARGETS}
    for key, want in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False),
                      ("use_dora", False), ("fan_in_fan_out", False)):  # fmt: skip
        if config.get(key, want) != want:
            raise CheckpointError(f"{file}: {key}={config[key]!r:.80} is not supported ({want!r})")
    if config.get("task_type") not in (None, "CAUSAL_LM"):  # (SEQ_CLS was taken, silently)
        raise CheckpointError(
            f"{file}: task_type={config['task_type']!r:.80} is not supported ('CAUSAL_LM')"
        )
    # (exclude_modules, lora_bias and target_parameters were read as if absent: adapters
    # applied where PEFT applies none, biases and parameter targets dropped)
    unsupported = (
        "rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save",
        "exclude_modules", "lora_bias", "target_parameters", "layer_replication",
    )  # fmt: skip
    for key in unsupported:
        if config.get(key):
            raise CheckpointError(f"{file}: {key}={config[key]!r:.80} is not supported")
    modules = config.get("target_modules")
    if not isinstance(modules, list) or not all(isinstance(m, str) and m in names for m in modules):
        raise CheckpointError(
            f"{file}: target_modules={modules!r:.80}: expected a list of {sorted(names)}"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool):  # (4.9 was read as 4, true as 1)
        raise CheckpointError(f"{file}: r={rank!r:.80}: expected a whole number")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise CheckpointError(f"{file}: lora_alpha={alpha!r:.80}: expected a number")
    order = [t for t in TARGETS if t in {names[m] for m in modules}]
    try:
        return Lora(rank, float(alpha), tuple(order))
    except OverflowError:  # an int past a float's range
        raise CheckpointError(f"{file}: lora_alpha={alpha!r:.80}: not a finite number") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def peft_lora(path: str | Path) -> Lora:
    """The `Lora` (rank, alpha, targets) of the PEFT adapter folder ``path``, from its
    ``adapter_config.json`` (its tensors are not read)."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG}")
    return _lora_of(config_file)


def load_peft(path: str | Path, cfg: ModelConfig) -> tuple[ModelConfig, LayerAdapters]:
    """A PEFT adapter folder for the base model ``cfg``: ``cfg`` with its `Lora` and the
    adapters (fp32, host-side numpy). The tensors' names, dtypes (floats) and shapes are
    checked from the file's header before any is read, and their values must be finite and at
    most `MAX_ADAPTER_ABS` in magnitude (a NaN adapter, or a finite one of 1e30, makes every
    logit of its layers NaN)."""
    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    lora = peft_lora(path)
    if cfg.lora is not None:
        raise ValueError("the base model carries LoRA adapters already")
    try:  # (a rank past a projection's side: parameters and no function)
        cfg = dataclasses.replace(cfg, lora=lora)
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    stored = stored_tensors(weights)  # (a CheckpointError naming what does not fit)
    entries = list(_peft_entries(cfg))
    expected = {name for name, *_ in entries}
    if set(stored) != expected:
        raise CheckpointError(
            f"{weights}: missing {sorted(expected - set(stored))}, "
            f"unexpected {sorted(set(stored) - expected)}"
        )
    for name, rule, _, _, _, shape in entries:
        if stored[name].shape != hf_shape(rule, shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {stored[name].shape}, the config implies "
                f"{hf_shape(rule, shape)}"
            )
    specs = param_specs(cfg).layers
    assert isinstance(specs, Layer) and specs.lora is not None
    full = {
        (t, part): np.zeros(getattr(getattr(specs.lora, t), part).shape, np.float32)
        for t in lora.targets
        for part in ("a", "b")
    }
    with safe_open(str(weights), framework="numpy") as f:
        for name, rule, target, part, i, shape in entries:
            x = f.get_tensor(name).astype(np.float32)
            if not np.isfinite(x).all():
                raise CheckpointError(f"{weights}: tensor {name!r} holds values not finite")
            if np.abs(x).max(initial=0.0) > MAX_ADAPTER_ABS:
                raise CheckpointError(
                    f"{weights}: tensor {name!r} holds values past {MAX_ADAPTER_ABS:g} in "
                    "magnitude (a trained adapter's are far below 1): its layers' logits would "
                    "be NaN"
                )
            full[target, part][i] = to_ours(rule, x, shape)
    adapters = LayerAdapters(**{t: Adapter(full[t, "a"], full[t, "b"]) for t in lora.targets})
    return cfg, adapters
