"""A LoRA policy's learner: only the adapters train (the base weights get no gradient and no
optimizer state, and stay bitwise what they were), and the KL reference is the base model
itself, read from the same arrays with the adapters left out."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import OptimSection
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import Sharder, init_params, make_mesh
from jax_agent_rl.models.adapters import adapters_of, base_of, init_adapters, with_adapters
from jax_agent_rl.models.lora import LayerAdapters, Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl.batch import TrainBatch, make_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.objectives import SamplingSpec, token_stats
from jax_agent_rl.rl.update import reference_of
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from tests.rl.test_learner import ALGO, CFG, REWARDS, _step, random_trajectories, spec

LORA_CFG = dataclasses.replace(CFG, lora=Lora(4, 8.0))


def _lora_params() -> object:
    base = init_params(jax.random.key(0), CFG, sharder=one_device_sharder())
    return with_adapters(base, init_adapters(jax.random.key(1), LORA_CFG))


def test_three_steps_train_only_the_adapters() -> None:
    """Three RL steps (KL on) of a sharded learner: the base arrays are bitwise unchanged,
    every adapter moved (B from zero, A from its init), the optimizer's state holds adapter
    leaves only, and no copy of the weights is kept for the reference."""
    params = _lora_params()
    before = jax.tree.map(np.asarray, params)
    learner = Learner(
        LORA_CFG,
        algo=ALGO,
        optim=OptimSection(lr=1e-2),
        sampling=SamplingSpec(0.8),
        micro_batch_size=4,
        sharder=Sharder(make_mesh(data=2, fsdp=2, tensor=2)),
    )
    state = learner.init_state(params)
    assert state.reference is None
    trajs = random_trajectories(12, seed=4)
    for _ in range(3):
        state, metrics, _ = learner.rl_update(state, *_step(trajs, REWARDS, 2, None, 4))
        assert np.isfinite(metrics["loss"])
    after = jax.tree.map(np.asarray, state.policy.params)
    base_equal = jax.tree.map(np.array_equal, base_of(after), base_of(before))
    assert all(jax.tree.leaves(base_equal))
    moved = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), adapters_of(after), adapters_of(before)
    )
    assert all(jax.tree.leaves(moved))
    # Adam's moments (optax's chain(clip, adamw)): one per adapter leaf, nothing of the base
    mu = state.policy.opt_state[1][0].mu
    assert isinstance(mu, LayerAdapters)
    assert jax.tree.map(np.shape, mu) == jax.tree.map(np.shape, adapters_of(after))
    n_opt = sum(x.size for x in jax.tree.leaves(state.policy.opt_state))
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters_of(after)))
    assert n_opt == 2 * n_adapters + 2  # mu, nu and the two counters (clip's and Adam's)


def test_the_reference_is_the_base_model() -> None:
    """The KL reference of a LoRA policy with nonzero adapters gives exactly the base model's
    logprobs (the adapters left out of the same arrays), not the policy's."""
    params = _lora_params()
    adapters = jax.tree.map(lambda x: x + 0.05, adapters_of(params))  # B nonzero
    params = with_adapters(base_of(params), adapters)
    state = Learner(
        LORA_CFG,
        algo=ALGO,
        optim=OptimSection(),
        sampling=SamplingSpec(0.8),
        sharder=one_device_sharder(),
    ).init_state(params)
    s = spec(ALGO, sampling=SamplingSpec(0.8), cfg=LORA_CFG)
    reference = reference_of(s, state)
    assert reference is not None
    assert all(
        x is y
        for x, y in zip(
            jax.tree.leaves(reference), jax.tree.leaves(base_of(state.policy.params)), strict=True
        )
    )
    batch = make_batch(random_trajectories(4, seed=5), bucket=8)
    logp = jax.jit(lambda sp, p, b: token_stats(sp, p, b)[0], static_argnums=0)
    ref = np.asarray(logp(s, reference, batch))
    plain = np.asarray(logp(spec(ALGO, sampling=SamplingSpec(0.8)), base_of(params), batch))
    policy = np.asarray(logp(s, state.policy.params, batch))
    mask = np.asarray(batch.mask) > 0
    assert np.array_equal(ref[mask], plain[mask])
    assert np.abs(policy - ref)[mask].max() > 1e-3  # the adapters do change the policy


def test_a_lora_learner_refuses_a_reference_copy() -> None:
    params = _lora_params()
    learner = Learner(
        LORA_CFG,
        algo=ALGO,
        optim=OptimSection(),
        sampling=SamplingSpec(0.8),
        sharder=one_device_sharder(),
    )
    with pytest.raises(ValueError, match="pass no reference"):
        learner.init_state(params, reference=params)


