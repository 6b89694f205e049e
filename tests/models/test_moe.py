"""Qwen3-MoE's config: the fields read, written back, and refused by name."""

import dataclasses

import pytest
import transformers

from jax_agent_rl.models import ModelConfig, UnsupportedConfigError
from jax_agent_rl.models.hf_local import TINY, TINY_MOE

# ------------------------------------------------------------------------------------ config


def test_config_reads_the_moe_fields_and_round_trips() -> None:
    cfg = ModelConfig.from_hf(TINY_MOE)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.mlp_only_layers) == (32, True, (1,))
    assert cfg.moe_layers == (True, False, True)
    assert cfg.router_aux_loss_coef == 0.001  # HF's default where config.json gives none
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # transformers >= 5 writes num_local_experts; older checkpoints num_experts
    renamed = {k: v for k, v in TINY_MOE.items() if k != "num_experts"}
    assert ModelConfig.from_hf({**renamed, "num_local_experts": 8}) == cfg
    # decoder_sparse_step 2: layers 1, 3 sparse, unless mlp_only
    stepped = ModelConfig.from_hf({**TINY_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert stepped.moe_layers == (False, False, False, True)
    # transformers reads our config.json as the same architecture
    hf = transformers.Qwen3MoeConfig(**cfg.to_hf())
    assert (hf.num_experts, hf.mlp_only_layers, hf.norm_topk_prob) == (8, [1], True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"num_local_experts": 4}, "num_local_experts=4 disagree"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
        ({"mlp_only_layers": [3]}, r"mlp_only_layers=\(3,\)"),
        ({"mlp_only_layers": [1, 1]}, "mlp_only_layers"),
        ({"mlp_only_layers": 1}, "mlp_only_layers=1"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef=-1"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size=None"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_field_is_named(fields: dict[str, object], named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf({**TINY_MOE, **fields})


def test_missing_moe_field_is_named() -> None:
    hf = {k: v for k, v in TINY_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(UnsupportedConfigError, match="lacks the required field 'moe_intermediate"):
        ModelConfig.from_hf(hf)
    dense = ModelConfig.from_hf(TINY["qwen3"])
    with pytest.raises(UnsupportedConfigError, match="a qwen3 model has no experts"):
        dataclasses.replace(dense, num_experts=4)
