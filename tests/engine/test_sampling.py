"""The sampling distribution (temperature, top-k, top-p) and the sampler, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.engine import sample, sampling_logprobs, token_logprobs
from jax_agent_rl.engine.sampling import first_max


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Straightforward numpy: scale, keep the k largest, then the smallest nucleus >= p."""
    x = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-x)
    keep = np.zeros_like(x, bool)
    k = len(x) if top_k <= 0 else min(top_k, len(x))
    kept = order[:k]
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    mass = 0.0
    for idx, pi in zip(kept, p, strict=True):
        keep[idx] = True
        mass += pi
        if mass >= top_p:
            break
    z = np.where(keep, x, -np.inf)
    return z - np.log(np.sum(np.exp(z[keep] - z[keep].max()))) - z[keep].max()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 5, 1.0), (1.0, -1, 0.7), (1.7, 12, 0.5), (0.0, 3, 1.0)],
)
def test_sampling_logprobs_match_reference(temperature: float, top_k: int, top_p: float) -> None:
    logits = np.random.default_rng(0).normal(0, 2, (4, 40)).astype(np.float32)
    got = np.asarray(
        sampling_logprobs(
            jnp.asarray(logits),
            jnp.full((4,), temperature),
            jnp.full((4,), top_k),
            jnp.full((4,), top_p),
        )
    )
    for row in range(4):
        ref = _reference(logits[row], temperature, top_k, top_p)
        assert np.array_equal(np.isinf(got[row]), np.isinf(ref))
        finite = np.isfinite(ref)
        assert np.abs(got[row][finite] - ref[finite]).max() < 1e-5
        assert abs(np.exp(got[row][finite]).sum() - 1) < 1e-5


def test_rows_filter_independently() -> None:
    """Per-request parameters: one row's filter does not touch another row."""
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 1, (2, 30)).astype(np.float32))
    mixed = sampling_logprobs(
        logits, jnp.array([1.0, 1.0]), jnp.array([3, -1]), jnp.array([1.0, 1.0])
    )
    plain = jax.nn.log_softmax(logits[1])
    assert np.isfinite(np.asarray(mixed[0])).sum() == 3
    assert np.abs(np.asarray(mixed[1] - plain)).max() < 1e-6


def test_sampler_draws_from_the_distribution() -> None:
    """20k draws; every frequency within 5 binomial standard deviations of its probability."""
    n, V = 20000, 8
    logits = jnp.asarray(np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])))
    logprobs = jnp.broadcast_to(jax.nn.log_softmax(logits), (n, V))
    keys = jax.random.split(jax.random.key(0), n)
    tokens = np.asarray(sample(logprobs, jnp.zeros(n, bool), keys, jnp.zeros(n, jnp.int32)))
    freq = np.bincount(tokens, minlength=V) / n
    p = np.exp(np.asarray(logprobs[0]))
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n))


def test_sampler_never_draws_filtered_tokens_and_greedy_is_argmax() -> None:
    n = 4000
    logits = jnp.asarray(np.random.default_rng(2).normal(0, 1, (1, 50)).astype(np.float32))
    logprobs = jnp.broadcast_to(
        sampling_logprobs(logits, jnp.ones(1), jnp.array([4]), jnp.ones(1))[0], (n, 50)
    )
    keys = jax.random.split(jax.random.key(1), n)
    drawn = np.asarray(sample(logprobs, jnp.zeros(n, bool), keys, jnp.arange(n)))
    assert set(drawn.tolist()) <= set(np.argsort(-np.asarray(logits[0]))[:4].tolist())
    greedy = np.asarray(sample(logprobs, jnp.ones(n, bool), keys, jnp.arange(n)))
    assert (greedy == int(jnp.argmax(logits[0]))).all()
    lp = np.asarray(token_logprobs(logprobs, jnp.asarray(drawn)))
    assert np.all(np.isfinite(lp)) and np.all(lp <= 0)


def test_draw_depends_only_on_key_and_step() -> None:
    """A request's randomness does not depend on which other requests share the batch."""
    logits = jax.nn.log_softmax(
        jnp.asarray(np.random.default_rng(3).normal(0, 1, (3, 100)).astype(np.float32))
    )
    keys = jax.random.split(jax.random.key(5), 3)
    steps = jnp.array([0, 7, 3])
    batch = np.asarray(sample(logits, jnp.zeros(3, bool), keys, steps))
    for i in range(3):
        alone = sample(logits[i : i + 1], jnp.zeros(1, bool), keys[i : i + 1], steps[i : i + 1])
        assert int(alone[0]) == batch[i]


def test_first_max_is_argmax_with_ties_infinities_and_nans() -> None:
    """Greedy decoding's argmax as two plain reductions: the first index of the maximum,
    a NaN counting as the maximum (as in ``jnp.argmax``), never an index past the row."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (64, 37)).astype(np.float32)  # many ties
    x[1, [7, 20]] = np.nan
    x[2] = -np.inf
    x[3, 5] = np.inf
    np.testing.assert_array_equal(first_max(jnp.asarray(x)), np.argmax(x, axis=-1))
    assert int(first_max(jnp.asarray(x))[1]) == 7
