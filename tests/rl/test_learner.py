"""The learner: sharded equals unsharded, micro-batches equal the whole batch, learner logprobs
equal the sampler's, and each update kind moves the parameters the way its loss says."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import AlgorithmSection, OptimSection
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, Sharder, init_params, make_mesh
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import TrainBatch, make_batch, padded_length
from jax_agent_rl.rl.learner import (
    Learner,
    SamplingSpec,
    StepSpec,
    accumulated_grads,
    critic_from_policy,
    make_optimizer,
    policy_objective,
    value_objective,
)
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams

CFG = ModelConfig.from_hf(TINY["qwen2"])
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def random_batch(B: int = 8, T: int = 24, seed: int = 0) -> TrainBatch:
    """Trajectories of random tokens with a model/tool mask pattern, plus random RL fields."""
    rng = np.random.default_rng(seed)
    trajs = []
    for b in range(B):
        traj = Trajectory(
            uid=str(b), group_id=str(b // 4), prompt_ids=list(rng.integers(0, 256, 5))
        )
        n = int(rng.integers(6, T - 6))
        for i in range(0, n, 4):
            model = (i // 4) % 2 == 0
            ids = list(rng.integers(0, 256, 4))
            traj.append(ids, model=model, logprobs=list(rng.normal(-2, 0.5, 4)) if model else None)
        trajs.append(traj)
    batch = make_batch(trajs, bucket=8)
    mask = np.asarray(batch.mask)
    shape = mask.shape
    batch.advantages = (rng.normal(size=(B, 1)) * mask).astype(np.float32)
    batch.old_logp = (rng.normal(-2, 0.3, shape) * mask).astype(np.float32)
    batch.ref_logp = (rng.normal(-2, 0.3, shape) * mask).astype(np.float32)
    batch.old_values = rng.normal(size=shape).astype(np.float32)
    batch.returns = rng.normal(size=shape).astype(np.float32)
    return batch


def test_batch_lengths_are_power_of_two_multiples_of_the_bucket() -> None:
    """Bounded compiles: sequences up to 1024 tokens pad to 5 lengths, never more than 2x."""
    ns = (1, 64, 65, 128, 129, 300, 513, 1024)
    assert [padded_length(n, 64) for n in ns] == [64, 64, 128, 128, 256, 512, 1024, 1024]
    assert len({padded_length(n, 64) for n in range(1, 1025)}) == 5


def assert_close_normwise(actual: object, desired: object, tol: float = 1e-5) -> None:
    """Every leaf within ``tol`` of the reference, relative to the leaf's norm.

    Sharding or micro-batching changes only the order of fp32 sums. Each gradient entry is a
    sum of many terms of either sign, so its rounding error scales with the terms (the
    tensor's scale), not with the entry, which may nearly cancel: a normwise bound is the
    one that rounding (~1e-7 per operation, ~1e2 operations deep) can be held to.
    """
    for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        a, d = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.linalg.norm(d)), 1e-12)
        assert np.linalg.norm(a - d) / scale <= tol, (np.linalg.norm(a - d) / scale, d.shape)


def micro(batch: TrainBatch, m: int) -> TrainBatch:
    B = batch.shape[0]
    return jax.tree.map(lambda x: jnp.asarray(x).reshape(m, B // m, *x.shape[1:]), batch)


FILTERED = SamplingSpec(0.8, 20, 0.9)


def spec(
    algo: AlgorithmSection, sharder: Sharder | None = None, sampling: SamplingSpec = FILTERED
) -> StepSpec:
    return StepSpec(CFG, "float32", sampling, algo, False, sharder)


ALGO = AlgorithmSection(kl_coef=0.1, entropy_coef=0.01, clip_high=0.28, tis_cap=2.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch(mode: str) -> None:
    """Accumulating 4 micro-batches (whole-batch denominators) = one pass over all rows."""
    params = init_params(jax.random.key(0), CFG)
    batch = random_batch()
    s = spec(dataclasses.replace(ALGO, loss_agg_mode=mode))
    f = jax.jit(lambda p, b: accumulated_grads(policy_objective, s, p, b))
    loss1, g1, _ = f(params, micro(batch, 1))
    loss4, g4, _ = f(params, micro(batch, 4))
    assert_close_normwise(loss4, loss1)
    assert_close_normwise(g4, g1)


@pytest.mark.parametrize(
    ("objective", "sampling"),
    [("policy", FILTERED), ("policy", SamplingSpec(0.8)), ("value", FILTERED)],
)
def test_sharded_step_equals_unsharded(objective: str, sampling: SamplingSpec) -> None:
    """8 fake CPU devices, data=2 x fsdp=2 x tensor=2: loss and every gradient equal the
    single-device computation within 1e-5, normwise (only the reduction order differs). The
    policy without top-k / top-p takes `head_logprobs` (its vocabulary sharded over tensor)."""
    params = init_params(jax.random.key(1), CFG)
    batch = micro(random_batch(seed=1), 2)
    sharder = Sharder(make_mesh(2, 2, 2))
    target, fn = (
        (params, policy_objective)
        if objective == "policy"
        else (critic_from_policy(params), value_objective)
    )
    if objective == "value":  # a non-zero head so the body gets gradients
        target = dataclasses.replace(target, head=jnp.linspace(-1, 1, CFG.hidden_size))
    plain = jax.jit(lambda p, b: accumulated_grads(fn, spec(ALGO, None, sampling), p, b))
    loss0, g0, m0 = plain(target, batch)

    learner = Learner(
        CFG,
        params,
        algo=ALGO,
        optim=OptimSection(),
        sampling=sampling,
        micro_batch_size=4,
        sharder=sharder,
        critic=target if objective == "value" else None,
    )
    placed = learner.state.params if objective == "policy" else learner.critic_state.params
    host = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), batch)
    sharded_batch = learner.device_batch(host)
    assert sharded_batch.tokens.sharding.spec[1] == ("data", "fsdp")
    sharded = jax.jit(lambda p, b: accumulated_grads(fn, spec(ALGO, sharder, sampling), p, b))
    loss1, g1, m1 = sharded(placed, sharded_batch)
    assert_close_normwise(loss1, loss0)
    assert_close_normwise(g1, g0)
    assert_close_normwise(m1, m0)
    # the parameters really are laid out over the mesh (not replicated)
    q = placed.layers.q if objective == "policy" else placed.body.layers.q
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (-1, 1.0)])
def test_learner_logprobs_equal_the_samplers(top_k: int, top_p: float) -> None:
    """Tokens sampled by the engine at temperature 0.8 with top-k 20 / top-p 0.9 (the learner
    takes the full-vocabulary path) or without filters (its chunked `head_logprobs`) get the
    same logprobs from the learner's recomputation (fp32: 1e-4, the backend's stated
    tolerance)."""
    params = init_params(jax.random.key(2), CFG)
    backend = EmbeddedBackend(Engine(CFG, max_concurrent_decodes=4, max_len=128), params)
    sampling = SamplingParams(max_tokens=24, temperature=0.8, top_k=top_k, top_p=top_p, seed=3)

    async def go() -> list:
        reqs = [
            GenerateRequest(f"r{i}", tuple(range(3 + i, 10 + 2 * i)), sampling) for i in range(4)
        ]
        out = await asyncio.gather(*(backend.generate(r) for r in reqs))
        await backend.close()
        return list(zip(reqs, out, strict=True))

    trajs = []
    for req, res in asyncio.run(go()):
        t = Trajectory(uid=req.request_id, group_id="g", prompt_ids=list(req.prompt_ids))
        t.append(list(res.token_ids), model=True, logprobs=list(res.logprobs))
        trajs.append(t)
    batch = make_batch(trajs, bucket=16)
    learner = Learner(
        CFG,
        params,
        algo=ALGO,
        optim=OptimSection(),
        sampling=SamplingSpec(0.8, top_k, top_p),
        micro_batch_size=2,
    )
    mask = np.asarray(batch.mask) > 0
    learned = learner.logprobs(batch)[mask]
    assert mask.sum() == 4 * 24
    np.testing.assert_allclose(learned, np.asarray(batch.rollout_logp)[mask], atol=1e-4)


def test_updates_reduce_their_losses() -> None:
    """A few SFT steps lower the cross-entropy; policy steps with positive advantages raise
    the logprob of the sampled tokens; critic steps move values towards returns."""
    params = init_params(jax.random.key(3), CFG)
    batch = random_batch(seed=3)
    learner = Learner(
        CFG,
        params,
        algo=AlgorithmSection(adv_estimator="gae", tis_cap=None),
        optim=OptimSection(lr=1e-2, critic_lr=1e-3),
        sampling=SamplingSpec(),
        micro_batch_size=4,
        critic=critic_from_policy(params),
    )
    first = learner.update_sft(batch)["sft_loss"]
    for _ in range(5):
        last = learner.update_sft(batch)["sft_loss"]
    assert last < first - 0.1

    mask = np.asarray(batch.mask)
    before = (learner.logprobs(batch) * mask).sum()
    batch.old_logp = learner.logprobs(batch) * mask
    batch.advantages = mask.copy()
    learner.update_policy(batch)
    assert (learner.logprobs(batch) * mask).sum() > before

    batch.returns = np.where(mask > 0, 0.5, 0.0).astype(np.float32)  # a reachable target
    v0 = np.abs(learner.values(batch) - np.asarray(batch.returns))[mask > 0].mean()
    batch.old_values = learner.values(batch)
    for _ in range(5):
        learner.update_critic(batch)
        batch.old_values = learner.values(batch)
    v1 = np.abs(learner.values(batch) - np.asarray(batch.returns))[mask > 0].mean()
    assert v1 < v0


@pytest.mark.parametrize(("warmup", "first_rate"), [(0, 1.0), (4, 0.25)])
def test_the_first_update_moves_the_weights(warmup: int, first_rate: float) -> None:
    """Adam's first step moves each weight by lr * sign(grad) (times the warmup's first rate):
    the first update of a run is not spent at a learning rate of zero."""
    lr = 1e-2
    tx = make_optimizer(lr, OptimSection(warmup_steps=warmup, grad_clip=1e9, b1=0.9, b2=0.999))
    w = {"x": jnp.array([1.0, -2.0, 3.0])}
    grads = {"x": jnp.array([0.5, -0.25, 2.0])}
    updates, _ = tx.update(grads, tx.init(w), w)
    step = np.asarray(updates["x"])
    np.testing.assert_allclose(step, -lr * first_rate * np.sign(grads["x"]), rtol=1e-4)


# ------------------------------------------------------------------ the on-device RL step


def _learner(
    algo: AlgorithmSection,
    params: object,
    sharder: Sharder | None = None,
    micro_batch_size: int = 2,
) -> Learner:
    return Learner(
        CFG,
        params,  # type: ignore[arg-type]
        algo=algo,
        optim=OptimSection(lr=1e-2, critic_lr=1e-3),
        sampling=SamplingSpec(0.8),  # no filter: random_batch's tokens were not sampled
        micro_batch_size=micro_batch_size,
        sharder=sharder,
        critic=critic_from_policy(params) if algo.adv_estimator == "gae" else None,  # type: ignore[arg-type]
    )


def _outcomes(B: int) -> tuple[np.ndarray, np.ndarray]:
    """Rewards of rows 0..B-3 in groups of 2 (the last two rows are padding: reward 0, a
    group of their own), as the trainer pads them."""
    rewards = np.array([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0], np.float32)[:B]
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3], np.int32)[:B]
    rewards[-2:], groups[-2:] = 0.0, 3
    return rewards, groups


def _host_step(learner: Learner, batch: TrainBatch, rewards: np.ndarray, groups: np.ndarray,
               reference: object) -> dict[str, float]:  # fmt: skip
    """The same update composed on the host from the learner's single-purpose steps: what the
    trainer did before the step moved onto the device."""
    a = learner.spec.algo
    mask = np.asarray(batch.mask)
    batch.old_logp = np.where(mask > 0, learner.logprobs(batch), 0.0)
    if reference is not None:
        ref = learner.logprobs(batch, params=reference)  # type: ignore[arg-type]
        batch.ref_logp = np.where(mask > 0, ref, 0.0)
    if a.adv_estimator == "grpo":
        adv = np.asarray(core.grpo_advantages(rewards, groups, len(rewards), a.norm_adv_by_std))
        batch.advantages = (adv[:, None] * mask).astype(np.float32)
    else:
        values = learner.values(batch) * mask
        token_rewards = np.asarray(core.last_token_rewards(rewards, mask))
        adv, returns = core.gae_advantages(token_rewards, values, mask, a.gamma, a.lam)
        batch.advantages = np.asarray(core.masked_whiten(adv, mask) * mask, np.float32)
        batch.returns, batch.old_values = np.asarray(returns), values.astype(np.float32)
    size, records = batch.shape[0] // a.mini_batches, []
    for _ in range(a.ppo_epochs):
        for i in range(a.mini_batches):
            mini = batch.rows(slice(i * size, (i + 1) * size))
            m = learner.update_policy(mini)
            if learner.critic_state is not None:
                m.update(learner.update_critic(mini))
            records.append(m)
    return {k: float(np.mean([r[k] for r in records])) for k in records[0]}


@pytest.mark.parametrize(
    "algo",
    [
        dataclasses.replace(ALGO, mini_batches=2, ppo_epochs=2),
        AlgorithmSection(adv_estimator="gae", mini_batches=2, tis_cap=None),
    ],
    ids=["grpo_kl_2x2", "gae_critic"],
)
def test_the_device_step_equals_the_step_composed_on_the_host(algo: AlgorithmSection) -> None:
    """`Learner.train_step` (prepare + scanned updates in one program) gives the parameters,
    critic and metrics of the same computation done step by step from the host, within fp32
    reduction-order rounding (normwise 1e-5, as sharding)."""
    params = init_params(jax.random.key(5), CFG)
    reference = jax.tree.map(lambda x: x * 0.9, params) if algo.kl_coef else None
    batch = random_batch(seed=5)
    rewards, groups = _outcomes(batch.shape[0])
    # each learner its own buffers: an update donates its state's
    device, host = (_learner(algo, jax.tree.map(jnp.copy, params)) for _ in range(2))
    got = device.train_step(batch, rewards, groups, reference)
    want = _host_step(host, batch, rewards, groups, reference)
    assert_close_normwise(device.state.params, host.state.params)
    if algo.adv_estimator == "gae":
        assert_close_normwise(device.critic_state.params, host.critic_state.params)  # type: ignore[union-attr]
    gap = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[batch.mask > 0]
    assert got.pop("logprob_gap/mean") == pytest.approx(gap.mean(), rel=1e-5)
    assert got.pop("logprob_gap/max") == pytest.approx(gap.max(), rel=1e-5)
    assert got.pop("batch/sampled_tokens") == np.asarray(batch.mask).sum()
    assert got.pop("rollout/logprobs_recomputed") == 0.0
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def test_without_rollout_logprobs_the_old_ones_stand_in() -> None:
    """A backend with no logprobs (JetStream): `train_step(rollout_logprobs=False)` updates as
    if the sampler's logprobs were the learner's old-policy ones (TIS weights 1), and reports
    no gap. Also: the gap per staleness, from each row's staleness."""
    algo = AlgorithmSection(tis_cap=2.0)
    params = init_params(jax.random.key(6), CFG)
    batch = random_batch(seed=6)
    rewards, groups = _outcomes(batch.shape[0])
    blind, told = (_learner(algo, jax.tree.map(jnp.copy, params)) for _ in range(2))
    old = told.logprobs(batch) * np.asarray(batch.mask)  # the policy before the update
    got = blind.train_step(batch, rewards, groups, rollout_logprobs=False)
    staleness = np.arange(batch.shape[0]) % 2
    want = told.train_step(
        dataclasses.replace(batch, rollout_logp=old), rewards, groups, row_staleness=staleness
    )
    assert_close_normwise(blind.state.params, told.state.params)
    assert got["rollout/logprobs_recomputed"] == 1.0 and "logprob_gap/mean" not in got
    assert want["rollout/logprobs_recomputed"] == 0.0
    assert want["logprob_gap/staleness_0"] == pytest.approx(0.0, abs=1e-5)
    assert want["logprob_gap/staleness_1"] == pytest.approx(0.0, abs=1e-5)


def test_the_step_crosses_to_the_device_once_and_compiles_once() -> None:
    """On a (data=2, fsdp=2, tensor=2) mesh, three RL steps of the same shapes run with implicit
    host <-> device transfers disallowed (the batch goes up and the metrics come back
    explicitly, nothing else crosses), and only the first compiles."""
    sharder = Sharder(make_mesh(2, 2, 2))
    params = init_params(jax.random.key(6), CFG)
    algo = dataclasses.replace(ALGO, mini_batches=2)
    learner = _learner(algo, params, sharder, micro_batch_size=4)  # one row per data x fsdp
    reference = jax.device_put(jax.tree.map(jnp.copy, params), learner._param_shardings)
    compiles: list[str] = []

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        per_step = []
        batch = random_batch(seed=10)
        for shift in range(3):
            rewards, groups = _outcomes(batch.shape[0])
            rewards = np.roll(rewards, shift)
            before = len(compiles)
            with jax.transfer_guard("disallow"):
                metrics = learner.train_step(batch, rewards, groups, reference)
            per_step.append(len(compiles) - before)
            assert np.isfinite(metrics["loss"]) and metrics["kl_loss"] >= 0
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert per_step[0] > 0 and per_step[1:] == [0, 0]
