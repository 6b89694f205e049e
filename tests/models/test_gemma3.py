"""Gemma 3 through the model seam (`models.gemma3`): logits against transformers' own
``Gemma3ForCausalLM`` (fp32, eager attention) for the 1B's shape and the 4B's (linear RoPE
scaling on the global layers, a score scalar apart from head_dim), sequences longer than the
local layers' 5-position window; packed rows; the paged prefill and decode the engine runs;
the embedded engine's own logprobs against transformers'; import and export; config.json's
refusals.

Tolerance: 1e-4 on logits of about 1-10 in fp32, as the decoder families' parity (a few
layers of fp32 matmuls over 64-256 terms in another summation order: ~1e-6 relative each)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jax_agent_rl.engine import Engine
from jax_agent_rl.models import (
    ModelConfig,
    Packed,
    Paged,
    UnsupportedConfigError,
    init_pages,
    load_hf,
    policy_of,
    save_hf,
)
from jax_agent_rl.models.hf_local import TINY_GEMMA3, write_hf_checkpoint
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import GenerateRequest, SamplingParams
from jax_agent_rl.rollout.embedded import EmbeddedBackend
from tests.models.hf_reference import hf_logits, padded_batch

TOL = 1e-4
SHAPES = list(TINY_GEMMA3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    return {
        n: write_hf_checkpoint(root / n, c, seed=i) for i, (n, c) in enumerate(TINY_GEMMA3.items())
    }


def _logits(cfg: ModelConfig, w: object, rows: Packed) -> np.ndarray:
    policy = policy_of(cfg)
    h = policy.forward(w, rows, sharder=one_device_sharder()).hidden
    return np.asarray(policy.logits(w, h))


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_transformers(shape: str, checkpoints: dict[str, Path]) -> None:
    """Rows of 24 positions (padded right and left): every local layer's window cut in."""
    cfg, w = load_hf(checkpoints[shape], sharder=one_device_sharder())
    tokens, mask, positions = padded_batch(cfg.vocab_size, T=24)
    ref = hf_logits(checkpoints[shape], tokens, mask, positions)
    logits = _logits(cfg, w, Packed(tokens, positions, mask))
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 1.0  # the comparison is not between near-zero numbers
    assert np.abs(logits - ref)[valid].max() <= TOL


def test_the_window_changes_the_logits(checkpoints: dict[str, Path]) -> None:
    """The same weights with every layer global: past the window the logits differ (so the
    parity above tests the window, not a window that never cut in), before it they agree."""
    cfg, w = load_hf(checkpoints["gemma3-1b"], sharder=one_device_sharder())
    wide = ModelConfig.from_hf({**cfg.to_hf(), "sliding_window": 64})
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 16))
    rows = Packed(tokens, np.arange(16)[None], np.ones((1, 16), np.int32))
    a, b = _logits(cfg, w, rows)[0], _logits(wide, w, rows)[0]
    assert np.abs(a[:5] - b[:5]).max() <= TOL
    assert np.abs(a[5:] - b[5:]).max() > 100 * TOL


def test_packed_segments_and_tree_free_rows_equal_separate_sequences(
    checkpoints: dict[str, Path],
) -> None:
    cfg, w = load_hf(checkpoints["gemma3-1b"], sharder=one_device_sharder())
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, cfg.vocab_size, 9), rng.integers(0, cfg.vocab_size, 11)
    packed = np.concatenate([a, b, [0, 0]])[None]
    segments = np.array([[1] * 9 + [2] * 11 + [0, 0]])
    positions = np.array([list(range(9)) + list(range(11)) + [0, 0]])
    logits = _logits(cfg, w, Packed(packed, positions, segments))[0]
    for seq, sl in ((a, slice(0, 9)), (b, slice(9, 20))):
        n = len(seq)
        alone = _logits(cfg, w, Packed(seq[None], np.arange(n)[None], np.ones((1, n))))[0]
        assert np.abs(logits[sl] - alone).max() <= TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_prefill_and_decode_reproduce_the_full_sequence(
    shape: str, checkpoints: dict[str, Path]
) -> None:
    """Two rows in pages of 4 positions (the window of 5 spans two or three pages), prefill
    chunks, decode steps, a second prefill on top, as the engine runs them."""
    cfg, w = load_hf(checkpoints[shape], sharder=one_device_sharder())
    policy = policy_of(cfg)
    T = 18
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, T))
    full = _logits(cfg, w, Packed(tokens, np.broadcast_to(np.arange(T), (2, T)), np.ones((2, T))))
    table = jnp.asarray([[5, 0, 7, 2, 9, 11, 13, 15], [1, 6, 3, 4, 8, 10, 12, 14]])

    def paged(w, tokens, pos, n, pages, reads):  # type: ignore[no-untyped-def]
        rows = Paged(tokens, pages, table, pos, n, pages_read=reads)
        out = policy.forward(w, rows, sharder=one_device_sharder())
        return policy.logits(w, out.hidden), out.cache

    step = jax.jit(paged, static_argnames=("reads",))
    pages = init_pages(cfg, num_pages=16, page_size=4, sharder=one_device_sharder())
    got = np.zeros_like(full)
    plan = [((0, 7), (0, 3)), ((7, 1), (3, 1)), ((8, 6), (4, 10)), ((14, 1), (14, 1))]
    plan += [((t, 1), (t, 1)) for t in range(15, T)]
    for (s0, n0), (s1, n1) in plan:
        width = max(n0, n1)
        chunk = np.zeros((2, width), np.int64)
        chunk[0, :n0], chunk[1, :n1] = tokens[0, s0 : s0 + n0], tokens[1, s1 : s1 + n1]
        reads = None if width == 1 else 8
        lg, pages = step(
            w, jnp.asarray(chunk), jnp.array([s0, s1]), jnp.array([n0, n1]), pages, reads
        )
        got[0, s0 : s0 + n0], got[1, s1 : s1 + n1] = np.asarray(lg)[0, :n0], np.asarray(lg)[1, :n1]
    assert np.abs(got - full).max() <= TOL


