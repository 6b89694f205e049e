"""Learning, measured: on a smaller version of the demo task (sums and products, one call each),
a short SFT warm start on imperfect demonstrations gives a baseline that answers sums from
memory and fails them; GRPO and PPO over real multi-turn rollouts (the JAX engine, the
calculator tool) then raise held-out greedy success by a clear margin, with the demo's dense
model (GRPO also training LoRA adapters alone, the base frozen) and with a Qwen3-MoE of its
size; so does one run of each family of docs/algorithms.md: an off-policy loss and rollout
mask (CISPO + IcePop, async), step-level advantages (GiGPO, Tree-GRPO) and DPPO's trust
region; so does the compaction example, whose episodes fit the context only compacted, through
its summary turns.

The warm starts are files: tests/train/warm_starts/<demo> holds the policy exported by the
SFT-only run of `demo.small_task_sft` (600 steps of the dense model, 800 of the MoE; 2000 of
the dense model on the compaction task, `demo.compaction_task_sft`), which
scripts/learning_checkpoints.py makes, and that run's held-out success (sft.json). Running the
SFT here cost about 10 CPU-minutes of every suite run; what these tests measure is the RL on
top of it, from a policy fixed on every CPU kind (the MoE's SFT landed at 0.47 or 0.32
held-out by the rounding of its expert matmuls alone). `test_the_warm_starts_match_the_task`
fails when the task or the tokenizer changes under them.

The margin: the held-out set is 100 problems, about half of them sums that the baseline fails.
Greedy evaluation of the same problems has no sampling noise, so a rise of 0.2 means twenty
more problems solved, which only a policy that learned to call the tool on sums produces."""

import json
import random
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import (
    CALCULATOR,
    COMPACTION_OVERRIDES,
    SMALL_OVERRIDES,
    TaskFiles,
    compaction_task,
    small_task,
)
from jax_agent_rl.config import load_config
from jax_agent_rl.data.compaction import SUMMARY_ASK, SUMMARY_PREFIX, CompactionTask
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics

# 10 RL steps and two 100-problem greedy evaluations a test: optimized code pays (compiled at
# O0 the file took 669 s of a suite run's CPU, 558 s optimized)
pytestmark = pytest.mark.compute_bound

ROOT = Path(__file__).resolve().parents[2]
WARM_STARTS = ROOT / "tests" / "train" / "warm_starts"


def held_out(run_dir: Path) -> list[float]:
    return [r["success"] for r in read_metrics(run_dir / "metrics.jsonl", "val")]


# the committed warm starts (scripts/learning_checkpoints.py): the task files each was trained on
TASKS = {"tiny": small_task, "tiny-moe": small_task, "tiny-compaction": compaction_task}


def _task(folder: Path, warm_start: str) -> TaskFiles:
    demo = warm_start.removesuffix("-compaction")
    return TASKS[warm_start](folder, demo)


def _warm_start(folder: Path, demo: str) -> tuple[Path, Path]:
    """The task files in ``folder/task`` and the committed warm start ``demo``."""
    _task(folder / "task", demo)
    return folder, WARM_STARTS / demo


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _warm_start(tmp_path_factory.mktemp("learning"), "tiny")


@pytest.fixture(scope="module")
def moe_sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same, for the Qwen3-MoE of configs/moe_calculator_cpu.yaml (8 experts, 2 per token)."""
    return _warm_start(tmp_path_factory.mktemp("learning-moe"), "tiny-moe")


@pytest.fixture(scope="module")
def compaction_sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The compaction example's task (configs/demo_compaction_cpu.yaml) and warm start."""
    return _warm_start(tmp_path_factory.mktemp("learning-compaction"), "tiny-compaction")


