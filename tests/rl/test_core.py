"""RL math in `jax_agent_rl.rl.core`, each function alone against hand-computed numbers.

Expected values are literals worked out by hand (the arithmetic is in the comments) or come
from explicit Python / numpy loops written here, never from the function under test.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.rl import core

# fp32 carries ~6e-8 relative precision and every case here is O(1) numbers through a handful
# of roundings, so 1e-6 is tight enough to catch a wrong formula and loose enough for fp32.
TOL = dict(rtol=1e-6, atol=1e-6)

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# a 2x4 batch used by several tests: row sums over the mask are 6 and 11
LOSS_BT = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
MASK_BT = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], np.float32)


def close(got: jax.Array | np.ndarray | float, want: np.ndarray | float) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


# --- masked_mean / masked_whiten -------------------------------------------------------------


def test_masked_mean_all_and_per_row() -> None:
    close(core.masked_mean(LOSS_BT, MASK_BT), (1 + 2 + 3 + 5 + 6) / 5)
    close(core.masked_mean(LOSS_BT, MASK_BT, axis=-1), [2.0, 5.5])


def test_masked_mean_ignores_nan_in_padding_and_empty_rows_give_zero() -> None:
    x = np.array([[1.0, np.nan], [np.inf, -np.inf]], np.float32)
    m = np.array([[1.0, 0.0], [0.0, 0.0]], np.float32)
    close(core.masked_mean(x, m), 1.0)
    close(core.masked_mean(x, m, axis=-1), [1.0, 0.0])


def test_masked_whiten_against_numpy() -> None:
    x = np.array([[1.0, 2.0, 3.0, 100.0], [4.0, 6.0, -7.0, -100.0]], np.float32)
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    vals = np.array([1.0, 2.0, 3.0, 4.0, 6.0])  # the masked entries
    mu = vals.mean()  # 3.2
    var = ((vals - mu) ** 2).sum() / (len(vals) - 1)  # unbiased: 14.8 / 4 = 3.7
    want = np.where(m > 0, (x - mu) / np.sqrt(var + 1e-8), 0.0)
    close(core.masked_whiten(x, m), want)
    want_unshifted = np.where(m > 0, (x - mu) / np.sqrt(var + 1e-8) + mu, 0.0)
    close(core.masked_whiten(x, m, shift_mean=False), want_unshifted)


def test_masked_whiten_single_entry_is_zero_not_nan() -> None:
    got = core.masked_whiten(np.array([5.0, 7.0]), np.array([1.0, 0.0]))
    close(got, [0.0, 0.0])


# --- grpo_advantages -------------------------------------------------------------------------


def _grpo_reference(rewards: list[float], groups: list[int], norm: bool, eps: float) -> np.ndarray:
    out = np.zeros(len(rewards))
    for i, g in enumerate(groups):
        members = np.array([r for r, h in zip(rewards, groups, strict=True) if h == g])
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = members.mean(), members.std(ddof=1)
        out[i] = (rewards[i] - mean) / (std + eps) if norm else rewards[i] - mean
    return out


def test_grpo_advantages_hand_case() -> None:
    # group 0: [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3); advantages +-0.5 * sqrt(3)
    rewards = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    got = core.grpo_advantages(rewards, np.zeros(4, np.int32), num_groups=1, eps=0.0)
    h = 0.5 * math.sqrt(3.0)
    close(got, [h, -h, -h, h])


def test_grpo_advantages_interleaved_groups_and_singleton() -> None:
    rewards = [1.0, 2.0, 0.5, 4.0, 3.0, 7.0, -2.0]
    groups = [2, 0, 2, 0, 0, 1, 2]  # group 1 has a single member: mean 0, std 1
    fn = jax.jit(core.grpo_advantages, static_argnames=("num_groups", "norm_by_std"))
    got = fn(np.array(rewards, np.float32), np.array(groups, np.int32), num_groups=3)
    close(got, _grpo_reference(rewards, groups, norm=True, eps=1e-6))
    close(got[5], 7.0 / (1.0 + 1e-6))


def test_dr_grpo_is_mean_centred_rewards() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 3.0, 1.0, 2.0], np.float32)
    groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
    got = core.grpo_advantages(rewards, groups, num_groups=2, norm_by_std=False)
    close(got, [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0])  # group means 1/3 and 2


def test_grpo_equal_rewards_give_zero() -> None:
    got = core.grpo_advantages(np.ones(3, np.float32), np.zeros(3, np.int32), num_groups=1)
    close(got, [0.0, 0.0, 0.0])


def test_grpo_with_per_turn_weights_gives_each_row_its_episodes_advantage() -> None:
    """Episodes of 3, 1 and 2 turns in one group and a single 2-turn episode in another, as
    per-turn rows weighted 1/turns: each row gets exactly the advantage its episode gets as
    one row (groups of episodes, each counted once)."""
    episodes = [1.0, 0.0, 2.0, 5.0]
    groups = [0, 0, 0, 1]
    turns = [3, 1, 2, 2]
    rows = [i for i, k in enumerate(turns) for _ in range(k)]
    got = core.grpo_advantages(
        np.array([episodes[i] for i in rows], np.float32),
        np.array([groups[i] for i in rows], np.int32),
        num_groups=2,
        weights_n=np.array([1.0 / turns[i] for i in rows], np.float32),
    )
    want = _grpo_reference(episodes, groups, norm=True, eps=1e-6)
    close(got, [want[i] for i in rows])
    close(got[-2:], [5.0 / (1.0 + 1e-6)] * 2)  # a group of one episode, over two rows


# --- gae_advantages --------------------------------------------------------------------------


def _gae_reference(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Plain GAE over a row with no masked tokens."""
    adv = [0.0] * len(rewards)
    next_v, next_a = 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        adv[t] = delta + gamma * lam * next_a
        next_v, next_a = values[t], adv[t]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_gae_monte_carlo_case() -> None:
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, R_t = 1 everywhere
    adv, ret = core.gae_advantages(
        np.array([[0.0, 0.0, 1.0]]), np.array([[0.5, 0.6, 0.7]]), np.ones((1, 3)), 1.0, 1.0
    )
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_td0_case() -> None:
    # lam = 0: A_t = r_t + gamma V_{t+1} - V_t; gamma = 0.5
    # t0: 0 + 0.5*0.6 - 0.5 = -0.2; t1: 0 + 0.5*0.7 - 0.6 = -0.25; t2: 1 + 0 - 0.7 = 0.3
    adv, ret = core.gae_advantages(
        np.array([[0.0, 0.0, 1.0]]), np.array([[0.5, 0.6, 0.7]]), np.ones((1, 3)), 0.5, 0.0
    )
    close(adv, [[-0.2, -0.25, 0.3]])
    close(ret, [[0.3, 0.35, 1.0]])


