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
from jax_agent_rl.models import DecoderPolicy, ModelConfig, Sharder, init_params, make_mesh
from jax_agent_rl.models.attention_kernels import forced_kernel
from jax_agent_rl.models.hf_local import TINY, TINY_MOE
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl.batch import (
    Sequences,
    TrainBatch,
    balanced_slots,
    make_batch,
    pack_rows,
    padded_length,
    per_turn_samples,
    step_batch,
)
from jax_agent_rl.rl.learner import Learner, critic_from_policy
from jax_agent_rl.rl.objectives import (
    Denominators,
    SamplingSpec,
    StepSpec,
    policy_objective,
    token_stats,
    value_objective,
)
from jax_agent_rl.rl.sequence import TrainSequence
from jax_agent_rl.rl.update import (
    LearnerState,
    RLBatch,
    accumulated_grads,
    make_optimizer,
    mini_batch_denominators,
    prepare,
)
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from jax_agent_rl.train.traces import UpdateTokens, trace_index
from tests.programs import programs_built

CFG = ModelConfig.from_hf(TINY["qwen2"])
MOE_CFG = ModelConfig.from_hf(TINY_MOE)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def random_trajectories(n: int = 8, longest: int = 24, seed: int = 0) -> list[TrainSequence]:
    """Trajectories of random tokens with a model/tool mask pattern and sampler logprobs, in
    groups of 4, as the learner reads them."""
    return [traj.train_sequence(0.0) for traj in random_episodes(n, longest, seed)]