@pytest.mark.parametrize("demo", list(TASKS))
def test_the_warm_starts_match_the_task(demo: str, tmp_path: Path) -> None:
    """The committed warm start reads the task as it is made today: its tokenizer is the one
    its task (`demo.small_task`, `demo.compaction_task`) trains, and its architecture the
    demo's (else rerun scripts/learning_checkpoints.py)."""
    files = _task(tmp_path, demo)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        made, kept = (files.model / name).read_text(), (WARM_STARTS / demo / name).read_text()
        assert made == kept, f"{name} changed: rerun scripts/learning_checkpoints.py {demo}"
    made, kept = (
        json.loads((d / "config.json").read_text()) for d in (files.model, WARM_STARTS / demo)
    )
    # (the exported policy's config names its tokens besides: pad_token_id, eos_token_id)
    assert {k: kept.get(k) for k in made} == made, (
        f"config.json changed: rerun scripts/learning_checkpoints.py {demo}"
    )


# pinned: the same groups and weight versions in every update whatever the machine's load
# (as_finished, which follows timing, learned less here on a loaded machine: docs/async.md)
ASYNC = ["trainer.max_staleness=2", "trainer.async_schedule=pinned"]
# the families of docs/algorithms.md's "Does it learn?" table, with its overrides
GIGPO = ["algorithm.adv_estimator=gigpo", "algorithm.turn_mode=per_turn"]
TREE_GRPO = [
    "algorithm.adv_estimator=tree_grpo",
    "algorithm.turn_mode=per_turn",
    "group.strategy=tree",
    "group.tree.n_roots=4",
    "group.tree.branch=2",
]
DPPO_TV = ["algorithm.policy_loss=dppo_tv", "algorithm.clip_high=0.2", "algorithm.mini_batches=2"]


def _assert_rl_raises_held_out_success(
    sft_run: tuple[Path, Path],
    config: str,
    name: str,
    extra: Sequence[str] = (),
    task: Sequence[str] = SMALL_OVERRIDES,
) -> Path:
    """10 RL steps of ``config`` (with the ``task``'s overrides, then ``extra``) from the SFT
    policy raise held-out success by 0.2; the run (folder ``name``)."""
    folder, sft_model = sft_run
    run = folder / name
    overrides = [
        *task,
        *extra,
        f"model.path={sft_model}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        f"data.val={folder / 'task' / 'val.jsonl'}",
        "sft.data=",
        "tools.config=pkg://jax_agent_rl/configs/tools_calculator.yaml",
        f"trainer.run_dir={run}",
        "trainer.steps=10",
        "trainer.eval_every=10",
        "engine.warmup=false",
    ]
    train(load_config(ROOT / "configs" / config, overrides))
    success = held_out(run)
    baseline = success[0]  # (sft.json has what its SFT run measured, on the CPU that made it)
    assert baseline < 0.75, "the SFT baseline should fail most sums"
    assert success[-1] >= baseline + 0.2, (baseline, success)
    return run


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        ("demo_calculator_cpu.yaml", []),
        ("demo_calculator_ppo_cpu.yaml", []),
        ("demo_calculator_cpu.yaml", ASYNC),  # off-policy by up to 2 versions, TIS-corrected
        ("demo_calculator_lora_cpu.yaml", []),  # rank-16 adapters on the SFT policy, base frozen
        # CISPO + IcePop on data up to 2 versions stale (IcePop masks a few stale tokens)
        ("demo_calculator_cispo_cpu.yaml", ASYNC),
        # step-level credit: anchor states shared across a group's per-turn samples
        ("demo_calculator_cpu.yaml", GIGPO),
        # per-branch advantages over tree rollouts (4 roots branching into 2)
        ("demo_calculator_cpu.yaml", TREE_GRPO),
        # DPPO's total-variation trust region in place of PPO-clip, two updates a step
        ("demo_calculator_cpu.yaml", DPPO_TV),
    ],
    ids=[
        "grpo",
        "ppo",
        "grpo-async",
        "grpo-lora",
        "cispo-icepop-async",
        "gigpo",
        "tree-grpo",
        "dppo-tv",
    ],
)
def test_rl_raises_held_out_success(
    sft_run: tuple[Path, Path], config: str, extra: list[str], request: pytest.FixtureRequest
) -> None:
    run = _assert_rl_raises_held_out_success(sft_run, config, request.node.callspec.id, extra)
    steps = read_metrics(run / "metrics.jsonl", "train")
    if extra == ASYNC:
        assert all(m["staleness/max"] <= 2 for m in steps)
    if extra in (GIGPO, TREE_GRPO):  # step-level advantages took part in every update
        assert all(m["step_adv/nonzero_frac"] > 0 for m in steps)
        assert all(m["batch/samples"] > m["batch/trajectories"] for m in steps)  # per turn
    if extra == TREE_GRPO:  # the trees branched: more leaves than the 8 prompts' 4 roots
        assert max(m["rollout/episodes"] for m in steps) > 8 * 4