def test_gae_matches_loop_with_padding() -> None:
    rewards = [[0.1, -0.2, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0, 0.0]]
    values = [[0.3, 0.1, -0.4, 0.2, 9.0], [1.0, -1.0, 9.0, 9.0, 9.0]]
    lengths = [4, 2]  # right padding after these (the pad values 9.0 must not matter)
    mask = [[1.0 if t < n else 0.0 for t in range(5)] for n in lengths]
    adv, ret = core.gae_advantages(np.array(rewards), np.array(values), np.array(mask), 0.9, 0.8)
    for b, n in enumerate(lengths):
        a_ref, r_ref = _gae_reference(rewards[b][:n], values[b][:n], 0.9, 0.8)
        close(adv[b], a_ref + [0.0] * (5 - n))
        close(ret[b], r_ref + [0.0] * (5 - n))


def test_gae_tool_span_equals_span_removed() -> None:
    # model tokens at 0, 1, 4, 5; a tool response at 2, 3; padding at 6
    mask = np.array([[1, 1, 0, 0, 1, 1, 0]], np.float32)
    rewards = np.array([[0.0, 0.1, 5.0, 5.0, 0.0, 1.0, 0.0]], np.float32)  # tool rewards ignored
    values = np.array([[0.2, 0.4, 7.0, -7.0, 0.3, 0.6, 3.0]], np.float32)
    adv, ret = core.gae_advantages(rewards, values, mask, 0.95, 0.9)
    keep = mask[0] > 0
    short_adv, short_ret = core.gae_advantages(
        rewards[:, keep], values[:, keep], np.ones((1, 4)), 0.95, 0.9
    )
    close(adv[0, keep], short_adv[0])
    close(ret[0, keep], short_ret[0])
    close(adv[0, ~keep], 0.0)
    close(ret[0, ~keep], 0.0)
    a_ref, _ = _gae_reference([0.0, 0.1, 0.0, 1.0], [0.2, 0.4, 0.3, 0.6], 0.95, 0.9)
    close(short_adv[0], a_ref)