def random_episodes(n: int = 8, longest: int = 24, seed: int = 0) -> list[Trajectory]:
    """The trajectories `random_trajectories` gives the learner, as the agent loop built them."""
    rng = np.random.default_rng(seed)
    trajs = []
    for b in range(n):
        traj = Trajectory(
            uid=str(b), group_id=str(b // 4), prompt_ids=list(rng.integers(0, 256, 5))
        )
        size = int(rng.integers(6, longest - 6))
        for i in range(0, size, 4):
            model = (i // 4) % 2 == 0
            ids = list(rng.integers(0, 256, 4))
            traj.append(ids, model=model, logprobs=list(rng.normal(-2, 0.5, 4)) if model else None)
        trajs.append(traj)
    return trajs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Given:
    """Random stand-ins for what a step derives (`Derived`), to test the objectives alone."""

    old_logp: jax.Array
    ref_logp: jax.Array
    advantages: jax.Array
    old_values: jax.Array
    returns: jax.Array


def random_batch(B: int = 8, T: int = 24, seed: int = 0) -> tuple[TrainBatch, Given]:
    """One trajectory per row, and random derived fields."""
    batch = make_batch(random_trajectories(B, T, seed), bucket=8)
    rng = np.random.default_rng(seed)
    mask = np.asarray(batch.mask)
    shape = mask.shape
    given = Given(
        old_logp=(rng.normal(-2, 0.3, shape) * mask).astype(np.float32),
        ref_logp=(rng.normal(-2, 0.3, shape) * mask).astype(np.float32),
        advantages=(rng.normal(size=(B, 1)) * mask).astype(np.float32),
        old_values=rng.normal(size=shape).astype(np.float32),
        returns=rng.normal(size=shape).astype(np.float32),
    )
    return batch, given


def grads_of(objective, s: StepSpec, params, batch: TrainBatch, given: Given, m: int):  # type: ignore[no-untyped-def]
    """`accumulated_grads` over ``m`` micro-batches of the rows, whole-batch denominators."""
    rows, dv = micro(batch, m), micro(given, m)
    mask = jnp.asarray(batch.mask)
    seqs = (mask.sum(-1) > 0).sum().astype(jnp.float32)
    d = Denominators(mask.sum(), seqs, 32.0, batch.shape[0])
    return accumulated_grads(objective, s, params, rows, dv, d, 0, m)  # type: ignore[arg-type]


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


def micro(tree, m: int):  # type: ignore[no-untyped-def]
    return jax.tree.map(lambda x: jnp.asarray(x).reshape(m, -1, *x.shape[1:]), tree)


FILTERED = SamplingSpec(0.8, 20, 0.9)


def spec(
    algo: AlgorithmSection,
    sharder: Sharder | None = None,
    sampling: SamplingSpec = FILTERED,
    cfg: ModelConfig = CFG,
) -> StepSpec:
    return StepSpec(
        DecoderPolicy(cfg), "float32", sampling, algo, False, sharder or one_device_sharder()
    )


ALGO = AlgorithmSection(kl_coef=0.1, entropy_coef=0.01, clip_high=0.28, tis_cap=2.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch(mode: str) -> None:
    """Accumulating 4 micro-batches (whole-batch denominators) = one pass over all rows."""
    params = init_params(jax.random.key(0), CFG, sharder=one_device_sharder())
    batch, given = random_batch()
    s = spec(dataclasses.replace(ALGO, loss_agg_mode=mode))
    loss1, g1, _ = jax.jit(lambda p: grads_of(policy_objective, s, p, batch, given, 1))(params)
    loss4, g4, _ = jax.jit(lambda p: grads_of(policy_objective, s, p, batch, given, 4))(params)
    assert_close_normwise(loss4, loss1)
    assert_close_normwise(g4, g1)


@pytest.mark.parametrize(
    ("objective", "sampling", "cfg"),
    [
        ("policy", FILTERED, CFG),
        ("policy", SamplingSpec(0.8), CFG),
        ("value", FILTERED, CFG),
        ("policy", FILTERED, MOE_CFG),
    ],
    ids=["policy", "policy-unfiltered", "value", "policy-moe"],
)
def test_sharded_step_equals_unsharded(
    objective: str, sampling: SamplingSpec, cfg: ModelConfig
) -> None:
    """8 fake CPU devices, data=2 x fsdp=2 x tensor=2: loss and every gradient equal the
    single-device computation within 1e-5, normwise (only the reduction order differs). The
    policy without top-k / top-p takes `head_logprobs` (its vocabulary sharded over tensor).
    Qwen3-MoE: its experts split over fsdp (4 whole experts a device), their width over
    tensor, and every token routed to the same experts on both sides."""
    params = init_params(jax.random.key(1), cfg, sharder=one_device_sharder())
    batch, given = random_batch(seed=1)
    sharder = Sharder(make_mesh(2, 2, 2))
    target, fn = (
        (params, policy_objective)
        if objective == "policy"
        else (critic_from_policy(params), value_objective)
    )
    if objective == "value":  # a non-zero head so the body gets gradients
        target = dataclasses.replace(target, head=jnp.linspace(-1, 1, cfg.hidden_size))
    plain = jax.jit(lambda p: grads_of(fn, spec(ALGO, None, sampling, cfg), p, batch, given, 2))
    loss0, g0, m0 = plain(target)

    learner = Learner(
        cfg, algo=ALGO, optim=OptimSection(), sampling=sampling, micro_batch_size=4, sharder=sharder
    )
    state = learner.init_state(params, critic=target if objective == "value" else None)
    trained = state.policy if objective == "policy" else state.critic
    placed = trained.params  # type: ignore[union-attr]
    sharded_batch = learner.device_batch(batch)
    assert sharded_batch.tokens.sharding.spec[1] == ("data", "fsdp")
    s = spec(ALGO, sharder, sampling, cfg)
    mask = jnp.asarray(batch.mask)
    d = Denominators(mask.sum(), (mask.sum(-1) > 0).sum().astype(jnp.float32), 32.0, 8)
    sharded = jax.jit(
        lambda p, b: accumulated_grads(fn, s, p, b, micro(given, 2), d, 0, 2)  # type: ignore[arg-type]
    )
    loss1, g1, m1 = sharded(placed, sharded_batch)
    assert_close_normwise(loss1, loss0)
    assert_close_normwise(g1, g0)
    assert_close_normwise(m1, m0)
    # the parameters really are laid out over the mesh (not replicated)
    q = placed.layers.q if objective == "policy" else placed.body.layers.q
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    if cfg.num_experts:  # [L, E, D, M]: whole experts over fsdp
        P = jax.sharding.PartitionSpec
        assert placed.layers.expert_gate.sharding.spec == P(None, "fsdp", None, "tensor")  # type: ignore[union-attr]


@pytest.mark.parametrize("kernels", ["xla", "triton"])
@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (-1, 1.0)])
def test_learner_logprobs_equal_the_samplers(top_k: int, top_p: float, kernels: str) -> None:
    """Tokens sampled by the engine at temperature 0.8 with top-k 20 / top-p 0.9 (the learner
    takes the full-vocabulary path) or without filters (its chunked `head_logprobs`) get the
    same logprobs from the learner's recomputation (fp32: 1e-4, the backend's stated
    tolerance); with ``kernels`` "triton", the engine decodes by the GPU paged-attention kernel
    and the learner attends by the GPU flash-attention kernel (both in Pallas's interpret
    mode here; skipped on a GPU, where fp32 through them takes TF32)."""
    if kernels == "triton" and jax.default_backend() == "gpu":
        pytest.skip("fp32 through the Triton kernels takes TF32 on a GPU")
    params = init_params(jax.random.key(2), CFG, sharder=one_device_sharder())
    decode_kernel = "ragged" if kernels == "xla" else "triton"
    engine = Engine(
        CFG,
        max_concurrent_decodes=4,
        max_len=128,
        sharder=one_device_sharder(),
        decode_kernel=decode_kernel,
    )
    backend = EmbeddedBackend(engine, params)
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
        trajs.append(t.train_sequence(0.0))
    # all four packed in one row: positions restart and attention stays within each
    batch = make_batch(trajs, bucket=16, layout=[[0, 1, 2, 3]])
    s = spec(ALGO, sampling=SamplingSpec(0.8, top_k, top_p))
    with forced_kernel(kernels):
        learned = jax.jit(lambda p, b: token_stats(s, p, b)[0])(params, batch)
    mask = np.asarray(batch.mask) > 0
    learned = np.asarray(learned)[mask]
    assert mask.sum() == 4 * 24 and batch.shape[0] == 1
    np.testing.assert_allclose(learned, np.asarray(batch.rollout_logp)[mask], atol=1e-4)


def test_updates_reduce_their_losses() -> None:
    """A few SFT steps lower the cross-entropy; RL steps raise the logprob of the rewarded
    trajectories' tokens over the others' in their group, and bring the critic's values
    towards the returns (its loss falls)."""
    params = init_params(jax.random.key(3), CFG, sharder=one_device_sharder())
    trajs = random_trajectories(8, seed=3)
    learner, state = _learner(
        AlgorithmSection(adv_estimator="gae", tis_cap=None), params, micro_batch_size=4
    )
    sft = make_batch(trajs, bucket=8)
    state, m = learner.sft_update(state, sft)
    first = m["sft_loss"]
    for _ in range(5):
        state, m = learner.sft_update(state, sft)
    assert m["sft_loss"] < first - 0.1

    rewards = np.tile([1.0, 0.0], 4)
    s = learner.spec
    logp = jax.jit(lambda p, b: token_stats(s, p, b)[0])
    mask = np.asarray(sft.mask)
    won = np.tile([True, False], 4)[:, None] & (mask > 0)
    lost = ~np.tile([True, False], 4)[:, None] & (mask > 0)

    def margin(state: LearnerState) -> float:
        lp = np.asarray(logp(state.policy.params, sft))
        return float(lp[won].mean() - lp[lost].mean())

    before, losses = margin(state), []
    for _ in range(4):
        step = _step(trajs, rewards, 1, 16, learner.micro_batch_size)
        state, m, _ = learner.rl_update(state, *step)
        losses.append(m["critic/vf_loss"])
    assert margin(state) > before
    assert losses[-1] < losses[0]


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
    reference: object = None,
    lr: float = 1e-2,
) -> tuple[Learner, LearnerState]:
    learner = Learner(
        CFG,
        algo=algo,
        optim=OptimSection(lr=lr, critic_lr=lr / 10),
        sampling=SamplingSpec(0.8),  # no filter: the random tokens were not sampled
        micro_batch_size=micro_batch_size,
        sharder=sharder or one_device_sharder(),
        norm_const=48.0,  # Dr.GRPO's constant: the generation budget, whatever the layout
    )
    state = learner.init_state(
        jax.tree.map(jnp.copy, params),  # each state its own: an update donates it
        critic=critic_from_policy(params) if algo.adv_estimator == "gae" else None,  # type: ignore[arg-type]
        reference=reference,  # type: ignore[arg-type]
    )
    return learner, state


