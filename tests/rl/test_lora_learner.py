"""A LoRA policy's learner: only the adapters train (the base weights get no gradient and no
optimizer state, and stay bitwise what they were), and the KL reference is the base model
itself, read from the same arrays with the adapters left out."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jax_agent_rl.config import OptimSection
from jax_agent_rl.models import Sharder, init_params, make_mesh
from jax_agent_rl.models.adapters import adapters_of, base_of, init_adapters, with_adapters
from jax_agent_rl.models.lora import LayerAdapters, Lora
from jax_agent_rl.rl.batch import make_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.objectives import SamplingSpec, token_stats
from jax_agent_rl.rl.update import reference_of
from tests.rl.test_learner import ALGO, CFG, REWARDS, _step, random_trajectories, spec

LORA_CFG = dataclasses.replace(CFG, lora=Lora(4, 8.0))


def _lora_params() -> object:
    base = init_params(jax.random.key(0), CFG)
    return with_adapters(base, init_adapters(jax.random.key(1), LORA_CFG))


def test_three_steps_train_only_the_adapters() -> None:
    """Three RL steps (KL on) of a sharded learner: the base arrays are bitwise unchanged,
    every adapter moved (B from zero, A from its init), the optimizer's state holds adapter
    leaves only, and no copy of the weights is kept for the reference."""
    params = _lora_params()
    before = jax.tree.map(np.asarray, params)
    learner = Learner(
        LORA_CFG,
        params,
        algo=ALGO,
        optim=OptimSection(lr=1e-2),
        sampling=SamplingSpec(0.8),
        micro_batch_size=4,
        sharder=Sharder(make_mesh(data=2, fsdp=2, tensor=2)),
    )
    assert learner.state.reference is None
    trajs = random_trajectories(12, seed=4)
    for _ in range(3):
        metrics = learner.train_step(*_step(trajs, REWARDS, 2, None, 4))
        assert np.isfinite(metrics["loss"])
    after = jax.tree.map(np.asarray, learner.params)
    base_equal = jax.tree.map(np.array_equal, base_of(after), base_of(before))
    assert all(jax.tree.leaves(base_equal))
    moved = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), adapters_of(after), adapters_of(before)
    )
    assert all(jax.tree.leaves(moved))
    # Adam's moments (optax's chain(clip, adamw)): one per adapter leaf, nothing of the base
    mu = learner.state.policy.opt_state[1][0].mu
    assert isinstance(mu, LayerAdapters)
    assert jax.tree.map(np.shape, mu) == jax.tree.map(np.shape, adapters_of(after))
    n_opt = sum(x.size for x in jax.tree.leaves(learner.state.policy.opt_state))
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters_of(after)))
    assert n_opt == 2 * n_adapters + 2  # mu, nu and the two counters (clip's and Adam's)


def test_the_reference_is_the_base_model() -> None:
    """The KL reference of a LoRA policy with nonzero adapters gives exactly the base model's
    logprobs (the adapters left out of the same arrays), not the policy's."""
    params = _lora_params()
    adapters = jax.tree.map(lambda x: x + 0.05, adapters_of(params))  # B nonzero
    params = with_adapters(base_of(params), adapters)
    learner = Learner(LORA_CFG, params, algo=ALGO, optim=OptimSection(), sampling=SamplingSpec(0.8))
    s = spec(ALGO, sampling=SamplingSpec(0.8), cfg=LORA_CFG)
    reference = reference_of(s, learner.state)
    assert reference is not None
    assert all(
        x is y
        for x, y in zip(
            jax.tree.leaves(reference), jax.tree.leaves(base_of(learner.params)), strict=True
        )
    )
    batch = make_batch(random_trajectories(4, seed=5), bucket=8)
    logp = jax.jit(lambda sp, p, b: token_stats(sp, p, b)[0], static_argnums=0)
    ref = np.asarray(logp(s, reference, batch))
    plain = np.asarray(logp(spec(ALGO, sampling=SamplingSpec(0.8)), base_of(params), batch))
    policy = np.asarray(logp(s, learner.params, batch))
    mask = np.asarray(batch.mask) > 0
    assert np.array_equal(ref[mask], plain[mask])
    assert np.abs(policy - ref)[mask].max() > 1e-3  # the adapters do change the policy


def test_a_lora_learner_refuses_a_reference_copy() -> None:
    params = _lora_params()
    with pytest.raises(ValueError, match="pass no reference"):
        Learner(
            LORA_CFG, params, algo=ALGO, optim=OptimSection(), sampling=SamplingSpec(0.8),
            reference=params,
        )  # fmt: skip
