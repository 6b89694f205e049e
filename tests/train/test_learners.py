"""The model a run trains from its config: ``model.lora.adapter_path`` starts a LoRA run from a
PEFT adapter folder (`train.learners.lora_of`, `with_run_lora`).

Tolerance: an exported adapter loaded again is the same fp32 numbers (PEFT's layout is a
transpose and reshape of ours, exact), so the policy's logits agree to the last bit; 1e-6 on
logits of magnitude ~1-10 leaves room only for a different summation order, which the same
forward on the same arrays does not take."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.config import JarlConfig, load_config
from jax_agent_rl.models import ModelConfig, Packed, Weights, forward, lm_logits, load_hf
from jax_agent_rl.models.adapters import adapters_of, with_adapters
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.train.export import export_policy
from jax_agent_rl.train.learners import run_model, with_run_lora

TOL = 1e-6


def _logits(cfg: ModelConfig, w: Weights) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12), (2, 12))
    return np.asarray(
        lm_logits(
            w,
            forward(
                w, cfg, Packed(tokens, positions, np.ones((2, 12))), sharder=one_device_sharder()
            ).hidden,
        )
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray]:
    """A LoRA run's policy (rank 4, alpha 8, on q, o and down; B drawn, not zeros) exported
    as a PEFT adapter folder by ``jarl export``'s writer: the base checkpoint, the folder, and
    the policy's logits."""
    root = tmp_path_factory.mktemp("adapter-path")
    source = write_hf_checkpoint(root / "base", TINY_QWEN2)
    cfg = load_config(
        None,
        [
            *(f"model.path={source}", "data.train=t"),
            *("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,o,down]"),
        ],
    )
    base_cfg, base = load_hf(source, sharder=one_device_sharder())
    model, params = with_run_lora(cfg, base_cfg, base)
    trained = jax.tree.map(lambda x: x + 0.05, adapters_of(params))
    params = with_adapters(base, trained)
    folder = export_policy(root / "adapter", cfg, model, jax.device_get(params))
    return source, folder, _logits(model, params)


def _config(source: Path, folder: Path, *lora: str) -> JarlConfig:
    return load_config(
        None,
        [f"model.path={source}", "data.train=t", f"model.lora.adapter_path={folder}", *lora],
    )


def test_a_run_starts_from_an_exported_adapter(exported: tuple[Path, Path, np.ndarray]) -> None:
    """Rank 0 takes the folder's rank, alpha and targets; set, they must agree with it (the
    targets in any order): either way the policy is the exported one."""
    source, folder, want = exported
    base_cfg, base = load_hf(source, sharder=one_device_sharder())
    for lora in ([], ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[down,q,o]"]):
        cfg = _config(source, folder, *lora)
        model, params = with_run_lora(cfg, base_cfg, base)
        assert model.lora is not None
        assert (model.lora.rank, model.lora.alpha, model.lora.targets) == (
            4,
            8.0,
            ("q", "o", "down"),
        )
        assert np.abs(_logits(model, params) - want).max() <= TOL
    fresh = dataclasses.replace(model, lora=None)
    assert np.abs(_logits(fresh, base) - want).max() > 1e-2  # the adapters matter


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            ["model.lora.rank=8", "model.lora.alpha=8", "model.lora.targets=[q,o,down]"],
            "model.lora.rank=8 where its adapter_config.json has 4",
        ),
        (
            ["model.lora.rank=4", "model.lora.alpha=16", "model.lora.targets=[q,o,down]"],
            "model.lora.alpha=16.0 where its adapter_config.json has 8.0",
        ),
        (
            ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,v]"],
            "model.lora.targets=['q', 'v'] where its adapter_config.json has ['q', 'o', 'down']",
        ),
    ],
    ids=["rank", "alpha", "targets"],
)
def test_settings_that_disagree_with_the_adapter_folder_are_named(
    exported: tuple[Path, Path, np.ndarray], lora: list[str], message: str
) -> None:
    source, folder, _ = exported
    cfg = _config(source, folder, *lora)
    with pytest.raises(ValueError) as e:
        run_model(cfg, ModelConfig.from_pretrained(source))
    assert str(e.value) == (
        f"model.lora.adapter_path={str(folder)!r}: {message}: set them so, or "
        "model.lora.rank=0 to take the folder's"
    )


def test_a_folder_without_an_adapter_config_is_named(tmp_path: Path) -> None:
    source = write_hf_checkpoint(tmp_path / "base", TINY_QWEN2)
    cfg = _config(source, source)
    with pytest.raises(ValueError) as e:
        run_model(cfg, ModelConfig.from_pretrained(source))
    assert str(e.value) == f"{source} is not a PEFT adapter folder: it has no adapter_config.json"