def _step(
    trajs: list[TrainSequence],
    rewards: np.ndarray,
    mini_batches: int,
    row_tokens: int | None,
    rows_per_micro: int,
    weights: np.ndarray | None = None,
) -> tuple[TrainBatch, Sequences, int]:
    """`rl_update`'s arguments after the state, as the trainer lays them out: packed into rows of
    ``row_tokens`` (None: one trajectory per row, padded)."""
    return step_batch(
        trajs,
        rewards,
        [t.group_id for t in trajs],
        np.ones(len(trajs)) if weights is None else weights,
        mini_batches=mini_batches,
        row_tokens=row_tokens,
        bucket=8,
        rows_per_micro=rows_per_micro,
    )


REWARDS = np.array([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0, 0.3, 0.9, 0.1, 0.6], np.float32)
# each of the four aggregation modes once, over 2 mini-batches (whole-mini-batch denominators):
# token-mean in the first case, seq-mean-token-sum in the second, seq-mean-token-sum-norm in
# Dr.GRPO's and seq-mean-token-mean in GAE's
EQUIVALENT = {
    "grpo_kl_tis_entropy_2x2": dataclasses.replace(ALGO, mini_batches=2, ppo_epochs=2),
    "agg_seq-mean-token-sum": dataclasses.replace(
        ALGO, loss_agg_mode="seq-mean-token-sum", mini_batches=2
    ),
    "dr_grpo": AlgorithmSection(
        norm_adv_by_std=False,
        loss_agg_mode="seq-mean-token-sum-norm",
        tis_cap=None,
        mini_batches=2,
    ),
    "icepop": AlgorithmSection(
        tis_cap=None,
        rollout_mask="icepop",
        icepop_low=1 / 1.5,
        icepop_high=1.5,
        kl_coef=0.05,
        kl_kind="k3",
    ),
    "gae_value_loss": AlgorithmSection(
        adv_estimator="gae", mini_batches=2, tis_cap=None, loss_agg_mode="seq-mean-token-mean"
    ),
}


