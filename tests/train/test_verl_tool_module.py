"""A tool module written for verl trains here unchanged, with verl's own tools YAML: the module
`tests.train.verl_gsm8k_tool` (verl's ``gsm8k_tool.py`` in shape: ``verl.tools.base_tool``,
``verl.tools.schemas``, ``verl.utils.rollout_trace``, ``verl.utils.reward_score.gsm8k``) runs
through two GRPO steps on the package's tiny demo checkpoint (``run``, tests/train/conftest.py:
SFT-taught to call the calculator, whose name and schema the YAML gives the tool), once in this
process through the `verl` shim and once in a ``jarl train`` process with the real verl
(``.verl-ref``, scripts/setup.sh verl-ref) appended to its path after the shim's finder is
installed: a real verl anywhere on the path wins, and jax_agent_rl runs beside it.

Each call's text carries what ``calc_reward`` computed (verl's ``Current parsed answer=...
reward=...``); every one must be verl's gsm8k rule applied to that answer, and the tool reward
in the trajectory the tool's improvement rule.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from rich.console import Console

from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles
from jax_agent_rl.compat.verl import shim
from jax_agent_rl.compat.verl.rules import gsm8k_score
from jax_agent_rl.config import load_config
from jax_agent_rl.train import train
from jax_agent_rl.train.traces import TRACES_FILE, read_traces

ROOT = Path(__file__).resolve().parents[2]
VERL_REF = ROOT / ".verl-ref"
PROMPTS, N = 4, 4  # 2 products and 2 product-then-sums, 4 samples each
CALL = re.compile(r"^Current parsed answer=(.*) reward=(\S+)$")


def _tools_yaml(folder: Path, task: TaskFiles) -> Path:
    """verl's tools YAML for the module's tool, with the calculator's schema."""
    calculator = yaml.safe_load(task.tools.read_text(encoding="utf-8"))[0]["schema"]
    path = folder / "gsm8k_tool_config.yaml"
    entry = {
        "class_name": "tests.train.verl_gsm8k_tool.Gsm8kTool",
        "config": {"type": "native"},
        "tool_schema": calculator,
    }
    path.write_text(yaml.safe_dump({"tools": [entry]}), encoding="utf-8")
    return path


def _rows(folder: Path, task: TaskFiles) -> tuple[Path, dict[str, str]]:
    """Product and product-then-sum rows (the checkpoint answers sums from memory), each
    with the tool's ground truth in verl's tools_kwargs: the last operand of the row's first
    calculator step (verl's flexible gsm8k rule reads the last number submitted, so a call that
    copies that step scores 1, a later one 0). Returns the file and the tool's ground truth by
    question."""
    rows = [json.loads(line) for line in task.train.read_text(encoding="utf-8").splitlines()]
    picked = [r for r in rows if r["extra_info"]["kind"] == "mul"][:2]
    picked += [r for r in rows if r["extra_info"]["kind"] == "chain"][:2]
    truths = {}
    for row in picked:
        truth = row["extra_info"]["steps"][0].split()[-1]
        create = {"create_kwargs": {"ground_truth": truth}}
        row["extra_info"]["tools_kwargs"] = {"calculator": create}
        truths[row["prompt"][-1]["content"]] = truth
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked), encoding="utf-8")
    return path, truths


def _args(run: tuple[Path, str], task: TaskFiles, folder: Path) -> tuple[list[str], dict[str, str]]:
    train_file, truths = _rows(folder, task)
    args = [
        f"model.path={run[0] / 'hf'}", f"data.train={train_file}", "data.val=", "sft.steps=0",
        f"tools.config={_tools_yaml(folder, task)}", f"trainer.run_dir={folder / 'run'}",
        f"data.prompts_per_step={PROMPTS}", f"group.n={N}", "engine.max_concurrent=4",
        "engine.max_model_len=192", "agent.max_response_tokens=128",
        "agent.max_tool_response_tokens=64", "engine.warmup=false",
        "learner.micro_batch_size=4", "learner.row_tokens=512", "trainer.steps=2",
        "trainer.save_every=2", "trainer.eval_every=0", "trainer.tensorboard=false",
        f"trainer.traces_per_step={PROMPTS * N}",
    ]  # fmt: skip
    return args, truths


def _tool_calls(run_dir: Path, truths: dict[str, str]) -> list[tuple[str, float]]:
    """(answer, reward) of every call of both steps' trajectories, each checked against verl's
    gsm8k rule and the tool's improvement rule (the half-trained checkpoint cuts many calls
    off: those never reach the tool)."""
    shim.install()  # the tool module imports verl.* (the one-liner of a script of one's own)
    from tests.train.verl_gsm8k_tool import IMPROVEMENT_PENALTY

    records = read_traces(run_dir / TRACES_FILE)
    assert sorted({r["step"] for r in records}) == [1, 2] and len(records) == 2 * PROMPTS * N
    calls = []
    for record in records:
        truth = truths[next(m["content"] for m in record["messages"] if m["role"] == "user")]
        tool_texts = [m["content"] for m in record["messages"] if m["role"] == "tool"]
        assert len(tool_texts) == record["tool_calls"] == len(record["turn_rewards"])
        best = 0.0
        for text, tool_reward in zip(tool_texts, record["turn_rewards"], strict=True):
            if text.startswith("error: the tool call was cut off"):
                assert tool_reward == 0.0  # a malformed call never reaches the tool
                continue
            match = CALL.match(text)
            assert match, text
            answer, reward = ast.literal_eval(match[1]), float(match[2])
            assert reward == gsm8k_score("#### " + answer, truth, method="flexible")
            assert tool_reward == (0.0 if reward > best else IMPROVEMENT_PENALTY)
            best = reward
            calls.append((answer, reward))
    return calls


def test_a_verl_tool_module_trains_through_the_shim(
    run: tuple[Path, str], task: TaskFiles, tmp_path: Path
) -> None:
    args, truths = _args(run, task, tmp_path)
    train(load_config(DEMO_CONFIG, args), Console(file=io.StringIO(), force_terminal=False))
    calls = _tool_calls(tmp_path / "run", truths)
    assert calls  # the checkpoint calls the tool; each call scored as verl scores it
    assert sys.modules["verl.utils.reward_score.gsm8k"].compute_score is gsm8k_score


def test_the_same_module_trains_with_the_real_verl(
    run: tuple[Path, str], task: TaskFiles, tmp_path: Path
) -> None:
    assert (VERL_REF / "verl").is_dir(), "no real verl in .verl-ref: run scripts/setup.sh verl-ref"
    args, truths = _args(run, task, tmp_path)
    # jarl train, the real verl appended to sys.path only after the shim's finder is on (as
    # loading the tool YAML turns it on); first it says which verl the tool module will import
    script = (
        "import sys, jax_agent_rl.compat.verl.shim as shim; shim.install(); "
        f"sys.path.append({str(VERL_REF)!r}); "
        "import verl, verl.utils.reward_score.gsm8k as g; print('verl from', verl.__file__); "
        "from jax_agent_rl.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script, "train", str(DEMO_CONFIG), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"verl from {VERL_REF / 'verl/__init__.py'}" in done.stdout
    assert _tool_calls(tmp_path / "run", truths)
