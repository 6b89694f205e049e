"""Every run config shipped in configs/ trains, as a user runs it, for a few steps (or in
the test that trains it further: `TRAINED_ELSEWHERE`): the real
tokenizer, model, tools and data shapes, with overrides that swap in a tiny locally written
checkpoint and tiny data of the right layout. A shipped config can never crash unnoticed again
(the GSM8K config once died at its second RL step: the KL reference shared the policy's
donated buffers).
"""

import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from rich.console import Console

from jax_agent_rl.cli.demo import DEMOS, TaskFiles, prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.train import build_run, train
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("tools_")
)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=64, n_val=8, n_sft=64)


def tiny(task: TaskFiles, run_dir: Path, steps: int) -> list[str]:
    """Overrides that keep a config's algorithm, tools, parser and reward, and shrink the rest
    to the demo's tiny checkpoint and task files."""
    return [
        f"model.path={task.model}", "model.tokenizer=", f"data.train={task.train}",
        f"data.val={task.val}", "data.val_size=4", f"sft.data={task.sft}", "sft.steps=2",
        "sft.batch_size=4", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        "trainer.eval_every=0", f"trainer.save_every={steps}", "trainer.tensorboard=false",
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "group.n=2", "data.prompts_per_step=2",
        "engine.max_model_len=192", "engine.max_concurrent=8", "agent.max_tokens_per_turn=32",
        "agent.max_response_tokens=96", "agent.max_tool_response_tokens=16",
        "learner.micro_batch_size=4", "learner.seq_bucket=64", "learner.row_tokens=512",
        "engine.warmup=false",
    ]  # fmt: skip


# configs that another test trains as shipped (apart from the model and the data's sizes), and
# checks further: to a held-out rise (test_learning), or game by game (test_envs); training
# them here for 2 steps adds nothing
TRAINED_ELSEWHERE = {
    "demo_calculator_cpu": "train/test_learning.py",
    "demo_calculator_ppo_cpu": "train/test_learning.py",
    "demo_calculator_lora_cpu": "train/test_learning.py",
    "demo_calculator_cispo_cpu": "train/test_learning.py",
    "demo_solver_verifier_cpu": "train/test_learning.py",
    "demo_compaction_cpu": "train/test_learning.py",
    "moe_calculator_cpu": "train/test_learning.py",
    "guess_number_cpu": "envs/test_envs.py",
}


def test_the_shipped_run_configs_are_all_exercised() -> None:
    names = {p.stem for p in RUN_CONFIGS}
    assert {"demo_calculator_cpu", "gsm8k_tools_qwen2.5"} <= names
    assert names >= TRAINED_ELSEWHERE.keys()
    for name, test in TRAINED_ELSEWHERE.items():
        where = ROOT / "tests" / test
        assert f'"{name}.yaml"' in where.read_text(), f"{name}: no longer trained by {test}"


@pytest.mark.parametrize(
    "config", [p for p in RUN_CONFIGS if p.stem not in TRAINED_ELSEWHERE], ids=lambda p: p.stem
)
def test_every_shipped_config_trains(config: Path, task: TaskFiles, tmp_path: Path) -> None:
    train(load_config(config, tiny(task, tmp_path, steps=2)))
    steps = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in steps)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["model_type"] == DEMOS["tiny"][0]["model_type"]


def odd_length(text: str, ground_truth: object) -> float:
    """A reward that differs between the samples of a group even for an untrained model, so
    the first update has non-zero advantages and really moves the policy."""
    del ground_truth
    return float(len(text) % 2)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_kl_to_the_reference_survives_every_step(
    estimator: str, task: TaskFiles, tmp_path: Path
) -> None:
    """With ``kl_coef > 0`` the reference model is kept beside the policy for every step (and
    beside a critic for PPO); after the first update the policy has moved, so its KL to the
    reference is positive and finite."""
    config = ROOT / "configs" / "demo_calculator_cpu.yaml"
    overrides = tiny(task, tmp_path, steps=3)
    overrides += ["algorithm.kl_coef=0.01", f"algorithm.adv_estimator={estimator}"]
    overrides += ["optim.lr=1e-2", f"data.reward={__name__}:odd_length", "group.n=4"]
    train(load_config(config, overrides))
    steps = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
    for r in steps[1:]:
        assert np.isfinite(r["kl_loss"]) and r["kl_loss"] > 0


def test_a_resumed_run_restores_its_kl_reference(task: TaskFiles, tmp_path: Path) -> None:
    """The KL reference is the policy RL starts from, after SFT. A resumed run skips SFT, so it
    must restore the reference from its checkpoint, not copy the HF checkpoint's weights."""
    config = ROOT / "configs" / "demo_calculator_cpu.yaml"
    cfg = load_config(config, [*tiny(task, tmp_path, steps=1), "algorithm.kl_coef=0.01"])
    quiet = Console(file=io.StringIO())
    fresh, fresh_state = build_run(cfg, quiet)  # SFT, then a checkpoint of step 0
    fresh.checkpoints.close()
    fresh.metrics.close()
    resumed, resumed_state = build_run(cfg, quiet)
    resumed.checkpoints.close()
    resumed.metrics.close()
    assert (fresh.start, resumed.start) == (0, 0)
    _, untrained = load_hf(task.model, sharder=one_device_sharder())
    leaves = jax.tree.leaves
    fresh_ref, resumed_ref = fresh_state.reference, resumed_state.reference
    for a, b in zip(leaves(fresh_ref), leaves(resumed_ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(hf))
        for a, hf in zip(leaves(resumed_ref), leaves(untrained), strict=True)
    )  # SFT moved the reference away from the HF weights