# every algorithm once: over whole episodes, but the two that read sequences differently
# (GRPO's groups and GAE) over per-turn samples (weights 1 / turns, several samples of one
# episode in a row); whole episodes are packed under the other three (each case compiles two
# update programs, ~30 s: the matrix covers, it does not multiply)
PER_TURN = ("grpo_kl_tis_entropy_2x2", "gae_value_loss")
CASES = [(name, name in PER_TURN) for name in EQUIVALENT]


@pytest.mark.parametrize(
    ("algo", "per_turn"),
    [(EQUIVALENT[name], per_turn) for name, per_turn in CASES],
    ids=[f"{name}-{'per_turn' if per_turn else 'episodes'}" for name, per_turn in CASES],
)
def test_the_packed_step_equals_the_padded_step(algo: AlgorithmSection, per_turn: bool) -> None:
    """The same trajectories, packed several to a row (rows of 64 tokens, 2 per micro-batch)
    and one per row padded (today's layout, 3 per micro-batch): the same parameters, critic
    and metrics after the step, within fp32 reduction-order rounding (normwise 1e-5 as
    sharding; metrics 1e-4 relative). Each case ends in per-sequence terms: GRPO / Dr.GRPO
    group statistics, the four aggregation modes with whole-mini-batch denominators, KL to the
    reference, TIS and MIS weights, GAE (which must not carry from one packed sequence into
    the one before it) and the clipped value loss, per-turn samples weighted 1 / turns."""
    params = init_params(jax.random.key(5), CFG, sharder=one_device_sharder())
    reference = jax.tree.map(lambda x: x * 0.9, params) if algo.kl_coef else None
    trajs = random_trajectories(12, longest=40, seed=5)
    rewards, weights = REWARDS, np.ones(12, np.float32)
    if per_turn:
        samples = [per_turn_samples(t) for t in trajs]
        rewards = np.repeat(REWARDS, [len(x) for x in samples])
        weights = np.concatenate([np.full(len(x), 1 / len(x)) for x in samples])
        trajs = [t for x in samples for t in x]
    K = algo.mini_batches
    packed, padded = (
        _step(trajs, rewards, K, row_tokens, per_micro, weights)
        for row_tokens, per_micro in ((64, 2), (None, 3))
    )
    assert packed[0].shape[1] == 64 and (packed[0].segment_ids.max(-1) > 1).any()
    assert (padded[0].segment_ids.max(-1) <= 1).all()
    # RL's usual rate: Adam moves each entry by about +-lr whatever its gradient's size, so
    # an entry whose gradient is ~0 may move either way: the later updates' metrics differ
    # by such moves, the first update's loss and gradients by rounding only
    (a, state_a), (b, state_b) = (
        _learner(algo, params, micro_batch_size=m, reference=reference, lr=1e-6) for m in (2, 3)
    )
    loss_a, grads_a = first_update(a, state_a, *packed)
    loss_b, grads_b = first_update(b, state_b, *padded)
    assert_close_normwise(loss_a, loss_b)
    assert_close_normwise(grads_a, grads_b)
    _, got, _ = a.rl_update(state_a, *packed)
    _, want, _ = b.rl_update(state_b, *padded)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def first_update(
    learner: Learner, state: LearnerState, batch: TrainBatch, sequences: Sequences, real: int
) -> tuple[object, object]:
    """Loss and gradients (policy, and critic with GAE) of the step's first mini-batch
    update of ``state``, as `rl_update` computes them."""
    spec, s = learner.spec, sequences
    rb = RLBatch(
        learner.device_batch(batch, local=True),
        *(jnp.asarray(x) for x in (s.rewards, s.groups, s.weights, s.minis)),
        jnp.int32(real),
        None if s.step_advantages is None else jnp.asarray(s.step_advantages),
    )

    def grads(state: LearnerState, rb: RLBatch) -> tuple[object, object]:
        dv, _ = prepare(spec, state, rb)
        d = mini_batch_denominators(spec, rb.rows, rb.minis, 0)
        out = [
            accumulated_grads(policy_objective, spec, state.policy.params, rb.rows, dv, d, 0, real)
        ]
        if state.critic is not None:
            out.append(
                accumulated_grads(
                    value_objective, spec, state.critic.params, rb.rows, dv, d, 0, real
                )
            )
        return [o[0] for o in out], [o[1] for o in out]

    return jax.jit(grads)(state, rb)


