"""LoRA adapters against HF PEFT's own: its adapter loaded into our decoder, ours loaded into
PEFT, and merged weights against the unmerged forward.

Tolerances. Against transformers + PEFT: 1e-4 absolute on logits of magnitude ~1-10 in fp32,
as the dense parity tests (`test_parity`): the adapter adds two more fp32 matmuls of at most a
few hundred terms per projection, whose rounding (~1e-6) leaves the margin as it was. Merged
against unmerged: 1e-5, the same function computed once as ``x (W + s A B)`` and once as
``x W + s (x A) B``; fp32 rounding of the reassociated sums (a few ulps of values ~1-10 per
matmul, through two layers) stays near 1e-6.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import peft
import pytest
import torch
import transformers

from jax_agent_rl.models import ModelConfig, Packed, forward, lm_logits, load_hf
from jax_agent_rl.models.adapters import (
    adapters_of,
    add_lora,
    base_of,
    load_peft,
    merge,
    save_peft,
    with_adapters,
)
from jax_agent_rl.models.config_checks import UnsupportedConfigError
from jax_agent_rl.models.decoder import param_shardings
from jax_agent_rl.models.hf_local import TINY_MOE, write_hf_checkpoint
from jax_agent_rl.models.lora import TARGETS, Lora
from jax_agent_rl.models.sharding import Sharder, make_mesh, one_device_sharder
from tests.models.hf_reference import padded_batch

TOL, MERGE_TOL = 1e-4, 1e-5
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(checkpoint: Path, targets: list[str]) -> peft.PeftModel:
    """The checkpoint in transformers with a PEFT LoRA adapter of random A and B (B nonzero,
    so that the adapter changes the logits)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    config = peft.LoraConfig(
        r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    return peft.get_peft_model(model, config).eval()


def _logits(
    model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray, pos: np.ndarray
) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
        )
    return out.logits.numpy()