def test_gae_is_jittable() -> None:
    fn = jax.jit(core.gae_advantages)
    adv, _ = fn(jnp.array([[0.0, 1.0]]), jnp.array([[0.0, 0.0]]), jnp.ones((1, 2)), 1.0, 1.0)
    close(adv, [[1.0, 1.0]])


# --- kl_penalty ------------------------------------------------------------------------------

LOGP = np.array([[-1.0, -2.0]], np.float32)
REF = np.array([[-1.5, -1.0]], np.float32)  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        ("k1", [[0.5, -1.0]]),
        ("abs", [[0.5, 1.0]]),
        ("k2", [[0.125, 0.5]]),
        # exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.10653066, exp(1) - 2 = 0.71828183
        ("k3", [[math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]]),
    ],
)
def test_kl_penalty_kinds(kind: core.KLKind, want: list[list[float]]) -> None:
    close(core.kl_penalty(LOGP, REF, kind), want)
    close(jax.jit(core.kl_penalty, static_argnames="kind")(LOGP, REF, kind=kind), want)


def test_kl_k3_is_clamped() -> None:
    # ref - logp = 30 -> clamped to 20 -> exp(20) - 21 ~ 4.9e8 -> clamped to 10; the other side:
    # ref - logp = -30 -> clamped to -20 -> exp(-20) + 19 ~ 19 -> clamped to 10
    got = core.kl_penalty(np.array([-30.0, 0.0]), np.array([0.0, -30.0]), "k3")
    close(got, [10.0, 10.0])


def test_kl_penalty_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k3"):
        core.kl_penalty(LOGP, REF, "k4")  # type: ignore[arg-type]


# --- aggregate_loss --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token-mean", 17 / 5),  # (6 + 11) / 5 tokens
        ("seq-mean-token-sum", 17 / 2),  # (6 + 11) / 2 sequences
        ("seq-mean-token-mean", (2.0 + 5.5) / 2),  # row means 6/3 and 11/2
        ("seq-mean-token-sum-norm", 17 / (4 * 2)),  # norm_const = T = 4
    ],
)
def test_aggregate_loss_modes(mode: core.AggMode, want: float) -> None:
    close(core.aggregate_loss(LOSS_BT, MASK_BT, mode), want)
    # a third, fully masked row is not a sequence and changes nothing
    loss3 = np.concatenate([LOSS_BT, np.full((1, 4), 50.0, np.float32)])
    mask3 = np.concatenate([MASK_BT, np.zeros((1, 4), np.float32)])
    close(core.aggregate_loss(loss3, mask3, mode), want)