def test_packing_fills_rows_and_balances_micro_batches() -> None:
    """First-fit decreasing: 40 sequences of 100..1000 tokens in rows of 2048 leave less than
    one row's worth empty; a longer one gets a row of its own; the micro-batches' token counts
    differ by one row's at most (rows are dealt fullest first, in snake order)."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(100, 1000, 40)]
    layout = pack_rows(lengths, 2048)
    assert sorted(i for row in layout for i in row) == list(range(40))
    assert all(sum(lengths[i] for i in row) <= 2048 for row in layout)
    assert len(layout) * 2048 - sum(lengths) < 2048
    assert pack_rows([5000, 10, 20], 2048) == [[0], [2, 1]]
    slots = balanced_slots(layout, lengths, 4, 4)
    per_micro = [sum(lengths[i] for row in slots[m * 4 : m * 4 + 4] for i in row) for m in range(4)]
    assert max(per_micro) - min(per_micro) <= 2048


def test_without_rollout_logprobs_the_old_ones_stand_in() -> None:
    """A backend with no logprobs (JetStream): `rl_update(rollout_logprobs=False)` updates as
    if the sampler's logprobs were the learner's old-policy ones (TIS weights 1), and reports
    no gap. Also: the gap per staleness, from each sequence's staleness."""
    algo = AlgorithmSection(tis_cap=2.0)
    params = init_params(jax.random.key(6), CFG, sharder=one_device_sharder())
    trajs = random_trajectories(8, seed=6)
    (blind, blind_state), (told, told_state) = (_learner(algo, params) for _ in range(2))
    s = told.spec
    batch, sequences, real = _step(trajs, REWARDS[:8], 1, 64, 2)
    # the policy before the update, as the update computes it: with its entropy (a program
    # keeping the logprob alone rounds the vocabulary's sums in another order, and the two
    # updates' parameters came out 1.5e-4 apart normwise after Adam's first step)
    old = np.asarray(jax.jit(lambda p, b: token_stats(s, p, b))(told_state.policy.params, batch)[0])
    old = old * np.asarray(batch.mask)
    blind_state, got, _ = blind.rl_update(
        blind_state, batch, sequences, real, rollout_logprobs=False
    )
    staleness = np.arange(len(sequences.rewards)) % 2
    told_state, want, _ = told.rl_update(
        told_state,
        dataclasses.replace(batch, rollout_logp=old),
        sequences,
        real,
        staleness=staleness,
    )
    assert_close_normwise(blind_state.policy.params, told_state.policy.params)
    assert got["rollout/logprobs_recomputed"] == 1.0 and "logprob_gap/mean" not in got
    assert want["rollout/logprobs_recomputed"] == 0.0
    assert want["logprob_gap/staleness_0"] == pytest.approx(0.0, abs=1e-5)
    assert want["logprob_gap/staleness_1"] == pytest.approx(0.0, abs=1e-5)