def _sampled(backend: EmbeddedBackend, seed: int) -> TrainBatch:
    """Four requests sampled at temperature 0.8, packed into one row with their logprobs."""
    sampling = SamplingParams(max_tokens=16, temperature=0.8, seed=seed)

    async def go() -> list[tuple[GenerateRequest, object]]:
        reqs = [GenerateRequest(f"r{i}", tuple(range(3 + i, 9 + i)), sampling) for i in range(4)]
        return list(
            zip(reqs, await asyncio.gather(*(backend.generate(r) for r in reqs)), strict=True)
        )

    trajs = []
    for req, res in asyncio.run(go()):
        t = Trajectory(uid=req.request_id, group_id="g", prompt_ids=list(req.prompt_ids))
        t.append(list(res.token_ids), model=True, logprobs=list(res.logprobs))  # type: ignore[attr-defined]
        trajs.append(t.train_sequence(0.0))
    return make_batch(trajs, bucket=16, layout=[[0, 1, 2, 3]])


def test_adapter_pushes_keep_sampler_and_learner_logprobs_equal() -> None:
    """The embedded engine serving a LoRA policy, updated after each of two RL steps by a push
    of the adapters alone: the bytes pushed are the adapters' (8% of the tiny model's here),
    and the learner's logprobs of what the engine samples after each push equal the sampler's
    within the fp32 tolerance (1e-4, the backend's stated one)."""
    learner = Learner(
        LORA_CFG, algo=ALGO, optim=OptimSection(lr=1e-2),
        sampling=SamplingSpec(0.8), micro_batch_size=4, sharder=one_device_sharder(),
)  # fmt: skip
    state = learner.init_state(_lora_params())
    engine = Engine(LORA_CFG, max_concurrent_decodes=4, max_len=64, sharder=one_device_sharder())
    backend = EmbeddedBackend(engine, learner.rollout_params(state, "float32"))
    s = spec(ALGO, sampling=SamplingSpec(0.8), cfg=LORA_CFG)
    logp = jax.jit(lambda p, b: token_stats(s, p, b)[0])
    full = sum(x.nbytes for x in jax.tree.leaves(state.policy.params))
    trajs = random_trajectories(12, seed=6)
    try:
        for version in (1, 2):
            state, _, _ = learner.rl_update(state, *_step(trajs, REWARDS, 1, None, 4))
            pushed = learner.pushed_params(state, "float32")
            assert isinstance(pushed, LayerAdapters)
            asyncio.run(backend.update_weights(pushed, version))
            assert backend.last_push is not None
            n_adapters = sum(x.nbytes for x in jax.tree.leaves(adapters_of(state.policy.params)))
            assert backend.last_push.bytes == n_adapters < 0.1 * full  # 8.0%: rank 4 of D = 64
            batch = _sampled(backend, seed=version)
            mask = np.asarray(batch.mask) > 0
            learned = np.asarray(logp(state.policy.params, batch))[mask]
            np.testing.assert_allclose(learned, np.asarray(batch.rollout_logp)[mask], atol=1e-4)
        wrong = jax.tree.map(lambda x: x[:, :1], pushed)
        with pytest.raises(ValueError, match="adapter of shape"):
            asyncio.run(backend.update_weights(wrong, 3))
    finally:
        asyncio.run(backend.close())


def test_a_bf16_lora_learner_holds_its_frozen_base_in_bf16() -> None:
    """Computing in bfloat16, the frozen base is held in bfloat16 (the forward casts it so
    anyway) and the adapters in float32; a step leaves the base bitwise as it was."""
    params = _lora_params()
    learner = Learner(
        LORA_CFG, algo=ALGO, optim=OptimSection(lr=1e-2), sampling=SamplingSpec(0.8),
        micro_batch_size=4, compute_dtype="bfloat16", sharder=one_device_sharder(),
)  # fmt: skip
    state = learner.init_state(params)
    dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree)}  # noqa: E731
    before = jax.tree.map(np.asarray, base_of(state.policy.params))
    assert dtypes(before) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(adapters_of(state.policy.params)) == {jnp.dtype(jnp.float32)}
    trajs = random_trajectories(12, seed=7)
    state, _, _ = learner.rl_update(state, *_step(trajs, REWARDS, 1, None, 4))
    after = jax.tree.map(np.asarray, base_of(state.policy.params))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, after, before)))
    assert dtypes(adapters_of(state.policy.params)) == {jnp.dtype(jnp.float32)}
