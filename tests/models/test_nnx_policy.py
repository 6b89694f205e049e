"""A Flax NNX module trained through the model seam (`models.policy`, `models.nnx_policy`):
``jarl train`` with ``model.module`` naming examples/flax_nnx_policy/policy.py samples it on
the embedded engine (its paged KV cache) and trains it with the learner (packed rows).

Tolerance. The engine (paged prefill / ragged decode attention) and the learner (blocked
training attention) compute the same fp32 function in another order: the sampled-vs-learner
logprob gap that leaves is `FP32_LOGPROB_TOLERANCE` (1e-4), what the decoder families are
held to (tests/rl/test_learner.py); nothing in the seam may widen it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.models import Packed, Paged, Routing, init_policy, one_device_sharder
from jax_agent_rl.models.policy import UnsupportedPolicyError, policy_of
from jax_agent_rl.protocol import FP32_LOGPROB_TOLERANCE
from jax_agent_rl.train.metrics import read_metrics
from jax_agent_rl.usercode.load import load_function

ROOT = Path(__file__).resolve().parents[2]
MODULE = f"{ROOT / 'examples' / 'flax_nnx_policy' / 'policy.py'}:make_policy"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=40, n_val=4, n_sft=8)


# a reward an untrained model's episodes differ in (the groups then carry an advantage)
REWARD = (
    "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)


def overrides(task: TaskFiles, run_dir: Path) -> list[str]:
    reward = task.train.parent / "digits.py"
    reward.write_text(REWARD)
    return [
        f"model.path={task.model}", f"model.module={MODULE}", f"data.train={task.train}",
        f"data.reward={reward}:score",
        "data.val=", "sft.steps=0", f"tools.config={task.tools}", f"trainer.run_dir={run_dir}",
        "data.prompts_per_step=4", "group.n=4", "engine.max_model_len=128",
        "agent.max_response_tokens=48", "agent.max_tokens_per_turn=24",
        "trainer.steps=2", "trainer.save_every=2", "trainer.eval_every=0",
        "trainer.tensorboard=false", "engine.warmup=false",
    ]  # fmt: skip


def test_jarl_train_trains_a_flax_nnx_module(task: TaskFiles, tmp_path: Path) -> None:
    """Two RL steps: the sampler's logprobs are the learner's within the fp32 tolerance, and
    the parameters move (the update reaches the module's weights)."""
    run_dir = tmp_path / "run"
    assert main(["train", str(DEMO_CONFIG), *overrides(task, run_dir)]) == 0
    steps = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["batch/trajectories"] == 16
        assert 0 <= r["logprob_gap/max"] <= FP32_LOGPROB_TOLERANCE, r["logprob_gap/max"]
        assert r["grad_norm"] > 0
    # its checkpoint evaluates through the same module (before: restored as the HF decoder
    # of model.path's folder); it has no HF layout to export, which is said by name
    report = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), f"data.val={task.val}", "--out", str(report)]) == 0
    assert json.loads(report.read_text())["step"] == 2
    assert main(["export", str(run_dir)]) == 2