def test_aggregate_loss_norm_const_and_explicit_counts() -> None:
    close(core.aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", norm_const=10.0), 0.85)
    close(core.aggregate_loss(LOSS_BT, MASK_BT, "token-mean", num_tokens=10), 1.7)
    close(core.aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum", num_seqs=4), 4.25)
    close(core.aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-mean", num_seqs=3), 2.5)


def test_aggregate_loss_empty_mask_is_zero() -> None:
    for mode in AGG_MODES:
        close(core.aggregate_loss(LOSS_BT, np.zeros_like(MASK_BT), mode), 0.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_micro_batches_sum_to_full_batch(mode: core.AggMode) -> None:
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(6, 5)).astype(np.float32)
    mask = np.array(
        [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0],
         [1, 1, 0, 0, 0]],
        np.float32,
    )  # fmt: skip
    num_tokens = mask.sum()  # 14
    num_seqs = 5  # row 2 is fully masked
    agg = functools.partial(core.aggregate_loss, mode=mode, norm_const=5.0)
    full = agg(loss, mask)
    parts = [
        agg(loss[s], mask[s], num_tokens=num_tokens, num_seqs=num_seqs)
        for s in (slice(0, 2), slice(2, 5), slice(5, 6))
    ]
    close(sum(float(p) for p in parts), float(full))


def test_aggregate_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        core.aggregate_loss(LOSS_BT, MASK_BT, "sum")  # type: ignore[arg-type]


# --- policy_loss -----------------------------------------------------------------------------


def _ppo_token_reference(
    ratio: float, adv: float, clip_low: float, clip_high: float, clip_c: float | None
) -> float:
    """One token's loss, written branch by branch."""
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(unclipped, clipped)
    if clip_c is not None and adv < 0:
        loss = min(loss, -adv * clip_c)
    return loss


def _policy(ratios: list[float], advs: list[float], mask: list[float] | None = None, **kw):
    n = len(ratios)
    old = np.full((1, n), -1.0, np.float32)
    logp = (old + np.log(np.array([ratios], np.float32))).astype(np.float32)
    m = np.ones((1, n), np.float32) if mask is None else np.array([mask], np.float32)
    return core.policy_loss(logp, old, np.array([advs], np.float32), m, **kw)


def test_policy_loss_hand_case() -> None:
    # per token (eps 0.2, c 3):
    #   A=+1 r=1.5  -> max(-1.5, -1.2) = -1.2        (clipped)
    #   A=-1 r=0.5  -> max(0.5, 0.8)   =  0.8        (clipped)
    #   A=-1 r=4.0  -> max(4.0, 1.2) = 4.0, min(4.0, 3) = 3.0  (dual clip)
    #   A=+1 r=1.0  -> -1.0
    loss, metrics = _policy([1.5, 0.5, 4.0, 1.0], [1.0, -1.0, -1.0, 1.0])
    close(loss, (-1.2 + 0.8 + 3.0 - 1.0) / 4)
    close(metrics["clipfrac"], 2 / 4)  # tokens 0 and 1: L2 > L1 (token 2: 1.2 < 4.0)
    close(metrics["clipfrac_lower"], 1 / 4)
    close(metrics["approx_kl"], -(math.log(1.5) + math.log(0.5) + math.log(4.0)) / 4)


def test_policy_loss_matches_token_loop_for_every_agg_mode() -> None:
    ratios = [[0.3, 1.0, 1.1, 2.5, 7.0], [0.9, 1.3, 0.7, 1.0, 1.0]]
    advs = [[1.0, -0.5, 2.0, -1.5, -1.0], [-2.0, 0.7, 0.3, 1.0, 1.0]]
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float32)
    kw = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
    per_token = np.array(
        [[_ppo_token_reference(r, a, 0.2, 0.28, 3.0) for r, a in zip(rr, aa, strict=True)]
         for rr, aa in zip(ratios, advs, strict=True)]
    )  # fmt: skip
    sums = (per_token * mask).sum(-1)
    want = {
        "token-mean": sums.sum() / 8,
        "seq-mean-token-sum": sums.sum() / 2,
        "seq-mean-token-mean": (sums[0] / 5 + sums[1] / 3) / 2,
        "seq-mean-token-sum-norm": sums.sum() / (5 * 2),
    }
    old = np.zeros((2, 5), np.float32)
    logp = np.log(np.array(ratios, np.float32))
    fn = jax.jit(core.policy_loss, static_argnames=("clip_low", "clip_high", "clip_c", "agg_mode"))
    for mode, value in want.items():
        loss, _ = fn(logp, old, np.array(advs, np.float32), mask, agg_mode=mode, **kw)
        close(loss, value)


def test_dual_clip_only_touches_negative_advantages() -> None:
    ratios = [0.01, 0.5, 1.0, 2.0, 5.0, 50.0]
    for adv in (1.0, -1.0):
        with_c, m_c = _policy(ratios, [adv] * 6, clip_c=3.0, agg_mode="seq-mean-token-sum")
        without, m_none = _policy(ratios, [adv] * 6, clip_c=None, agg_mode="seq-mean-token-sum")
        if adv > 0:  # every token: max(-r, -clip(r)); dual clip never applies
            close(with_c, without)
            close(m_c["clipfrac_lower"], 0.0)
        else:  # r = 5 and 50 are capped at c = 3: (5 - 3) + (50 - 3) less loss
            close(without, 0.8 + 0.8 + 1.0 + 2.0 + 5.0 + 50.0)
            close(with_c, 0.8 + 0.8 + 1.0 + 2.0 + 3.0 + 3.0)
            close(m_c["clipfrac_lower"], 2 / 6)
        close(m_none["clipfrac_lower"], 0.0)


def test_clip_higher_is_asymmetric() -> None:
    # A=+1, r=1.25: clipped at 1.2 when clip_high = 0.2, free when clip_high = 0.28
    sym, m_sym = _policy([1.25], [1.0], clip_low=0.2, clip_high=0.2)
    hi, m_hi = _policy([1.25], [1.0], clip_low=0.2, clip_high=0.28)
    close(sym, -1.2)
    close(hi, -1.25)
    close(m_sym["clipfrac"], 1.0)
    close(m_hi["clipfrac"], 0.0)
    # A=-1, r=0.75: clip_high plays no part; clip_low 0.2 clips (max(0.75, 0.8)), 0.3 does not
    close(_policy([0.75], [-1.0], clip_low=0.2, clip_high=0.28)[0], 0.8)
    close(_policy([0.75], [-1.0], clip_low=0.3, clip_high=0.28)[0], 0.75)


def test_policy_loss_log_ratio_is_clamped() -> None:
    # logp - old = 30 -> clamped to 20; A=-1 with no dual clip: loss = exp(20)
    loss, metrics = core.policy_loss(
        np.array([[30.0]]), np.array([[0.0]]), np.array([[-1.0]]), np.ones((1, 1)), clip_c=None
    )
    np.testing.assert_allclose(float(loss), math.exp(20.0), rtol=1e-6)
    close(metrics["approx_kl"], -20.0)


def test_policy_loss_is_weights_scale_tokens_and_carry_no_gradient() -> None:
    # tokens unclipped (r = 1): per-token loss -A; weights [2, 0.5]
    old = np.zeros((1, 2), np.float32)
    adv = np.array([[1.0, -2.0]], np.float32)
    w = np.array([[2.0, 0.5]], np.float32)

    def loss_of(weights: jax.Array) -> jax.Array:
        return core.policy_loss(old, old, adv, np.ones((1, 2)), is_weights_bt=weights)[0]

    close(loss_of(jnp.asarray(w)), (-1.0 * 2.0 + 2.0 * 0.5) / 2)
    close(jax.grad(loss_of)(jnp.asarray(w)), [[0.0, 0.0]])


def test_policy_loss_gradient_is_zero_off_mask() -> None:
    old = np.array([[-1.0, -2.0, -0.5, -1.0]], np.float32)
    logp = np.array([[-1.1, -np.inf, -0.4, np.nan]], np.float32)  # garbage where mask is 0
    adv = np.array([[1.0, 1.0, -1.0, 1.0]], np.float32)
    mask = np.array([[1.0, 0.0, 1.0, 0.0]], np.float32)
    for mode in AGG_MODES:
        grad = jax.grad(lambda lp, m=mode: core.policy_loss(lp, old, adv, mask, agg_mode=m)[0])(
            jnp.asarray(logp)
        )
        grad = np.asarray(grad)
        assert np.all(np.isfinite(grad)), (mode, grad)
        close(grad[0, [1, 3]], [0.0, 0.0])
        assert np.all(grad[0, [0, 2]] != 0.0), (mode, grad)


def test_policy_loss_rejects_bad_clip_c() -> None:
    with pytest.raises(ValueError, match="clip_c"):
        _policy([1.0], [1.0], clip_c=1.0)


# --- value_loss ------------------------------------------------------------------------------


def test_value_loss_hand_case() -> None:
    # c = 0.5
    #   v=1, old=0, R=2: (1-2)^2 = 1, clip(1, -0.5, 0.5) = 0.5 -> (0.5-2)^2 = 2.25 -> 2.25 (clipped)
    #   v=1, old=0, R=0: 1 vs (0.5-0)^2 = 0.25 -> 1
    #   v=2, old=2, R=3: 1 vs 1 -> 1 (not strictly larger: not clipped)
    #   fourth token masked
    values = np.array([[1.0, 1.0, 2.0, 100.0]], np.float32)
    old = np.array([[0.0, 0.0, 2.0, 0.0]], np.float32)
    returns = np.array([[2.0, 0.0, 3.0, 0.0]], np.float32)
    mask = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
    loss, metrics = core.value_loss(values, old, returns, mask, clip_range=0.5)
    close(loss, 0.5 * (2.25 + 1.0 + 1.0) / 3)
    close(metrics["vf_clipfrac"], 1 / 3)
    loss_sum, _ = core.value_loss(
        values, old, returns, mask, clip_range=0.5, agg_mode="seq-mean-token-sum"
    )
    close(loss_sum, 0.5 * (2.25 + 1.0 + 1.0))


def test_value_loss_gradient() -> None:
    # one unclipped token: d/dv 0.5 (v - R)^2 = v - R = 0.3 - 1.0
    grad = jax.grad(
        lambda v: core.value_loss(v, jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1)))[0]
    )(jnp.full((1, 1), 0.3))
    close(grad, [[-0.7]])