def _ours(
    cfg: ModelConfig, w: object, tokens: np.ndarray, mask: np.ndarray, pos: np.ndarray
) -> np.ndarray:
    return np.asarray(
        lm_logits(
            w, forward(w, cfg, Packed(tokens, pos, mask), sharder=one_device_sharder()).hidden
        )
    )


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("llama", HF_TARGETS),
        ("qwen2", HF_TARGETS),
        ("qwen3", ["q_proj", "v_proj", "down_proj"]),
        ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),  # (expert MLPs: refused)
    ],
)
def test_peft_adapter_gives_peft_logits(
    family: str, targets: list[str], hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A PEFT adapter saved by PEFT, loaded into our decoder: PEFT's logits within 1e-4."""
    checkpoint = (
        write_hf_checkpoint(tmp_path / "moe", TINY_MOE)
        if family == "qwen3_moe"
        else hf_checkpoints[family]
    )
    model = _peft_model(checkpoint, targets)
    model.save_pretrained(tmp_path / "adapter")
    base_cfg, base = load_hf(checkpoint, sharder=one_device_sharder())
    cfg, adapters = load_peft(tmp_path / "adapter", base_cfg)
    assert cfg.lora == Lora(4, 12.0, tuple(t for t in TARGETS if f"{t}_proj" in targets))
    tokens, mask, pos = padded_batch(cfg.vocab_size)
    ref = _logits(model, tokens, mask, pos)
    got = _ours(cfg, with_adapters(base, adapters), tokens, mask, pos)
    plain = _ours(base_cfg, base, tokens, mask, pos)
    valid = mask.astype(bool)
    assert np.abs(ref - plain)[valid].max() > 100 * TOL  # the adapter moves the logits
    assert np.abs(got - ref)[valid].max() <= TOL
    # adapters left out: the base model's logits exactly (the reference policy's forward)
    assert np.array_equal(
        _ours(cfg, base_of(with_adapters(base, adapters)), tokens, mask, pos), plain
    )


def _trained_like(w: object) -> object:
    """``w`` with random B (a fresh adapter's is zero, which would test nothing)."""
    adapters = adapters_of(w)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    noisy = [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return with_adapters(base_of(w), jax.tree.unflatten(treedef, noisy))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_our_adapter_loads_in_peft_and_merges(
    family: str, hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Our adapter written as a PEFT folder: PEFT loads it and gives our logits; merged into
    the base weights it gives the unmerged forward's."""
    base_cfg, base = load_hf(hf_checkpoints[family], sharder=one_device_sharder())
    cfg, w = add_lora(jax.random.key(0), base_cfg, base, Lora(8, 16.0))
    w = _trained_like(w)
    tokens, mask, pos = padded_batch(cfg.vocab_size)
    ours = _ours(cfg, w, tokens, mask, pos)
    save_peft(tmp_path / "adapter", cfg, w, str(hf_checkpoints[family]))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_checkpoints[family], dtype=torch.float32, attn_implementation="eager"
    )
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    valid = mask.astype(bool)
    assert np.abs(ours - _ours(base_cfg, base, tokens, mask, pos))[valid].max() > 100 * TOL
    assert np.abs(_logits(peft_model, tokens, mask, pos) - ours)[valid].max() <= TOL
    merged_cfg, merged_w = merge(cfg, w)
    assert merged_cfg == base_cfg
    assert np.abs(_ours(merged_cfg, merged_w, tokens, mask, pos) - ours)[valid].max() <= MERGE_TOL


def test_fresh_adapter_is_peft_init(hf_checkpoints: dict[str, Path]) -> None:
    """A fresh adapter: B zero (the model's function unchanged), A uniform within PEFT's
    kaiming bound 1/sqrt(in) and filling it (max over 64 x 4 draws above 0.9 of the bound)."""
    base_cfg, base = load_hf(hf_checkpoints["llama"], sharder=one_device_sharder())
    cfg, w = add_lora(jax.random.key(0), base_cfg, base, Lora(4, 8.0, ("q", "o")))
    adapters = adapters_of(w)
    assert adapters.k is None and adapters.gate is None
    for a, fan_in in (
        (adapters.q.a, cfg.hidden_size),
        (adapters.o.a, cfg.num_heads * cfg.head_dim),
    ):
        bound = np.abs(np.asarray(a)).max()
        assert 0.9 / np.sqrt(fan_in) < bound <= 1 / np.sqrt(fan_in)
    assert not np.asarray(adapters.q.b).any() and not np.asarray(adapters.o.b).any()
    tokens, mask, pos = padded_batch(cfg.vocab_size)
    np.testing.assert_allclose(
        _ours(cfg, w, tokens, mask, pos), _ours(base_cfg, base, tokens, mask, pos), atol=0
    )


def test_adapters_are_laid_out_by_their_logical_axes() -> None:
    """The adapters' shardings come from the same table as every weight's: A's input dims as
    its base weight's, the rank replicated."""
    cfg = dataclasses.replace(
        ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16), lora=Lora(4, 8.0, ("q", "down"))
    )
    sharder = Sharder(make_mesh(data=2, fsdp=2, tensor=2))
    lora = param_shardings(cfg, sharder).layers.lora
    assert tuple(lora.q.a.spec) == (None, "fsdp", None)
    assert tuple(lora.q.b.spec) == (None, None, "tensor", None)
    assert tuple(lora.down.a.spec) == (None, "tensor", None)
    assert tuple(lora.down.b.spec) == (None, None, "fsdp")


def test_lora_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="'qkv' is none"):
        Lora(4, 8.0, ("qkv",))
    with pytest.raises(ValueError, match="rank=0"):
        Lora(0, 8.0)
    moe = ModelConfig(
        "qwen3_moe", 256, 64, 128, 2, 4, 2, 16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, qk_norm=True,
    )  # fmt: skip
    dataclasses.replace(moe, lora=Lora(4, 8.0, ("q", "k", "v", "o")))  # attention: fine
    with pytest.raises(UnsupportedConfigError, match=r"\['gate', 'up'\] on qwen3_moe"):
        dataclasses.replace(moe, lora=Lora(4, 8.0, ("q", "gate", "up")))