def test_the_engine_serves_it_with_logprobs_equal_to_transformers(
    checkpoints: dict[str, Path],
) -> None:
    """The embedded engine (ragged steps, decode calls) samples from the Gemma policy; the
    logprob of every token it returns equals transformers' over the whole sequence."""
    path = checkpoints["gemma3-4b"]
    cfg, w = load_hf(path, sharder=one_device_sharder())
    engine = Engine(
        cfg, sharder=one_device_sharder(), max_concurrent_decodes=4, max_len=64, page_size=4,
        num_pages=64, prefill_chunk=8, min_prefill_bucket=4, max_step_tokens=8,
    )  # fmt: skip
    backend = EmbeddedBackend(engine, w, seed=0)
    rng = np.random.default_rng(5)
    prompts = [tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n)) for n in (3, 9, 14)]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=11)

    async def run() -> list[object]:
        return list(
            await asyncio.gather(
                *(
                    backend.generate(GenerateRequest(f"r{i}", p, sampling))
                    for i, p in enumerate(prompts)
                )
            )
        )

    results = asyncio.run(run())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, result in zip(prompts, results, strict=True):
        ids = [*prompt, *result.token_ids]  # type: ignore[attr-defined]
        assert len(ids) > 5 + 5  # past the window
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1).numpy()
        ref = [lp[len(prompt) - 1 + t, tok] for t, tok in enumerate(result.token_ids)]  # type: ignore[attr-defined]
        assert np.abs(np.array(result.logprobs) - np.array(ref)).max() <= TOL  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trips_and_transformers_loads_it(
    shape: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    cfg, w = load_hf(checkpoints[shape], sharder=one_device_sharder())
    save_hf(tmp_path, cfg, w)
    again_cfg, again = load_hf(tmp_path, sharder=one_device_sharder())
    assert again_cfg == cfg
    for x, y in zip(jax.tree.leaves(w), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tokens, mask, positions = padded_batch(cfg.vocab_size, T=24)
    theirs, ours = (hf_logits(p, tokens, mask, positions) for p in (tmp_path, checkpoints[shape]))
    np.testing.assert_array_equal(theirs, ours)  # the same tensors, read by transformers
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3_text"


def test_the_older_config_layout_reads_the_same(checkpoints: dict[str, Path]) -> None:
    """config.json as the Hub's Gemma 3 checkpoints write it (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) reads as transformers 5's layout does."""
    new = json.loads((checkpoints["gemma3-4b"] / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=2,
    )
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"layer_types": ["local", "full_attention", "local"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 10**310}, "sliding_window"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"vision_config": {}}, "vision_config"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "yarn"),
    ],
)
def test_config_fields_it_cannot_honour_are_named(
    change: dict[str, object], named: str, checkpoints: dict[str, Path]
) -> None:
    hf = {**json.loads((checkpoints["gemma3-4b"] / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf(hf)


def test_lora_on_gemma_is_refused_by_name(checkpoints: dict[str, Path]) -> None:
    import dataclasses

    cfg = ModelConfig.from_pretrained(checkpoints["gemma3-1b"])
    with pytest.raises(UnsupportedConfigError, match="LoRA adapters on Gemma 3"):
        policy_of(dataclasses.replace(cfg, lora=Lora(rank=2, alpha=4.0, targets=("q",))))


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma3-4b"])
def test_the_plan_presets_are_transformers_models_of_the_same_size(preset: str) -> None:
    """`jarl plan --model gemma3-1b / -4b`: transformers builds the same config.json (on the
    meta device: no memory) into a model of exactly the parameters ours declares."""
    import math

    from jax_agent_rl.models.decoder import is_spec
    from jax_agent_rl.plan import PRESETS, preset_model

    cfg = preset_model(preset)
    fields = {k: v for k, v in PRESETS[preset].items() if k != "model_type"}
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("gemma3_text", **fields)
        )
    count = sum(p.numel() for p in theirs.parameters())
    specs = jax.tree.leaves(policy_of(cfg).specs(), is_leaf=is_spec)
    assert sum(math.prod(s.shape) for s in specs) == cfg.num_params == count
    assert count == {"gemma3-1b": 999_885_952, "gemma3-4b": 3_880_263_168}[preset]
