"""A tiny random Gemma 3 (`hf_local.DEMO_GEMMA3`: local layers of a 16-position window, a
global one between) through a whole run of the demo's config, as a user runs it with
``model.path`` at a Gemma 3 checkpoint: SFT steps, GRPO steps over multi-turn calculator
rollouts from the embedded engine, the export. Nothing in the run knows the family but the
checkpoint's config.json: the engine, the learner and the push reach the model through its
policy.

What is checked: the steps ran with finite losses; the sampler's logprobs are the learner's
(fp32 on both sides, prompts of ~200 tokens crossing the window: within 1e-4, the parity
tolerance of `tests/models/test_gemma3.py`); the parameters moved; the exported folder is a
Gemma 3 checkpoint that transformers reads to the logits our policy computes from it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.cli.demo import prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.models import Packed, load_hf, policy_of
from jax_agent_rl.models.hf_local import DEMO_GEMMA3
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics
from tests.models.hf_reference import hf_logits, padded_batch
from tests.train.test_configs import tiny

pytestmark = pytest.mark.compute_bound

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


def test_a_tiny_gemma3_trains_with_grpo_and_exports(tmp_path: Path) -> None:
    task = prepare(
        tmp_path / "task", ArithmeticTask(), n_train=64, n_val=8, n_sft=64, model=DEMO_GEMMA3
    )
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", tiny(task, run, steps=3))
    train(cfg)

    steps = read_metrics(run / "metrics.jsonl", "train")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in steps)
    gaps = [r["logprob_gap/max"] for r in steps if "logprob_gap/max" in r]
    assert gaps and max(gaps) <= TOL, gaps

    exported = run / "hf"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "gemma3_text"
    model, trained = load_hf(exported, sharder=one_device_sharder())
    _, initial = load_hf(task.model, sharder=one_device_sharder())
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(
            (trained.embed, trained.layers.q, trained.layers.down),
            (initial.embed, initial.layers.q, initial.layers.down),
            strict=True,
        )
    )
    # an Adam step moves a weight with a gradient by about the learning rate (no warmup)
    assert cfg.optim.warmup_steps == 0 and moved >= cfg.optim.lr / 2
    tokens, mask, positions = padded_batch(model.vocab_size, T=40)
    policy = policy_of(model)
    hidden = policy.forward(
        trained, Packed(tokens, positions, mask), sharder=one_device_sharder()
    ).hidden
    ours = np.asarray(policy.logits(trained, hidden))
    theirs = hf_logits(exported, tokens, mask, positions)
    assert np.abs(ours - theirs)[mask.astype(bool)].max() <= TOL
