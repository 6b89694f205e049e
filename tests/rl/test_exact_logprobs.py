"""`model.exact_logprobs`: the engine's sampled-token logprobs equal the learner's bit for bit,
in bfloat16, where the default paths differ by about 1e-2 (the decode step's attention sums its
pages otherwise than the training attention sums a sequence, and XLA keeps a fused bf16 op's
result unrounded in one program and not the other)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.cli.demo import SMALL_OVERRIDES, small_task
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.config.model import EXACT_ROWS
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import Packed, Paged, Weights, forward, lm_logits, load_hf
from jax_agent_rl.models.config import compiler_options
from jax_agent_rl.models.decoder import (
    attention,
    exact_training_attention,
    init_pages,
    serving_layout,
)
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics

# compiled as a run compiles (optimized, XLA:CPU's fusion emitters on where they are not
# `EXACT_OPTIONS`'): the suite's O0 programs would hide what the emitters round otherwise
pytestmark = pytest.mark.compute_bound

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "tests" / "train" / "warm_starts" / "tiny"
PAGE = 16


def _decoded_and_trained(exact: bool, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The demo model's logits in ``dtype`` for one sequence (60 tokens), the engine's way (a
    prompt of 40 prefilled in a chunk of 64, then 20 decode steps of 64 rows, the sequence in
    row 0) and the learner's (the sequence packed after a 7-token neighbour in one row)."""
    sharder = one_device_sharder()
    cfg, w = load_hf(WARM_START, dtype, sharder=sharder)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, exact_pages=PAGE if exact else 0)
    options = compiler_options(cfg)
    seq = np.random.default_rng(0).integers(3, cfg.vocab_size, 60).astype(np.int32)

    def learn(w: Weights, tokens: jax.Array) -> jax.Array:
        n = tokens.shape[1]
        segments = jnp.concatenate([jnp.ones((1, 7), jnp.int32), jnp.full((1, n), 2)], 1)
        positions = jnp.concatenate([jnp.arange(7), jnp.arange(n)])[None]
        packed = jnp.concatenate([tokens[:, :7] + 1, tokens], 1)
        h = forward(w, cfg, Packed(packed, positions, segments), sharder=sharder).hidden
        return lm_logits(w, h)[0, 7:]

    trained = np.asarray(jax.jit(learn, compiler_options=options)(w, jnp.asarray(seq[None])))

    @partial(jax.jit, static_argnames=("pages_read",), compiler_options=options)
    def step(w, pages, tokens, table, pos, new, pages_read=None):
        out = forward(
            w, cfg, Paged(tokens, pages, table, pos, new, pages_read=pages_read), sharder=sharder
        )
        return lm_logits(w, out.hidden), out.cache

    rows, prompt = EXACT_ROWS, 40
    ws, pages = serving_layout(w), init_pages(cfg, 32, PAGE, sharder)
    table = np.stack([np.arange(8)] + [8 + np.arange(8)] * (rows - 1)).astype(np.int32)
    tokens = np.zeros((1, 64), np.int32)  # the engine prefills one row: a chunk of 64
    tokens[0, :prompt] = seq[:prompt]
    prefill = (table[:1], np.zeros(1, np.int32), np.array([prompt], np.int32))
    logits, pages = step(ws, pages, tokens, *prefill, pages_read=4)
    decoded = [np.asarray(logits)[0, :prompt]]
    new = np.zeros(rows, np.int32)
    for t in range(prompt, len(seq)):
        tokens, pos = np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32)
        tokens[0, 0], new[0], pos[0] = seq[t], 1, t
        logits, pages = step(ws, pages, tokens, table, pos, new)
        decoded.append(np.asarray(logits)[0, :1])
    return np.concatenate(decoded), trained


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_and_decode_equal_the_training_forward_bit_for_bit(dtype: str) -> None:
    """In fp32 too: bf16's rounding hides most fp32 differences (a decode step of 32 rows
    summed its matmuls otherwise than the learner's thousands, 3e-6 in a logit, which bf16
    showed in one token of ~2400), fp32 shows every one."""
    decoded, trained = _decoded_and_trained(exact=True, dtype=dtype)
    assert np.array_equal(decoded, trained), np.abs(decoded - trained).max()
    # the default paths: the same model, the same tokens, not the same numbers
    decoded, trained = _decoded_and_trained(exact=False, dtype=dtype)
    assert np.abs(decoded - trained).max() > (1e-3 if dtype == "bfloat16" else 1e-7)


