"""Run configs: YAML + dotted overrides into frozen dataclasses; every mistake names its key."""

import dataclasses
from pathlib import Path

import pytest

from jax_agent_rl.config import ConfigError, JarlConfig, load_config, to_yaml


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "model:\n  path: /ckpt\n  dtype: float32\nmesh:\n  fsdp: 2\ndata:\n  train: t.jsonl\n",
    )
    cfg = load_config(path, ["model.dtype=bfloat16", "mesh.tensor=4"])
    assert isinstance(cfg, JarlConfig)
    assert cfg.model.path == "/ckpt" and cfg.model.dtype == "bfloat16"
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.path = "x"  # type: ignore[misc]
    assert load_config(None, ["model.path=/a", "data.train=t"]).model.path == "/a"
    assert "dtype: bfloat16" in to_yaml(cfg)


def test_misspelled_key_names_it_and_the_allowed_keys(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'model\.dtpye'; allowed here: \['dtype', 'path', 'tokenizer'\]",
    ):
        load_config(None, ["model.path=/a", "model.dtpye=bfloat16"])
    path = _yaml(tmp_path, "modle:\n  path: /x\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'modle'; allowed here: \['agent', 'algorithm', 'data', "
        r"'learner', 'mesh', 'model', 'optim', 'rollout', 'sft', 'tools', 'trainer'\]",
    ):
        load_config(path)


def test_bad_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'model\.dtype'.*float16"):
        load_config(None, ["model.path=/a", "model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"'algorithm\.loss_agg_mode'"):
        load_config(None, ["algorithm.loss_agg_mode=mean"])
    with pytest.raises(ConfigError, match=r"'mesh\.fsdp'"):
        load_config(None, ["model.path=/a", "mesh.fsdp=two"])
    with pytest.raises(
        ConfigError, match=r"required config keys not set: \['data\.train', 'model\.path'\]"
    ):
        load_config(None, [])
    with pytest.raises(ConfigError, match=r"not of the form key\.sub=value"):
        load_config(None, ["model.path"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")