def test_a_step_gives_back_the_update_s_own_values_where_a_trace_reads_them() -> None:
    """`rl_update` gives back, per token [M, b, T], the learner's logprob and entropy before
    the update (`token_stats` of the old params, fp32: the same computation in another
    program, 1e-5) and the GRPO advantage of its sequence (0 on tool tokens); a trace of two
    trajectories reads theirs out of them (`UpdateTokens.signals`), at their sampled tokens
    only, and the update is the same program whether a step is traced or not."""
    algo = AlgorithmSection(mini_batches=2)
    params = init_params(jax.random.key(7), CFG, sharder=one_device_sharder())
    episodes = random_episodes(8, seed=7)
    trajs = [episode.train_sequence(0.0) for episode in episodes]
    learner, state = _learner(algo, params)
    batch, sequences, real = _step(trajs, REWARDS[:8], 2, 64, 2)
    traced = [episodes[5], episodes[1]]
    rows = trajs
    index = trace_index(batch, rows, traced)
    s = learner.spec
    logp, entropy = (
        np.asarray(x).reshape(-1)
        for x in jax.jit(lambda p, b: token_stats(s, p, b))(state.policy.params, batch)
    )
    state, _, values = learner.rl_update(state, batch, sequences, real)
    names = ("learner_logprobs", "learner_entropy", "advantages")
    assert set(values) == set(names)
    B, T = batch.mask.shape  # the host's rows; on the devices [M, b, T] micro-batches
    assert all(values[name].shape[1:] == (learner.micro_batch_size, T) for name in names)
    assert all(values[name].size == B * T for name in names)
    signals = UpdateTokens(values, batch, rows).signals(traced)
    assert set(signals) == {t.uid for t in traced}
    mask = np.asarray(batch.mask).reshape(-1)
    rewards = REWARDS[:8].reshape(2, 4)  # random_trajectories: groups of 4
    for k, (t, b) in enumerate(zip(traced, (5, 1), strict=True)):
        n = len(t.response_ids)
        at = index[k, :n]
        assert (at >= 0).all() and (index[k, n:] == -1).all()  # whole episodes: all in rows
        sampled = mask[at] > 0
        assert sampled.any() and (~sampled).any()
        got_logp, got_ent, got_adv = (np.array(signals[t.uid][name]) for name in names)
        np.testing.assert_allclose(got_logp[sampled], logp[at][sampled], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got_ent[sampled], entropy[at][sampled], atol=1e-5, rtol=0)
        assert (got_ent[sampled] > 0).all() and (
            got_ent[sampled] <= np.log(CFG.vocab_size) + 1e-5
        ).all()
        group = rewards[b // 4]
        advantage = (group[b % 4] - group.mean()) / group.std(ddof=1)
        np.testing.assert_allclose(got_adv[sampled], advantage, rtol=1e-4)
        assert (got_logp[~sampled] == 0).all() and (got_ent[~sampled] == 0).all()
        assert (got_adv[~sampled] == 0).all()


def test_the_step_crosses_to_the_device_once_and_compiles_once_per_shape() -> None:
    """On a (data=2, fsdp=2, tensor=2) mesh, RL steps of different length mixes run with
    implicit host <-> device transfers disallowed (the batch goes up and the metrics come back
    explicitly, nothing else crosses). Steps whose rows fit the same power-of-two slots do not
    compile again, however many of the slots their sequences fill: 6 steps, 2 shapes."""
    # the trajectories' count sets the sequence slots too: 70..90 -> 128, 140..150 -> 256
    sharder = Sharder(make_mesh(2, 2, 2))
    params = init_params(jax.random.key(6), CFG, sharder=one_device_sharder())
    algo = dataclasses.replace(ALGO, mini_batches=2)
    learner, state = _learner(algo, params, sharder, micro_batch_size=4, reference=params)
    with programs_built() as compiles:
        per_step, reals = [], []
        # 70 to 150 trajectories of up to 40 tokens, in rows of 48: 6 to 8 real micro-batches
        # per mini-batch (8 slots), then 12 and 13 (16 slots)
        for seed, n in ((1, 90), (3, 80), (0, 70), (2, 75), (4, 150), (5, 140)):
            trajs = random_trajectories(n, longest=40, seed=seed)
            batch, sequences, real = _step(trajs, np.resize(REWARDS, n), 2, 48, 4)
            before = len(compiles)
            with jax.transfer_guard("disallow"):
                state, metrics, _ = learner.rl_update(state, batch, sequences, real)
            per_step.append(len(compiles) - before)
            reals.append(real)
            assert np.isfinite(metrics["loss"]) and metrics["kl_loss"] >= 0
    assert len(set(reals[:4])) > 1  # the first four differ in real micro-batches, not shapes
    assert per_step[0] > 0 and per_step[1:4] == [0, 0, 0]
    assert per_step[4] > 0 and per_step[5] == 0  # a larger step: one more shape, once