# --- truncated_is_weights --------------------------------------------------------------------


def test_truncated_is_weights() -> None:
    rollout = np.array([[-1.0, -1.0, -1.0, -1.0]], np.float32)
    learner = rollout + np.log(np.array([[1.0, 3.0, 0.5, 1.5]], np.float32))
    mask = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
    close(core.truncated_is_weights(learner, rollout, mask, cap=2.0), [[1.0, 2.0, 0.5, 0.0]])
    grad = jax.grad(lambda x: core.truncated_is_weights(x, rollout, mask).sum())(learner)
    close(grad, np.zeros((1, 4)))


def test_truncated_is_weights_ignore_garbage_off_mask() -> None:
    got = core.truncated_is_weights(
        np.array([[0.0, np.nan, 50.0]]), np.array([[0.0, 0.0, -np.inf]]), np.array([[1, 0, 0]])
    )
    close(got, [[1.0, 0.0, 0.0]])


def test_icepop_weights_drop_tokens_outside_the_band() -> None:
    """Weights within [low, high] are kept as they are (not truncated); outside on either
    side, and off the mask, 0; constants; garbage off the mask ignored."""
    rollout = np.array([[-1.0, -1.0, -1.0, -1.0, -1.0, 0.0]], np.float32)
    ratio = np.array([[1.0, 3.0, 0.6, 1.5, 0.4, 1.0]], np.float32)
    learner = rollout + np.log(ratio)
    learner[0, 5] = np.nan
    mask = np.array([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]], np.float32)
    close(core.icepop_weights(learner, rollout, mask, 0.5, 2.0), [[1.0, 0, 0.6, 1.5, 0, 0]])
    # the published band [0.5, 5] keeps the 3.0
    close(core.icepop_weights(learner, rollout, mask), [[1.0, 3.0, 0.6, 1.5, 0, 0]])
    grad = jax.grad(lambda x: core.icepop_weights(x, rollout, mask).sum())(learner)
    close(grad, np.zeros((1, 6)))


