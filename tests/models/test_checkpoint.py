"""HF import/export: exact round trips, and loud failures on malformed checkpoints."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jax_agent_rl.models import (
    CheckpointError,
    ModelConfig,
    UnsupportedConfigError,
    load_hf,
    save_hf,
)
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.models.sharding import one_device_sharder


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("max_shard_bytes", [2**31, 40_000])
def test_round_trip_gives_identical_tensors(
    family: str, max_shard_bytes: int, hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    cfg, w = load_hf(hf_checkpoints[family], sharder=one_device_sharder())
    save_hf(tmp_path, cfg, w, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_bytes < 2**31)
    before, after = _state_dict(hf_checkpoints[family]), _state_dict(tmp_path)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    # and back into JAX: the (possibly sharded) export loads to the same weights
    cfg2, w2 = load_hf(tmp_path, sharder=one_device_sharder())
    assert cfg2 == cfg
    leaves, leaves2 = jax.tree.leaves(w), jax.tree.leaves(w2)
    assert len(leaves) == len(leaves2)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, leaves2, strict=True))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(hf_checkpoints["qwen2"], tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        CheckpointError, match=r"missing tensors.*model\.layers\.1\.self_attn\.k_proj\.bias"
    ):
        load_hf(path, sharder=one_device_sharder())


def test_wrong_shape_is_named(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(hf_checkpoints["llama"], tmp_path / "ckpt")

    def shrink(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    _edit_tensors(path, shrink)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(127, 64\).*\(128, 64\)"
    ):
        load_hf(path, sharder=one_device_sharder())


def test_unexpected_tensor_is_named(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(hf_checkpoints["llama"], tmp_path / "ckpt")
    _edit_tensors(
        path, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.extra\.weight"
    ):
        load_hf(path, sharder=one_device_sharder())


def test_tensor_stored_twice_is_named(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    cfg, w = load_hf(hf_checkpoints["qwen3"], sharder=one_device_sharder())
    save_hf(tmp_path, cfg, w, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    a, b = load_file(str(tmp_path / first)), load_file(str(tmp_path / second))
    name = next(iter(a))
    b[name] = a[name]
    save_file(b, str(tmp_path / second))
    with pytest.raises(CheckpointError, match=rf"{name}.*stored twice"):
        load_hf(tmp_path, sharder=one_device_sharder())


def test_unknown_architecture_is_named(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(hf_checkpoints["llama"], tmp_path / "ckpt")
    _edit_config(path, model_type="gpt_neox")
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt_neox'"):
        load_hf(path, sharder=one_device_sharder())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"num_experts": 8}, "num_experts"),
        ({"num_attention_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_config_field_is_named(fields: dict[str, object], named: str) -> None:
    hf = json.loads(json.dumps(TINY["llama"]))
    hf.update(fields)
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf(hf)


def test_legacy_rope_layout_reads_the_same() -> None:
    """Older config.json files carry rope_theta + rope_scaling instead of rope_parameters."""
    legacy = ModelConfig.from_hf(TINY["llama"])
    new = dict(TINY["llama"])
    scaling = dict(new.pop("rope_scaling"))
    new["rope_parameters"] = {**scaling, "rope_theta": new.pop("rope_theta")}
    assert ModelConfig.from_hf(new) == legacy
    assert legacy.rope_scaling is not None and legacy.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf(legacy.to_hf()) == legacy
