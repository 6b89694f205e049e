"""The off-policy losses and rollout masks against the formulas as the frameworks that use
them compute them, written here in numpy from their code's math (float64), on random
batches, in every aggregation mode: CISPO (SkyRL ``cispo``, verl ``cispo``), DPPO-Binary TV /
KL (verl ``dppo_tv`` / ``dppo_kl``), IcePop (AReaL / rllm ``M(k) = k 1[alpha <= k <= beta]``),
KPop (prime-rl's bidirectional binary KL) and geometric sequence masking (SkyRL
``sequence_mask_metric=geometric``). And the config keys that choose them, each read where
the learner forms its loss (`objectives.rollout_weights`, `objectives.policy_objective`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.config import AlgorithmSection
from jax_agent_rl.models import init_params
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl import core
from jax_agent_rl.rl.objectives import (
    Denominators,
    Derived,
    SamplingSpec,
    policy_objective,
    rollout_weights,
    token_stats,
)
from tests.rl.test_learner import CFG, random_batch, spec

TOL = dict(rtol=1e-6, atol=1e-6)  # fp32 against float64, O(1) numbers
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def batch(seed: int, B: int = 6, T: int = 10, spread: float = 0.4) -> dict[str, np.ndarray]:
    """Random fp32 logprobs (current, old, rollout), advantages of either sign (0 on a few
    tokens) and a ragged mask with one empty row."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[1] = 0.0
    old = np.log(rng.uniform(0.02, 0.95, (B, T))).astype(np.float32)
    logp = np.minimum(old + rng.normal(0, spread, (B, T)), -1e-3).astype(np.float32)
    rollout = np.minimum(old + rng.normal(0, 2 * spread, (B, T)), -1e-3).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    adv[:, 0] = 0.0
    return dict(logp=logp, old=old, rollout=rollout, adv=adv, mask=mask)


def agg_weights(mask: np.ndarray, mode: str) -> np.ndarray:
    """The weight of each token's loss in the aggregate (`core.aggregate_loss`'s modes, rows
    as sequences): the loss is linear in the per-token losses, so its gradient is this too."""
    m = mask.astype(np.float64)
    count = m.sum(-1, keepdims=True)
    seqs = (count > 0).sum()
    if mode == "token-mean":
        return m / m.sum()
    if mode == "seq-mean-token-sum":
        return m / seqs
    if mode == "seq-mean-token-mean":
        return m / np.where(count > 0, count, 1.0) / seqs
    return m / (m.shape[-1] * seqs)


def f64(*xs: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in xs]


def ratio_of(logp: np.ndarray, old: np.ndarray) -> np.ndarray:
    return np.exp(np.clip(logp - old, -20.0, 20.0))


def loss_and_grad(fn, logp: np.ndarray, **kwargs):  # type: ignore[no-untyped-def]
    (loss, metrics), grad = jax.value_and_grad(lambda x: fn(x, **kwargs), has_aux=True)(
        jnp.asarray(logp)
    )
    return float(loss), metrics, np.asarray(grad)


# --- policy losses ---------------------------------------------------------------------------


def ref_cispo(b: dict[str, np.ndarray], lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """SkyRL / verl: ``loss = -A * clamp(ratio, 1 - lo, 1 + hi).detach() * log_prob``; per
    token (value, d value / d log_prob)."""
    logp, old, adv = f64(b["logp"], b["old"], b["adv"])
    c = np.clip(ratio_of(logp, old), 1 - lo, 1 + hi)
    return -adv * c * logp, -adv * c


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("lo", "hi"), [(1.0, 5.0), (0.2, 0.28)])
def test_cispo_matches_its_formula_and_clipped_tokens_pass_gradient(
    mode: str, lo: float, hi: float
) -> None:
    b = batch(0)
    value, coef = ref_cispo(b, lo, hi)
    w = agg_weights(b["mask"], mode)
    loss, metrics, grad = loss_and_grad(
        core.cispo_loss,
        b["logp"],
        old_logp_bt=b["old"],
        advantages_bt=b["adv"],
        mask_bt=b["mask"],
        clip_low=lo,
        clip_high=hi,
        agg_mode=mode,
    )
    np.testing.assert_allclose(loss, (w * value).sum(), **TOL)
    np.testing.assert_allclose(grad, w * coef, **TOL)
    r = ratio_of(*f64(b["logp"], b["old"]))
    clipped = ((r < 1 - lo) | (r > 1 + hi)) & (b["mask"] > 0)
    np.testing.assert_allclose(metrics["clipfrac"], clipped.sum() / b["mask"].sum(), **TOL)
    if lo < 1:  # the tight bounds clip tokens, and those still carry gradient
        assert clipped.any() and (np.abs(grad[clipped & (b["adv"] != 0)]) > 0).all()