def test_a_module_policy_needs_only_a_tokenizer_folder(
    task: TaskFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.path is then only the tokenizer's folder: `jarl train --dry-run` checks the
    module's model (its memory plan printed) with no checkpoint there (before: refused as a
    folder without config.json, and the plan was that of the folder's decoder); `jarl plan`
    says by name that it compiles the checkpoint families only."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for f in task.model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    assert not (folder / "config.json").exists()
    argv = [*overrides(task, tmp_path / "r"), f"model.path={folder}"]
    assert main(["train", str(DEMO_CONFIG), *argv, "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "# ok:" in err and "memory per device" in err, err[-2000:]
    assert main(["plan", str(DEMO_CONFIG), *argv, "--topology", "v5e:2x2"]) == 2
    assert "jarl plan compiles the checkpoint families" in capsys.readouterr().err


def test_the_engine_and_the_learner_compute_the_same_logits() -> None:
    """The module's paged forward (a prefill chunk, then one decode step) against its training
    forward over the whole sequence: the same logits within fp32 rounding."""
    from jax_agent_rl.engine import Engine

    policy = load_function(MODULE, "model.module")(300)
    sharder = one_device_sharder()
    w = init_policy(jax.random.key(0), policy, sharder)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (1, 13)), jnp.int32)
    rows = Packed(tokens, jnp.arange(13)[None], jnp.ones_like(tokens))
    h = policy.forward(w, rows, sharder=sharder).hidden
    want = policy.logits(w, h)
    engine = Engine(
        policy, max_concurrent_decodes=2, max_len=64, page_size=8, prefill_chunk=16, sharder=sharder
    )
    assert engine.policy is policy and engine.cfg is policy.cfg
    served = engine.load_params(w)
    pages = engine.abstract_decode_state().pages
    cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), pages)
    table = jnp.arange(engine.pages_per_seq, dtype=jnp.int32)[None]
    prefill = Paged(tokens[:, :12], cache, table, jnp.array([0]), jnp.array([12]), pages_read=2)
    out = policy.forward(served, prefill, sharder=sharder)
    h, cache = out.hidden, out.cache
    decode = Paged(tokens[:, 12:], cache, table, jnp.array([12]), jnp.array([1]))
    h1 = policy.forward(served, decode, sharder=sharder).hidden
    got = jnp.concatenate([policy.logits(served, h), policy.logits(served, h1)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_what_a_module_policy_does_not_support_is_refused_by_name(
    task: TaskFiles, tmp_path: Path
) -> None:
    base = overrides(task, tmp_path / "r")
    for bad, named in (
        ("model.lora.rank=4", "model.lora.rank=4"),
        ("engine.backend=vllm", "engine.backend=vllm"),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator=gae"),
        ("engine.ray.address=auto", "engine.ray.address=auto"),
        ("model.module=policy.py", "expected path/to/file.py:function"),
        (f"sft.steps=4 sft.data={task.sft} mesh.data=2", "sft.steps=4"),  # SFT: one device
    ):
        with pytest.raises(ConfigError, match=named):
            load_config(DEMO_CONFIG, [*base, *bad.split()])
    policy = load_function(MODULE, "model.module")(64)
    assert policy_of(policy) is policy  # (its cfg states sizes: a bare config is a decoder)
    zeros = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(UnsupportedPolicyError, match="no experts"):
        policy.forward(
            None,
            Packed(zeros, zeros, zeros),
            sharder=one_device_sharder(),
            routing=Routing(record=True),
        )
    w = init_policy(jax.random.key(0), policy, one_device_sharder())
    with pytest.raises(UnsupportedPolicyError, match="no HF checkpoint"):
        policy.hf_tensors(w)  # (the vLLM push and an export read this table: it has none)
    # a module that returns no policy, or an object with sizes but not the methods: named at
    # the run's start, with what it lacks
    from jax_agent_rl.train import train

    (tmp_path / "not_a_policy.py").write_text(
        "import types\n"
        "from jax_agent_rl.models import ModelConfig\n"
        "def make(vocab_size):\n    return 3\n"
        "def sized(vocab_size):\n"
        "    cfg = ModelConfig('llama', vocab_size, 64, 64, 1, 2, 2, 32)\n"
        "    return types.SimpleNamespace(cfg=cfg, specs=lambda: {})\n"
    )
    for function, said in (("make", "not a policy"), ("sized", "it has no init, checked")):
        spec = f"model.module={tmp_path / 'not_a_policy.py'}:{function}"
        with pytest.raises(ConfigError, match=said):
            train(load_config(DEMO_CONFIG, [*base, spec]))


def test_a_module_with_dropout_is_told_what_to_change() -> None:
    """A module building ``nnx.Dropout(rate, rngs=rngs)`` asks for a ``dropout`` stream the
    run's Rngs do not hold: it failed with flax's ``KeyError: "No RngStream named 'dropout'
    found in Rngs."`` and nothing on what to change; built without rngs, it is taken."""
    from flax import nnx

    from jax_agent_rl.models.nnx_policy import NnxPolicy

    def module(dropout: Any) -> Any:
        class WithDropout(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.embed = nnx.Embed(16, 8, rngs=rngs)
                self.drop = dropout(rngs)

        return WithDropout

    sizes = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1)
    sizes.update(head_dim=8, max_len=32)
    with pytest.raises(UnsupportedPolicyError, match=r"leave dropout out of it, or build it"):
        NnxPolicy(module(lambda rngs: nnx.Dropout(0.1, rngs=rngs)), **sizes)
    NnxPolicy(module(lambda _: nnx.Dropout(0.1, deterministic=True)), **sizes)
