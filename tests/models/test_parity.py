"""The JAX decoder against transformers' own forward, on checkpoints transformers wrote.

Tolerance: 1e-4 absolute on logits of magnitude ~1-10 in fp32. Both sides compute the same
real-number function; fp32 rounding (unit roundoff 6e-8) accumulated over a few hundred-term
dot products and two layers stays near 1e-6, so 1e-4 leaves two orders of margin while still
catching any real difference (a wrong RoPE frequency or a missing bias moves logits by >1e-2).

The GPU's fused kernels (training attention and decode attention by JAX's Pallas GPU (Triton)
kernels, `attention_kernels.forced_kernel` / ``decode_kernel="triton"``) run here in Pallas's
interpret mode: in fp32 they compute what the XLA paths do up to fp32 rounding, so they are
held to the same tolerance. On a GPU they would run for real, and fp32 through the Triton
kernels takes TF32 there (which the run never picks: `training_kernel`): those cases are
skipped on a GPU.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.models import Packed, Paged, forward, init_pages, lm_logits, load_hf
from jax_agent_rl.models.attention_kernels import forced_kernel
from jax_agent_rl.models.sharding import one_device_sharder
from tests.models.hf_reference import hf_logits, padded_batch

FAMILIES = ["llama", "qwen2", "qwen3"]
TOL = 1e-4


def _skip_fp32_triton_on_a_gpu(kernel: str) -> None:
    if kernel == "triton" and jax.default_backend() == "gpu":
        pytest.skip("fp32 through the Triton kernels takes TF32 on a GPU (module docstring)")


# the GPU kernels on one family (the attention they replace is the same in every family)
WITH_GPU_KERNELS = [(family, "xla") for family in FAMILIES] + [("qwen2", "triton")]


@pytest.mark.parametrize(("family", "kernel"), WITH_GPU_KERNELS)
def test_forward_matches_transformers(
    family: str, kernel: str, hf_checkpoints: dict[str, Path]
) -> None:
    _skip_fp32_triton_on_a_gpu(kernel)
    cfg, w = load_hf(hf_checkpoints[family], sharder=one_device_sharder())
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(hf_checkpoints[family], tokens, mask, positions)
    with forced_kernel(kernel):
        h = forward(w, cfg, Packed(tokens, positions, mask), sharder=one_device_sharder()).hidden
    logits = np.asarray(lm_logits(w, h))
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 1.0  # the comparison is not between near-zero numbers
    assert np.abs(logits - ref)[valid].max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_segments_equal_separate_sequences(
    family: str, hf_checkpoints: dict[str, Path]
) -> None:
    cfg, w = load_hf(hf_checkpoints[family], sharder=one_device_sharder())
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 9)
    packed = np.concatenate([a, b, [0, 0]])[None]
    segments = np.array([[1] * 7 + [2] * 9 + [0, 0]])
    positions = np.array([list(range(7)) + list(range(9)) + [0, 0]])
    logits = np.asarray(
        lm_logits(
            w,
            forward(
                w, cfg, Packed(packed, positions, segments), sharder=one_device_sharder()
            ).hidden,
        )
    )[0]
    for seq, sl in ((a, slice(0, 7)), (b, slice(7, 16))):
        alone = lm_logits(
            w,
            forward(
                w,
                cfg,
                Packed(seq[None], np.arange(len(seq))[None], np.ones((1, len(seq)))),
                sharder=one_device_sharder(),
            ).hidden,
        )
        assert np.abs(logits[sl] - np.asarray(alone)[0]).max() <= TOL


@pytest.mark.parametrize(
    ("family", "decode_kernel"),
    [(family, "ragged" if kernel == "xla" else kernel) for family, kernel in WITH_GPU_KERNELS],
)
def test_prefill_and_decode_reproduce_full_sequence(
    family: str, decode_kernel: str, hf_checkpoints: dict[str, Path]
) -> None:
    """Rows of different lengths in pages; prefill, decode, a second prefill on top (a new
    turn), decode; the decode steps by the XLA ragged loop or the GPU paged kernel."""
    _skip_fp32_triton_on_a_gpu(decode_kernel)
    cfg, w = load_hf(hf_checkpoints[family], sharder=one_device_sharder())
    T = 16
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, T))
    full = np.asarray(
        lm_logits(
            w,
            forward(
                w,
                cfg,
                Packed(tokens, np.broadcast_to(np.arange(T), (2, T)), np.ones((2, T))),
                sharder=one_device_sharder(),
            ).hidden,
        )
    )

    def paged(w, cfg, tokens, pos, n, pages, reads):  # type: ignore[no-untyped-def]
        rows = Paged(tokens, pages, table, pos, n, pages_read=reads, decode_kernel=decode_kernel)
        out = forward(w, cfg, rows, sharder=one_device_sharder())
        return out.hidden, out.cache

    step = jax.jit(paged, static_argnames=("cfg", "reads"))
    # pages of 4 positions, the two rows' pages interleaved and out of order in the pool
    table = jnp.asarray([[5, 0, 7, 2, 9, 11, 13, 15], [1, 6, 3, 4, 8, 10, 12, 14]])
    pages = init_pages(cfg, num_pages=16, page_size=4, sharder=one_device_sharder())
    got = np.zeros_like(full)
    # chunk plan per row: (start, n) pairs; row 1 prefills fewer tokens than row 0 at first
    plan = [((0, 6), (0, 4)), ((6, 1), (4, 1)), ((7, 5), (5, 7)), ((12, 1), (12, 1))]
    plan += [((t, 1), (t, 1)) for t in range(13, T)]
    for (s0, n0), (s1, n1) in plan:
        width = max(n0, n1)
        chunk = np.zeros((2, width), np.int64)
        chunk[0, :n0], chunk[1, :n1] = tokens[0, s0 : s0 + n0], tokens[1, s1 : s1 + n1]
        reads = None if width == 1 else 8  # a prefill chunk reads 8 pages; decode its own
        pos, n = jnp.array([s0, s1]), jnp.array([n0, n1])
        h, pages = step(w, cfg, jnp.asarray(chunk), pos, n, pages, reads)
        lg = np.asarray(lm_logits(w, h))
        got[0, s0 : s0 + n0], got[1, s1 : s1 + n1] = lg[0, :n0], lg[1, :n1]
    assert np.abs(got - full).max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_forward_tracks_fp32(family: str, hf_checkpoints: dict[str, Path]) -> None:
    """bf16 compute vs fp32 compute on the same (bf16-rounded) weights.

    bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); each of the ~10 rounded
    steps per layer adds at most that relative error to the residual stream, so over 2 layers
    the logits may move by a few percent of their scale, never by more than ~5%.
    """
    cfg32, _ = load_hf(hf_checkpoints[family], dtype="float32", sharder=one_device_sharder())
    cfg16, w16 = load_hf(hf_checkpoints[family], dtype="bfloat16", sharder=one_device_sharder())
    w_rounded = jax.tree.map(lambda x: x.astype(jnp.float32), w16)
    tokens, mask, positions = padded_batch(cfg32.vocab_size)
    ref = np.asarray(
        lm_logits(
            w_rounded,
            forward(
                w_rounded, cfg32, Packed(tokens, positions, mask), sharder=one_device_sharder()
            ).hidden,
        )
    )
    h16 = forward(w16, cfg16, Packed(tokens, positions, mask), sharder=one_device_sharder()).hidden
    assert h16.dtype == jnp.bfloat16
    logits = lm_logits(w16, h16)
    assert logits.dtype == jnp.float32  # logits (and so logprobs) stay fp32
    valid = mask.astype(bool)
    rel = np.abs(np.asarray(logits) - ref)[valid].max() / np.abs(ref[valid]).max()
    assert rel <= 0.05
    assert (np.asarray(logits).argmax(-1) == ref.argmax(-1))[valid].mean() >= 0.9
