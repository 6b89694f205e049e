"""The learner against settings and updates that do not stay finite or add nothing.

- ``model.lora.alpha=1e308`` was taken (inf in float32: the first adapter gradient made the
  weights NaN); a scale alpha / rank past `models.lora.MAX_SCALE` is refused, and an alpha
  below `MIN_ALPHA` (a subnormal one was taken: adapters that change no output).
- ``model.lora.rank=1000000000000`` (a typo) passed every check and ended ``jarl train`` in a
  traceback allocating 1.5 PB; an adapter's rank past its projection's smaller side adds
  parameters and no function (A B's rank is at most min(in, out)), so it is refused, naming
  the projection and the largest rank that fits (the config check says it as a line).
- An update whose loss or gradient norm was not finite wrote NaN into every weight and Adam
  moment, and the engine got them; now it is skipped on the device, counted in
  ``nonfinite_updates``."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from jax_agent_rl.config import AlgorithmSection
from jax_agent_rl.config.model import (
    MAX_LORA_SCALE,
    MIN_LORA_ALPHA,
    LoraSection,
    lora_targets_problem,
)
from jax_agent_rl.models import ModelConfig, init_params
from jax_agent_rl.models.config_checks import UnsupportedConfigError
from jax_agent_rl.models.lora import MAX_SCALE, MIN_ALPHA, Lora
from jax_agent_rl.models.sharding import one_device_sharder
from tests.rl.test_learner import CFG, REWARDS, _learner, _step, random_trajectories

TINY = ModelConfig(
    family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


def test_a_lora_rank_past_a_projections_smaller_side_is_refused() -> None:
    fits = dataclasses.replace(TINY, lora=Lora(16, 8.0))  # (k, v: in 32, out 16)
    assert fits.lora is not None and fits.lora.rank == 16
    assert dataclasses.replace(TINY, lora=Lora(32, 8.0, ("q", "o"))).lora is not None
    side = r"k projection's smaller side \(in 32, out 16\).*use a rank <= 16$"
    for rank in (17, 10**12):
        with pytest.raises(UnsupportedConfigError, match=rf"^LoRA rank={rank} exceeds the {side}"):
            dataclasses.replace(TINY, lora=Lora(rank, 8.0))


@pytest.mark.parametrize(("rank", "alpha"), [(4, 1e308), (1, 2e4), (8, 1e5)])
def test_a_lora_scale_past_the_bound_is_refused(rank: int, alpha: float) -> None:
    assert MAX_LORA_SCALE == MAX_SCALE  # (the config's copy of the model's bound)
    problem = lora_targets_problem(LoraSection(rank=rank, alpha=alpha))
    assert problem is not None and f"expected at most {MAX_SCALE:g}" in problem
    with pytest.raises(ValueError, match=f"expected a scale <= {MAX_SCALE:g}"):
        Lora(rank, alpha)
    assert lora_targets_problem(LoraSection(rank=rank, alpha=rank * MAX_SCALE)) is None


@pytest.mark.parametrize("alpha", [1e-310, 1e-30, 5e-5])
def test_a_lora_alpha_below_the_bound_is_refused(alpha: float) -> None:
    """A subnormal alpha was taken: its scale rounds the adapters' contribution to nothing."""
    assert MIN_LORA_ALPHA == MIN_ALPHA  # (the config's copy)
    problem = lora_targets_problem(LoraSection(rank=8, alpha=alpha))
    assert problem is not None and f"expected >= {MIN_ALPHA:g}" in problem
    with pytest.raises(ValueError, match=re.escape(f"expected >= {MIN_ALPHA:g}")):
        Lora(8, alpha)
    assert lora_targets_problem(LoraSection(rank=8, alpha=MIN_ALPHA)) is None
    assert Lora(8, MIN_ALPHA).alpha == MIN_ALPHA


def test_an_update_whose_loss_is_not_finite_is_skipped() -> None:
    """A sampler logprob that is NaN makes the truncated importance weight, and so the loss,
    NaN: the update is skipped (weights and optimizer state as they were), counted; the next
    finite batch updates as ever."""
    params = init_params(jax.random.key(7), CFG, sharder=one_device_sharder())
    learner, state = _learner(AlgorithmSection(tis_cap=2.0), params)
    trajs = random_trajectories(8, seed=7)
    batch, sequences, real = _step(trajs, REWARDS[:8], 1, 64, 2)
    nan = np.where(np.asarray(batch.mask) > 0, np.nan, 0.0).astype(np.float32)
    poisoned = dataclasses.replace(batch, rollout_logp=nan)
    before = jax.tree.map(np.array, (state.policy.params, state.policy.opt_state))
    state, m, _ = learner.rl_update(state, poisoned, sequences, real)
    assert not np.isfinite(m["loss"]) and m["nonfinite_updates"] == 1.0
    after = jax.tree.map(np.array, (state.policy.params, state.policy.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # (before: NaN everywhere)
    state, m, _ = learner.rl_update(state, batch, sequences, real)
    assert m["nonfinite_updates"] == 0.0 and np.isfinite(m["loss"])
    moved = jax.tree.map(np.asarray, state.policy.params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(moved))
    assert any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(before[0]), strict=True)
    )
