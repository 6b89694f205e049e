"""Learning, measured: on a smaller version of the demo task (sums and products, one call
each), a short SFT warm start on imperfect demonstrations gives a baseline that skips the tool
on most sums; GRPO and PPO over real multi-turn rollouts (JAX engine, calculator tool) then
raise held-out greedy success by a clear margin."""

import json
from pathlib import Path

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.demo import demo_config, prepare
from jax_agent_rl.train import train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "data.val_size=64",
    "data.prompts_per_step=8",
    "rollout.n=8",
    "rollout.max_model_len=128",
    "agent.max_turns=3",
    "agent.max_response_tokens=64",
    "learner.micro_batch_size=32",
    "trainer.tensorboard=false",
]


def held_out(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["success"] for r in map(json.loads, lines) if r["phase"] == "val"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """The task files, an SFT-only run (exported to run/hf) and its held-out success."""
    folder = tmp_path_factory.mktemp("learning")
    task = ArithmeticTask(mix=(0.5, 0.5, 0.0))
    files = prepare(folder / "task", task, n_train=400, n_val=64, n_sft=1500)
    run = folder / "sft"
    train(demo_config(run, files, [*SMALL, "sft.steps=400", "trainer.steps=0"]))
    (baseline,) = held_out(run)
    return folder, run / "hf", baseline


@pytest.mark.parametrize("config", ["demo_calculator_cpu.yaml", "demo_calculator_ppo_cpu.yaml"])
def test_rl_raises_held_out_success(sft_run: tuple[Path, Path, float], config: str) -> None:
    folder, sft_model, baseline = sft_run
    run = folder / config.removesuffix(".yaml")
    overrides = [
        *SMALL,
        f"model.path={sft_model}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        f"data.val={folder / 'task' / 'val.jsonl'}",
        "sft.data=",
        f"tools.config={ROOT / 'configs' / 'tools_calculator.yaml'}",
        f"trainer.run_dir={run}",
        "trainer.steps=12",
        "trainer.eval_every=12",
    ]
    train(load_config(ROOT / "configs" / config, overrides))
    success = held_out(run)
    assert success[0] == pytest.approx(baseline)  # the same model, evaluated the same way
    assert baseline < 0.75, "the SFT baseline should fail most sums"
    assert success[-1] >= baseline + 0.15, (baseline, success)