def ref_dppo(
    b: dict[str, np.ndarray], kind: str, d_lo: float, d_hi: float, clip_c: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """verl ``compute_policy_loss_dppo_tv`` / ``_kl``: ``-A * clamp(ratio, max=c).detach() *
    log_prob * valid``; (value, d value / d log_prob, valid)."""
    logp, old, adv = f64(b["logp"], b["old"], b["adv"])
    ratio = ratio_of(logp, old)
    p, p_old = np.exp(logp), np.exp(old)
    if kind == "tv":
        pos, neg = p - p_old <= d_hi, p - p_old >= -d_lo
    else:
        bkl = p_old * (old - logp) + (1 - p_old) * np.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        pos = (bkl <= d_hi) | (p <= p_old)
        neg = (bkl <= d_lo) | (p >= p_old)
    valid = np.where(adv > 0, pos, neg).astype(np.float64)
    coef = -adv * np.minimum(ratio, clip_c) * valid
    return coef * logp, coef, valid


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("kind", "delta"), [("tv", 0.2), ("tv", 0.05), ("kl", 0.05)])
def test_dppo_matches_verls_formula(mode: str, kind: str, delta: float) -> None:
    b = batch(1, spread=0.8)
    value, coef, valid = ref_dppo(b, kind, delta, delta, 3.0)
    w = agg_weights(b["mask"], mode)
    loss, metrics, grad = loss_and_grad(
        core.dppo_loss,
        b["logp"],
        old_logp_bt=b["old"],
        advantages_bt=b["adv"],
        mask_bt=b["mask"],
        divergence=kind,
        delta_low=delta,
        delta_high=delta,
        clip_c=3.0,
        agg_mode=mode,
    )
    np.testing.assert_allclose(loss, (w * value).sum(), **TOL)
    np.testing.assert_allclose(grad, w * coef, **TOL)
    on = b["mask"] > 0
    assert 0 < valid[on].sum() < on.sum()  # the bound binds on some tokens, not all
    np.testing.assert_allclose(metrics["clipfrac"], 1 - valid[on].mean(), **TOL)
    r = ratio_of(*f64(b["logp"], b["old"]))
    np.testing.assert_allclose(metrics["clipfrac_lower"], ((r > 3.0) * valid)[on].mean(), **TOL)


def test_dppo_refuses_an_unknown_divergence() -> None:
    with pytest.raises(ValueError, match="allowed: tv, kl"):
        core.dppo_loss(
            jnp.zeros((1, 1)),
            jnp.zeros((1, 1)),
            jnp.ones((1, 1)),
            jnp.ones((1, 1)),
            divergence="js",
        )  # type: ignore[arg-type]


# --- rollout masks ---------------------------------------------------------------------------


def ref_icepop(b: dict[str, np.ndarray], lo: float, hi: float) -> np.ndarray:
    """AReaL / rllm: ``M(k) = k if alpha <= k <= beta else 0``, ``k = exp(old - rollout)``."""
    k = np.exp(np.float64(b["old"]) - np.float64(b["rollout"]))
    return np.where((k >= lo) & (k <= hi) & (b["mask"] > 0), k, 0.0)


def ref_kpop(b: dict[str, np.ndarray], phi: float) -> np.ndarray:
    """prime-rl ``kpop_loss_fn``: probabilities clamped to [1e-6, 1 - 1e-6]; keep a token when
    ``D_B(p||q) <= phi`` and ``D_B(q||p) <= phi``; the kept token weighted by its ratio."""
    p = np.clip(np.exp(np.float64(b["old"])), 1e-6, 1 - 1e-6)
    q = np.clip(np.exp(np.float64(b["rollout"])), 1e-6, 1 - 1e-6)

    def d(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x * np.log(x / y) + (1 - x) * np.log((1 - x) / (1 - y))

    keep = (d(p, q) <= phi) & (d(q, p) <= phi) & (b["mask"] > 0)
    return np.where(keep, np.exp(np.float64(b["old"]) - np.float64(b["rollout"])), 0.0)


def ref_geometric(b: dict[str, np.ndarray], lo: float, hi: float) -> np.ndarray:
    """SkyRL: per sequence ``exp(mean over its loss tokens of (old - rollout))``; a sequence
    outside [lo, hi] is masked whole."""
    m = np.float64(b["mask"])
    log_k = (np.float64(b["old"]) - np.float64(b["rollout"])) * m
    g = np.exp(log_k.sum(-1) / np.maximum(m.sum(-1), 1.0))
    return ((g >= lo) & (g <= hi))[:, None] * m


def ref_ppo_tokens(b: dict[str, np.ndarray]) -> np.ndarray:
    """verl ``compute_policy_loss_vanilla`` per token (clip 0.2 / 0.28, dual clip 3)."""
    logp, old, adv = f64(b["logp"], b["old"], b["adv"])
    r = ratio_of(logp, old)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.28))
    return np.where(adv < 0, np.minimum(loss, -adv * 3.0), loss)