def test_the_exact_attention_s_gradient_is_the_training_attention_s() -> None:
    """Only the forward is the decode step's: the gradient is `attention`'s own, so a step
    trains as it does without exact logprobs (up to the forward's rounding)."""
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in [(2, 40, 4, 8)] + [(2, 40, 2, 8)] * 2
    )
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 2, 0))

    def loss(f: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(f(q, k, v) ** 2)

    exact = partial(
        exact_training_attention,
        segment_ids_bt=seg,
        page_size=PAGE,
        window=32,
        sharder=one_device_sharder(),
    )
    plain = partial(attention, segment_ids_bt=seg, sharder=one_device_sharder())
    np.testing.assert_allclose(exact(q, k, v), plain(q, k, v), atol=1e-5)
    # the window only bounds the pages each token's table holds: the same numbers
    whole_row = partial(exact, window=None)
    assert np.array_equal(exact(q, k, v), whole_row(q, k, v))
    for a, b in zip(
        jax.grad(partial(loss, exact), (0, 1, 2))(q, k, v),
        jax.grad(partial(loss, plain), (0, 1, 2))(q, k, v),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_a_bf16_training_step_sees_no_gap_between_sampler_and_learner(tmp_path: Path) -> None:
    """Two GRPO steps of the demo task in bf16 from its warm start (8 prompts x 8 episodes of
    up to 3 turns with calculator calls, prompts prefilled beside decoding rows; the second
    under pushed weights): the learner's logprob of every sampled token equals the engine's.
    (With XLA:CPU's fusion emitters on, step 2 had one token 1.5e-3 off: a layer output of the
    decode step one bf16 ulp from the prefill's, `EXACT_OPTIONS`.)"""
    small_task(tmp_path / "task", "tiny")
    overrides = [
        *SMALL_OVERRIDES,
        f"model.path={WARM_START}",
        f"data.train={tmp_path / 'task' / 'train.jsonl'}",
        "data.val=",
        "sft.data=",
        "tools.config=pkg://jax_agent_rl/configs/tools_calculator.yaml",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.steps=2",
        "engine.warmup=false",
        "model.dtype=bfloat16",
        "model.exact_logprobs=true",
        f"engine.page_size={PAGE}",
        f"engine.max_concurrent={2 * EXACT_ROWS}",  # EXACT_ROWS on each of the mesh's 2 shards
    ]
    train(load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", overrides))
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert len(steps) == 2
    for m in steps:
        assert m["logprob_gap/max"] == 0.0 and m["logprob_gap/mean"] == 0.0, m
    traces = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").open()]
    with_tools = [t for t in traces if t["tool_calls"] and t["num_turns"] >= 2]
    assert with_tools, "no episode called the calculator and went on: nothing multi-turn checked"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("engine.backend=vllm", "engine.backend=vllm"),
        ("engine.keep_kv_on_update=true", "engine.keep_kv_on_update=true"),
        ("model.lora.rank=8", "model.lora.rank=8"),
    ],
)
def test_exact_logprobs_refuse_what_cannot_match(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"model.exact_logprobs=true with {named}"):
        load_config(
            ROOT / "configs" / "demo_calculator_cpu.yaml",
            ["model.exact_logprobs=true", override, "model.path=x", "data.train=x"],
        )


def test_exact_logprobs_refuse_an_engine_of_fewer_rows_before_the_run() -> None:
    """The demo's 64 slots over its 2 data shards are 32 rows a decode step: named by the
    check (`--dry-run` too), not by the engine once the run has started."""
    with pytest.raises(ConfigError, match=r"engine\.max_concurrent=64 over 2 data shards gives 32"):
        load_config(
            ROOT / "configs" / "demo_calculator_cpu.yaml",
            ["model.exact_logprobs=true", "model.path=x", "data.train=x"],
        )


def test_an_engine_that_cannot_serve_exact_logprobs_names_why() -> None:
    cfg, _ = load_hf(WARM_START, "bfloat16", sharder=one_device_sharder())
    cfg = dataclasses.replace(cfg, exact_pages=PAGE)
    with pytest.raises(ValueError, match=r"page_size=32 \(the learner reads pages of 16\)"):
        Engine(cfg, sharder=one_device_sharder(), page_size=32, max_len=128)
    with pytest.raises(ValueError, match="32 decode slots a shard"):
        Engine(
            cfg,
            sharder=one_device_sharder(),
            page_size=PAGE,
            max_len=128,
            max_concurrent_decodes=32,
        )