def test_binary_kl_hand_case() -> None:
    # D_B(0.5 || 0.25) = 0.5 ln 2 + 0.5 ln(0.5 / 0.75); D_B(p || p) = 0
    close(core.binary_kl(0.5, 0.25), 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    close(core.binary_kl(np.float32(0.3), np.float32(0.3)), 0.0)


# --- entropy_from_logprobs -------------------------------------------------------------------


def test_entropy_from_logprobs() -> None:
    p = np.array([0.5, 0.25, 0.25])
    want = -(p * np.log(p)).sum()  # 1.5 ln 2
    logp = np.array(
        [[np.log(np.full(4, 0.25)), [*np.log(p), -np.inf]], [[0.0, -np.inf, -np.inf, -np.inf]] * 2],
        np.float32,
    )  # [B=2, T=2, V=4]
    close(core.entropy_from_logprobs(logp), [[math.log(4.0), want], [0.0, 0.0]])


def test_entropy_gradient_is_finite_with_neg_inf() -> None:
    logp = jnp.array([math.log(0.5), math.log(0.5), -jnp.inf])
    grad = np.asarray(jax.grad(core.entropy_from_logprobs)(logp))
    assert np.all(np.isfinite(grad))
    # dH/dlogp_v = -p_v (log p_v + 1): -0.5 (ln 0.5 + 1) for the two live entries, 0 for -inf
    close(grad, [-0.5 * (math.log(0.5) + 1.0)] * 2 + [0.0])


# --- overlong_penalty ------------------------------------------------------------------------


def test_overlong_penalty() -> None:
    # max 10, buffer 4: free up to 6, then -1/4 per token, -factor from 10 on
    lengths = np.array([0, 5, 6, 7, 8, 10, 12])
    close(core.overlong_penalty(lengths, 10, 4), [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(core.overlong_penalty(lengths, 10, 4, 2.0), [0.0, 0.0, 0.0, -0.5, -1.0, -2.0, -2.0])


def test_overlong_penalty_rejects_bad_buffer() -> None:
    with pytest.raises(ValueError, match="buffer_len"):
        core.overlong_penalty(np.array([1]), 10, 0)
    with pytest.raises(ValueError, match="buffer_len"):
        core.overlong_penalty(np.array([1]), 10, 11)


# --- groups_with_signal ----------------------------------------------------------------------


def test_groups_with_signal() -> None:
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0, 0.0, 2.0, 0.0])
    groups = np.array([7, 7, 3, 3, 9, 9, 4, 1, 1, 1])  # group 4 is a singleton
    want = [True, True, False, False, False, False, False, True, True, True]
    got = core.groups_with_signal(rewards, groups)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)