MASKS = {
    "icepop": lambda b: ref_icepop(b, 0.5, 5.0),
    "kpop": lambda b: ref_kpop(b, 0.1),
    "geometric": lambda b: ref_geometric(b, 0.9, 1.1),
}


def core_mask(name: str, b: dict[str, np.ndarray]) -> jax.Array:
    args = (b["old"], b["rollout"], b["mask"])
    if name == "icepop":
        return core.icepop_weights(*args, 0.5, 5.0)
    if name == "kpop":
        return core.kpop_weights(*args, 0.1)
    return core.geometric_sequence_mask(*args, 0.9, 1.1)


@pytest.mark.parametrize("name", MASKS)
def test_rollout_masks_match_their_formulas(name: str) -> None:
    b = batch(2, B=16, spread=0.15 if name == "geometric" else 0.6)
    want = MASKS[name](b)
    np.testing.assert_allclose(core_mask(name, b), want, **TOL)
    on = b["mask"] > 0
    assert 0 < (want[on] == 0).sum() < on.sum()  # some tokens dropped, some kept
    grad = jax.grad(
        lambda x: core_mask(name, {**b, "old": x}).sum()  # type: ignore[arg-type]
    )(jnp.asarray(b["old"]))
    np.testing.assert_allclose(grad, 0.0)  # constants


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_masked_losses_match_the_peers_in_every_aggregation_mode(
    mode: str, name: str, loss: str
) -> None:
    """A masked token carries neither loss nor gradient; a kept one its weighted loss: PPO as
    AReaL's decoupled loss (``behav_imp_weight * pg_loss``), CISPO as the NeMo-RL IcePop
    change applies it."""
    b = batch(3, B=16, spread=0.15 if name == "geometric" else 0.6)
    weights = MASKS[name](b)
    w = agg_weights(b["mask"], mode)
    common = dict(old_logp_bt=b["old"], advantages_bt=b["adv"], mask_bt=b["mask"], agg_mode=mode)
    if loss == "ppo":
        fn = lambda x, **kw: core.policy_loss(x, clip_high=0.28, **kw)  # noqa: E731
        value = ref_ppo_tokens(b)
    else:
        fn = core.cispo_loss
        value, coef = ref_cispo(b, 1.0, 5.0)
    got, _, grad = loss_and_grad(fn, b["logp"], is_weights_bt=core_mask(name, b), **common)
    np.testing.assert_allclose(got, (w * value * weights).sum(), **TOL)
    assert (grad[(weights == 0)] == 0).all()
    if loss == "cispo":
        np.testing.assert_allclose(grad, w * coef * weights, **TOL)


def test_geometric_mask_of_packed_sequences_equals_one_per_row() -> None:
    """Two sequences sharing a row (``seq_bt``) are judged each on its own tokens."""
    b = batch(4, B=4, T=6, spread=0.04)
    want = np.asarray(core.geometric_sequence_mask(b["old"], b["rollout"], b["mask"], 0.95, 1.05))
    packed = {k: v.reshape(2, 12) for k, v in b.items()}
    seq = np.repeat(np.arange(4), 6).reshape(2, 12)
    got = core.geometric_sequence_mask(
        packed["old"], packed["rollout"], packed["mask"], 0.95, 1.05, seq, 4
    )
    np.testing.assert_allclose(np.asarray(got).reshape(4, 6), want, **TOL)
    assert 0 < want.sum() < b["mask"].sum()


# --- the config keys -------------------------------------------------------------------------


ROLLOUT_CASES = {
    "none": (AlgorithmSection(tis_cap=None), None),
    "tis": (AlgorithmSection(tis_cap=1.5), lambda k, m: np.minimum(k, 1.5) * m),
    "icepop": (
        AlgorithmSection(tis_cap=None, rollout_mask="icepop", icepop_low=0.8, icepop_high=1.2),
        lambda k, m: np.where((k >= 0.8) & (k <= 1.2), k, 0.0) * m,
    ),
    "kpop": (
        AlgorithmSection(tis_cap=None, rollout_mask="kpop", kpop_threshold=0.002),
        None,  # its formula is checked above; here only that the key takes effect
    ),
    "geometric+tis": (
        AlgorithmSection(tis_cap=1.5, rollout_mask="geometric", geo_mask_low=0.9),
        None,
    ),
}


