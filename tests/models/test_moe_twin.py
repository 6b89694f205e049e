"""The dense twin of a Qwen3-MoE (`hf_local.dense_twin`), which bench/learner.py and
bench/decode.py time a MoE against: `jarl checkpoint make`'s MoE presets' twins have their
active parameters, by the closed form of the MLP width."""

import pytest

from jax_agent_rl.cli.demo import PRESETS
from jax_agent_rl.models import ModelConfig
from jax_agent_rl.models.hf_local import dense_twin

# preset -> the twin's MLP width by hand: the active MLP parameters per token over 3 x D x L.
# tiny-moe (D 128, L 3, layer 1 dense of 384; 8 experts of 64, 2 per token):
#   (2 x (128 x 8 + 3 x 2 x 128 x 64) + 3 x 128 x 384) / (3 x 128 x 3) = 247808 / 1152 = 215.1
# small-moe (D 512, L 8, all sparse; 8 experts of 384, 2 per token):
#   (512 x 8 + 3 x 2 x 512 x 384) / (3 x 512) = 1183744 / 1536 = 770.7
WIDTHS = {"tiny-moe": 215, "small-moe": 771}


@pytest.mark.parametrize("name", list(WIDTHS))
def test_a_moe_presets_dense_twin_has_its_active_parameters(name: str) -> None:
    fields, vocab = PRESETS[name]
    moe = {**fields, "vocab_size": vocab}
    cfg, twin = ModelConfig.from_hf(moe), ModelConfig.from_hf(dense_twin(moe))
    assert (twin.family, twin.num_experts, twin.intermediate_size) == ("qwen3", 0, WIDTHS[name])
    for field in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "qkv_bias",
        "qk_norm",
        "tie_embeddings",
        "rope_theta",
        "rms_norm_eps",
    ):
        assert getattr(twin, field) == getattr(cfg, field), field
    # a dense model's parameters are all active; the width's rounding moves 3 x D x L by < 1/2
    assert twin.active_params == twin.num_params
    assert abs(twin.active_params - cfg.active_params) <= 1.5 * cfg.hidden_size * cfg.num_layers
    assert cfg.active_params < cfg.num_params
