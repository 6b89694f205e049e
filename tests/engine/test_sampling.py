"""The sampling distribution (temperature, top-k, top-p) and the sampler, against numpy."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.engine import sample, sampling_logprobs, token_logprobs
from jax_agent_rl.engine.sampling import first_max, head_logprobs
from jax_agent_rl.rl.core import entropy_from_logprobs


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


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
# chunks: 8 of 126 and 4 of 251 (padded); 1; and the vocabulary in 7 parts of 143 (each padded
# to 8 steps of 18 rows), as a head split over devices is read
@pytest.mark.parametrize(("chunk", "parts"), [(128, 1), (300, 1), (4096, 1), (128, 7)])
def test_head_logprobs_equal_the_full_vocabulary(
    temperature: float, chunk: int, parts: int
) -> None:
    """`head_logprobs` (chunked, online) = `sampling_logprobs` over all the logits, without
    filters: each target's logprob and each row's entropy, and their gradients to the hidden
    states and the head; its vocabulary read whole or in ``parts``.

    Both compute the same fp32 quantities and differ in the order of their sums only: log Z
    sums V = 1001 terms (relative rounding ~log2(V) * 6e-8 ~ 1e-6 pairwise, worse for a
    sequential online sum but far below 1e-5 at |logits| ~ 5), so values agree to 1e-5
    absolute. Gradients: normwise 1e-5, each entry being a sum over rows or vocabulary of
    terms of either sign, whose rounding scales with the tensor's norm.
    """
    N, D, V = 37, 16, 1001
    kh, kw, ky = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (N, D))
    head = jax.random.normal(kw, (V, D)) * 0.5
    targets = jax.random.randint(ky, (N,), 0, V)

    def full(h: jax.Array, head: jax.Array) -> tuple[jax.Array, jax.Array]:
        lp = sampling_logprobs(h @ head.T, jnp.full((N,), temperature), -jnp.ones(N), jnp.ones(N))
        return token_logprobs(lp, targets), entropy_from_logprobs(lp)

    def chunked(h: jax.Array, head: jax.Array) -> tuple[jax.Array, jax.Array]:
        return head_logprobs(h, head, targets, temperature, chunk, parts)

    for got, want in zip(jax.jit(chunked)(h, head), jax.jit(full)(h, head), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

    cot = jax.random.normal(jax.random.key(1), (2, N))

    def loss(fn: Callable[..., tuple[jax.Array, jax.Array]]) -> Callable[..., jax.Array]:
        return lambda h, head: jnp.sum(cot[0] * fn(h, head)[0] + cot[1] * fn(h, head)[1])

    got_g = jax.jit(jax.grad(loss(chunked), (0, 1)))(h, head)
    want_g = jax.jit(jax.grad(loss(full), (0, 1)))(h, head)
    for got, want in zip(got_g, want_g, strict=True):
        err = np.linalg.norm(np.asarray(got - want, np.float64))
        assert err / np.linalg.norm(np.asarray(want, np.float64)) <= 1e-5


def test_head_logprobs_bf16_gradients_arrive_in_bf16() -> None:
    """In bf16 the logits are still fp32 sums; gradients come back in the inputs' dtypes."""
    h = jax.random.normal(jax.random.key(0), (5, 8), jnp.bfloat16)
    head = jax.random.normal(jax.random.key(1), (50, 8), jnp.bfloat16)
    targets = jnp.arange(5)
    logp, entropy = head_logprobs(h, head, targets, 1.0, 16)
    assert logp.dtype == entropy.dtype == jnp.float32
    dh, dhead = jax.grad(lambda h, w: head_logprobs(h, w, targets, 1.0, 16)[0].sum(), (0, 1))(
        h, head
    )
    assert dh.dtype == dhead.dtype == jnp.bfloat16
    assert dhead.shape == head.shape