def test_groups_with_signal_interleaved_ids() -> None:
    got = core.groups_with_signal(np.array([0.0, 5.0, 1.0, 5.0]), np.array([0, 1, 0, 1]))
    np.testing.assert_array_equal(got, [True, False, True, False])


def test_last_token_rewards_hand_case() -> None:
    """Each row's reward lands on its last sampled token (a tool span after it, or padding,
    does not move it); a row with no sampled token gets none."""
    mask = np.array(
        [
            [1, 1, 0, 0, 1, 0],  # model, tool, model: the last model token is at 4
            [0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0],  # no sampled token (all padding)
        ],
        np.float32,
    )
    got = np.asarray(core.last_token_rewards(np.array([2.0, -1.0, 5.0]), mask))
    want = np.zeros((3, 6), np.float32)
    want[0, 4], want[1, 3] = 2.0, -1.0
    np.testing.assert_array_equal(got, want)


def test_packed_rows_give_each_sequence_its_own_numbers() -> None:
    """Three sequences packed in one row (segments 1, 2, 3, then padding) against the same
    three alone in padded rows: every aggregation mode, GAE (nothing carries from a segment to
    the one before it) and the last sampled token's reward give the same numbers."""
    rng = np.random.default_rng(0)
    lengths = (5, 7, 4)
    T = 20
    mask_rows = np.zeros((3, 8), np.float32)
    mask_rows[0, 1:5], mask_rows[1, 2:4], mask_rows[1, 5:7], mask_rows[2, 0:3] = 1, 1, 1, 1
    loss_rows = rng.normal(size=(3, 8)).astype(np.float32)
    values_rows = rng.normal(size=(3, 8)).astype(np.float32)
    packed = {k: np.zeros((1, T), np.float32) for k in ("mask", "loss", "values")}
    seq, seg = np.zeros((1, T), np.int32), np.zeros((1, T), np.int32)
    at = 0
    for i, n in enumerate(lengths):
        packed["mask"][0, at : at + n] = mask_rows[i, :n]
        packed["loss"][0, at : at + n] = loss_rows[i, :n]
        packed["values"][0, at : at + n] = values_rows[i, :n]
        seq[0, at : at + n], seg[0, at : at + n] = i, i + 1
        at += n
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        alone = core.aggregate_loss(loss_rows, mask_rows, mode)  # type: ignore[arg-type]
        together = core.aggregate_loss(
            packed["loss"],
            packed["mask"],
            mode,
            seq_bt=seq,
            num_sequences=3,  # type: ignore[arg-type]
        )
        np.testing.assert_allclose(together, alone, rtol=1e-6)
    np.testing.assert_allclose(
        core.aggregate_loss(
            packed["loss"], packed["mask"], "seq-mean-token-sum-norm", norm_const=8.0,
            seq_bt=seq, num_sequences=3,
        ),
        core.aggregate_loss(loss_rows, mask_rows, "seq-mean-token-sum-norm", norm_const=8.0),
        rtol=1e-6,
    )  # fmt: skip
    rewards = np.array([1.0, -0.5, 2.0], np.float32)
    r_rows = core.last_token_rewards(rewards, mask_rows)
    r_packed = core.last_token_rewards(rewards, packed["mask"], seq)
    adv_rows, ret_rows = core.gae_advantages(r_rows, values_rows, mask_rows, 0.9, 0.8)
    adv_packed, ret_packed = core.gae_advantages(
        r_packed, packed["values"], packed["mask"], 0.9, 0.8, seg
    )
    at = 0
    for i, n in enumerate(lengths):
        span = slice(at, at + n)
        np.testing.assert_array_equal(r_packed[0, span], r_rows[i, :n])
        np.testing.assert_allclose(adv_packed[0, span], adv_rows[i, :n], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ret_packed[0, span], ret_rows[i, :n], rtol=1e-6, atol=1e-7)
        at += n