def test_rl_raises_a_moe_policys_held_out_success(moe_sft_run: tuple[Path, Path]) -> None:
    """The same with a Qwen3-MoE policy (8 experts, 2 per token): GRPO through its grouped
    expert matmuls, each update replaying the experts the engine sampled with."""
    _assert_rl_raises_held_out_success(moe_sft_run, "moe_calculator_cpu.yaml", "moe")


def test_a_solver_and_a_verifier_train_in_one_run(sft_run: tuple[Path, Path]) -> None:
    """Two policies in one run (docs/agents.md, "Several policies";
    configs/demo_solver_verifier_cpu.yaml): the demo's solver and a verifier that judges each
    of its episodes twice a step (from the same warm start, 100 SFT steps on the training
    rows' answers, then GRPO on its verdicts, rewarded where it judged as the episode's
    success says). The solver learns as it does alone; the verifier's
    learner updates too (its gradients are not zero, no update skipped); each policy's
    held-out figure is in the run's metrics (the verifier's: its accuracy on held-out
    questions given their right answer and another row's), and each run folder's export loads
    alone."""
    # (configs/demo_solver_verifier_cpu.yaml: the verifier starts from model.path, the warm start)
    fewer = ["policies.verifier.n=2", "policies.verifier.sft.steps=100"]
    run = _assert_rl_raises_held_out_success(
        sft_run, "demo_solver_verifier_cpu.yaml", "solver-verifier", fewer
    )
    steps = read_metrics(run / "metrics.jsonl", "train")
    assert len(steps) == 10 and all("policies/verifier/reward" in m for m in steps)
    assert any(m["policies/verifier/grad_norm"] > 0 for m in steps)
    assert 0.0 <= steps[-1]["policies/verifier/val/success"] <= 1.0
    own = run / "policies" / "verifier"
    its = read_metrics(own / "metrics.jsonl", "train")
    assert [m["step"] for m in its] == list(range(1, 11))
    assert all(m["nonfinite_updates"] == 0 for m in its)
    # as many right answers as wrong judged each step: a constant verdict earns half
    assert all(m["rollout/episodes"] % 4 == 0 for m in its)  # (2 verdicts, 2 kinds alike)
    assert [m["step"] for m in read_metrics(own / "metrics.jsonl", "val")] == [0, 10]
    one = one_device_sharder()
    solver, judge = (load_hf(f / "hf", sharder=one)[1] for f in (run, own))
    differ = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), solver, judge)
    assert all(jax.tree.leaves(differ))  # two policies, not one
    # its run folder stands alone: jarl eval of its last checkpoint is its held-out figure
    report = run.parent / "verifier-eval.json"
    assert main(["eval", str(own), "--out", str(report)]) == 0
    held_out = read_metrics(own / "metrics.jsonl", "val")[-1]["success"]
    assert json.loads(report.read_text())["metrics"]["success"] == held_out