@pytest.mark.parametrize("case", ROLLOUT_CASES)
def test_rollout_correction_keys_weight_the_tokens(case: str) -> None:
    """`rollout_weights` reads ``tis_cap`` and each ``rollout_mask`` with its bounds; the
    masks report the share of sampled tokens they zero."""
    algo, formula = ROLLOUT_CASES[case]
    rows, _ = random_batch(8, 24, seed=1)
    rng = np.random.default_rng(1)
    mask = np.asarray(rows.mask)
    old = (np.asarray(rows.rollout_logp) + rng.normal(0, 0.15, mask.shape) * mask).astype(
        np.float32
    )
    weights, metrics = rollout_weights(algo, jnp.asarray(old), rows, int(rows.sequence.max()) + 1)
    if algo.tis_cap is None and algo.rollout_mask == "none":
        assert weights is None and metrics == {}
        return
    assert weights is not None
    w = np.asarray(weights)
    k = np.exp(old.astype(np.float64) - np.asarray(rows.rollout_logp, np.float64))
    if formula is not None:
        np.testing.assert_allclose(w, formula(k, mask), **TOL)
    if algo.rollout_mask == "none":
        assert metrics == {}
        return
    on = mask > 0
    dropped = (w == 0) & on
    assert 0 < dropped.sum() < on.sum()
    np.testing.assert_allclose(metrics["rollout_mask/masked_frac"], dropped.sum() / on.sum(), **TOL)
    if algo.rollout_mask == "geometric":  # whole sequences: each kept one keeps TIS's weight
        seq = np.asarray(rows.sequence)
        for n in np.unique(seq[on]):
            mine = (seq == n) & on
            assert (w[mine] == 0).all() or np.allclose(w[mine], np.minimum(k[mine], 1.5))


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo", "dppo_tv", "dppo_kl"])
def test_policy_loss_key_chooses_the_loss(policy_loss: str) -> None:
    """`policy_objective`'s ``pg_loss`` is the chosen loss of the learner's logprobs, with the
    rollout correction's weights (IcePop here), token-mean over the batch."""
    algo = AlgorithmSection(policy_loss=policy_loss, tis_cap=None, rollout_mask="icepop")  # type: ignore[arg-type]
    s = spec(algo, sampling=SamplingSpec())  # unfiltered: random targets have finite logprobs
    params = init_params(jax.random.key(0), CFG, sharder=one_device_sharder())
    rows, given = random_batch(4, 16, seed=2)
    mask = jnp.asarray(rows.mask)
    logp = jnp.where(mask > 0, token_stats(s, params, rows)[0], 0.0)
    old = logp + jnp.asarray(given.old_logp) * 0.1 * mask  # ratios spread around 1
    noise = np.random.default_rng(3).normal(0, 0.8, mask.shape).astype(np.float32)
    rows = dataclasses.replace(rows, rollout_logp=old + noise * mask)  # some beyond the band
    dv = Derived(old, given.ref_logp, given.advantages, given.old_values, given.returns, old)
    d = Denominators(mask.sum(), jnp.float32(4), 16.0, int(rows.sequence.max()) + 1)
    _, metrics = policy_objective(s, params, rows, dv, d)
    w = core.icepop_weights(old, rows.rollout_logp, mask)
    args = (logp, old, dv.advantages, mask)
    kw = dict(is_weights_bt=w, seq_bt=rows.sequence, num_sequences=d.num_sequences)
    if policy_loss == "ppo":
        want, _ = core.policy_loss(*args, **kw)
    elif policy_loss == "cispo":
        want, _ = core.cispo_loss(*args, **kw)
    else:
        want, _ = core.dppo_loss(*args, divergence=policy_loss[-2:], **kw)  # type: ignore[arg-type]
    ppo, _ = core.policy_loss(*args, **kw)
    np.testing.assert_allclose(metrics["pg_loss"], want, rtol=1e-5, atol=1e-6)
    if policy_loss != "ppo":  # a different number from PPO's on the same batch
        assert abs(float(metrics["pg_loss"]) - float(ppo)) > 1e-4
    assert "rollout_mask/masked_frac" in metrics


def test_algorithm_section_refuses_an_unknown_loss() -> None:
    from jax_agent_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"ppo.*cispo.*dppo_tv.*dppo_kl"):
        load_config(None, ["algorithm.policy_loss=grpo"])
    with pytest.raises(ConfigError, match=r"none.*icepop.*kpop.*geometric"):
        load_config(None, ["algorithm.rollout_mask=tis"])