def test_rl_through_context_compaction_raises_held_out_success(
    compaction_sft_run: tuple[Path, Path],
) -> None:
    """The compaction example (configs/demo_compaction_cpu.yaml; docs/agents.md, "Does
    compaction learn?"): three-call chains whose episodes, written out, do not fit
    engine.max_model_len. The loop asks for a summary after the second call; the warm start's
    summary drops the running total half of the time (then it guesses), and GRPO through the
    summary turn, a trained sample of each episode, raises held-out success by 0.2. Every
    update trains the summaries (three samples an episode); each held-out problem's right
    episode written out is longer than the context, and with compaction off the trained
    policy solves next to none (it answers after the second call: only a guess can land)."""
    folder, warm_start = compaction_sft_run
    data = [f"data.{k}={folder / 'task' / f'{k}.jsonl'}" for k in ("train", "val")]
    paths = [f"model.path={warm_start}", *data, "sft.data="]
    cfg = load_config(ROOT / "configs" / "demo_compaction_cpu.yaml", paths)
    asked = (cfg.agent.context.compact_prompt, cfg.agent.context.summary_prefix)
    assert asked == (SUMMARY_ASK, SUMMARY_PREFIX)  # as the warm start's demonstrations say
    builder = TurnBuilder(
        Tokenizer.from_pretrained(warm_start), ToolRegistry.from_yaml(CALCULATOR).schemas()
    )
    right = CompactionTask(vague_summary=0.0)
    for row in right.samples(100, 0, "val"):  # the val file's rows (`compaction_task`)
        first, second = right.conversations(row, random.Random(0))
        written_out = first[:-2] + second[3:]  # (the request and the summary left out)
        assert len(builder.prompt_ids(written_out)) > cfg.engine.max_model_len
    run = _assert_rl_raises_held_out_success(
        compaction_sft_run, "demo_compaction_cpu.yaml", "compaction", task=COMPACTION_OVERRIDES
    )
    for m in read_metrics(run / "metrics.jsonl", "train"):
        # three samples an episode (e, e@1 the summary turn, e@2: docs/agents.md), the
        # odd one that answered before its second call aside
        assert m["batch/samples"] >= 2.9 * m["batch/trajectories"]
    report = run.parent / "uncompacted.json"
    assert main(["eval", str(run), "agent.context.compact=0", "--out", str(report)]) == 0
    assert json.loads(report.read_text())["metrics"]["success"] <= 0.05  # (a lucky guess)


def _short_run(folder: Path, sft_model: Path, name: str, *extra: str) -> list[dict[str, float]]:
    run = folder / name
    overrides = [
        *SMALL_OVERRIDES,
        f"model.path={sft_model}",
        f"data.train={folder / 'task' / 'train.jsonl'}",
        "data.val=",
        "sft.data=",
        "tools.config=pkg://jax_agent_rl/configs/tools_calculator.yaml",
        f"trainer.run_dir={run}",
        "trainer.traces_per_step=64",
        "engine.warmup=false",
        *extra,
    ]
    train(load_config(ROOT / "configs" / "demo_calculator_cpu.yaml", overrides))
    return read_metrics(run / "metrics.jsonl", "train")


def test_tree_rollouts_branch_after_tool_calls_within_the_budget(
    sft_run: tuple[Path, Path],
) -> None:
    """Trees of 2 roots branching twice into 2 on the SFT policy (which calls the calculator):
    they branch, every leaf is trained on, and no step exceeds its per-prompt budgets."""
    folder, sft_model = sft_run
    budget = ["group.tree.model_tokens=300", "group.tree.tool_calls=5"]
    tree = ["group.strategy=tree", "group.tree.n_roots=2", "group.tree.branch=2", *budget]
    steps = _short_run(folder, sft_model, "tree", "trainer.steps=2", *tree)
    prompts = 8
    for m in steps:
        assert m["rollout/model_tokens"] <= prompts * 300
        assert m["rollout/tool_calls"] <= prompts * 5
        assert m["rollout/episodes"] > prompts * 2  # branched: more leaves than roots
        assert m["batch/trajectories"] == m["rollout/episodes"] * (1 - m["untrainable"])
    traces = (folder / "tree" / "traces.jsonl").read_text()
    assert '"forked_from": "' in traces


def test_per_turn_samples_train_on_every_turn_of_the_same_rollouts(
    sft_run: tuple[Path, Path],
) -> None:
    """One update from the same rollouts as whole trajectories and as per-turn samples: more
    samples (one per model turn), the same episodes and rewards, and a real update."""
    folder, sft_model = sft_run
    whole = _short_run(folder, sft_model, "whole", "trainer.steps=1")
    turns = _short_run(
        folder, sft_model, "turns", "trainer.steps=1", "algorithm.turn_mode=per_turn"
    )
    (a,), (b,) = whole, turns
    assert b["batch/samples"] > a["batch/samples"] == a["batch/trajectories"]
    assert a["batch/trajectories"] == b["batch/trajectories"]
    assert a["reward"] == b["reward"]  # the same rollouts
    assert b["grad_norm"] > 0
