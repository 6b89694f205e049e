"""Several policies in one run (``policies.<name>``, `jax_agent_rl.train.policies`): what a
verifier reads and is scored against, its run's config, and the config's refusals. The runs
themselves: `tests/train/test_learning.py::test_a_solver_and_a_verifier_train_in_one_run` (it
learns) and `test_a_verifier_resumes_at_the_run_s_step` below."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli import main
from jax_agent_rl.config import ConfigError, JarlConfig, load_config
from jax_agent_rl.config.sections import PolicySection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards.math import math_reward
from jax_agent_rl.train import train
from jax_agent_rl.train.check import check_run, run_notes
from jax_agent_rl.train.policies import (
    policy_config,
    verdict_demonstrations,
    verdict_rows,
    verdict_samples,
)

REQUIRED = ["model.path=m", "data.train=t.jsonl", "policies.judge.model.path=v"]
SYSTEM = {"role": "system", "content": "Solve the problem."}


def _sample(i: int, truth: str) -> Sample:
    return Sample(f"row{i}", [SYSTEM, {"role": "user", "content": f"Q{i}?"}], truth)


def _episode(uid: str, answer: str, success: bool, stop: str = "eos") -> Episode:
    messages = [
        SYSTEM,
        {"role": "user", "content": f"question of {uid}"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "a later user message"},
        {"role": "assistant", "content": f"done: <answer>{answer}</answer>"},
    ]
    traj = Trajectory(uid, "g", [1, 2], messages=messages, stop_reason=stop)  # type: ignore[arg-type]
    return Episode(traj, 1.0 if success else 0.0, success)


def test_held_out_verdicts_pair_each_question_with_its_answer_and_another_row_s() -> None:
    samples = [_sample(0, "7"), _sample(1, "7"), _sample(2, "9")]
    rows = verdict_rows(samples, PolicySection())
    shown = [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows]
    # each wrong answer: the next row's (round the end) that differs from the right one
    assert shown == [
        (PolicySection().prompt.format(question="Q0?", answer="7"), "1"),
        (PolicySection().prompt.format(question="Q0?", answer="9"), "0"),
        (PolicySection().prompt.format(question="Q1?", answer="7"), "1"),
        (PolicySection().prompt.format(question="Q1?", answer="9"), "0"),
        (PolicySection().prompt.format(question="Q2?", answer="9"), "1"),
        (PolicySection().prompt.format(question="Q2?", answer="7"), "0"),
    ]
    assert all(r["data_source"] == "verifier" and len(r["prompt"]) == 1 for r in rows)
    # rows without a ground truth (an environment's) give none
    assert verdict_rows([_sample(3, None), _sample(4, "")], PolicySection()) == []  # type: ignore[arg-type]
    # one answer everywhere: no wrong answer to give, only the right one
    assert [
        r["reward_model"]["ground_truth"] for r in verdict_rows(samples[:2], PolicySection())
    ] == ["1", "1"]
    # the warm start's demonstrations answer each with its label, which the math reward pays
    for row, demo in zip(rows, verdict_demonstrations(rows), strict=True):
        said = demo["messages"][-1]
        assert demo["messages"][:-1] == row["prompt"] and said["role"] == "assistant"
        truth = row["reward_model"]["ground_truth"]
        assert math_reward(said["content"], truth) == 1.0
        assert math_reward(said["content"], "1" if truth == "0" else "0") == 0.0


def test_a_verifier_reads_answered_episodes_as_many_right_as_wrong() -> None:
    """A constant verdict must not pay more than half: with 3 right answers and 1 wrong the
    verifier judges 1 of each (the first ones); episodes that did not end in an answer are
    not judged, those a filter left out of the run's update are."""
    section = PolicySection(prompt="[{question}] [{answer}]")
    episodes = [
        _episode("a", "42", True),
        _episode("b", "41", False, stop="tool_error"),  # no answer: not judged
        _episode("c", "40", False, stop="max_turns"),  # cut off: not judged
        dataclasses.replace(_episode("d", "39", True), filtered_by="overlong"),
        _episode("e", "38", False),
        _episode("f", "37", True),
    ]
    samples = verdict_samples(episodes, section)
    assert [(s.uid, s.ground_truth) for s in samples] == [("a", "1"), ("e", "0")]
    # the question: the user message before the first model turn; the answer: the final one's
    assert [s.messages for s in samples] == [
        [{"role": "user", "content": "[question of a] [42]"}],
        [{"role": "user", "content": "[question of e] [38]"}],
    ]
    assert verdict_samples(episodes[:1], section) == []  # one kind only: nothing to judge
    failed = dataclasses.replace(episodes[4], reward_error="reward error: ...")
    assert verdict_samples([episodes[0], failed], section) == []
    # a final message without an <answer> is shown whole
    bare = _episode("g", "x", False)
    bare.traj.messages[-1] = {"role": "assistant", "content": "no tag here"}
    (_, only) = verdict_samples([episodes[0], bare], section)
    assert only.messages[0]["content"] == "[question of g] [no tag here]"


def test_wrong_held_out_answers_are_found_in_linear_time() -> None:
    """Each row's wrong answer is the next different one round the end, for 200k rows at once
    (a list rebuilt for every row took 91 s at 80k)."""
    values = [str(i // 3) for i in range(200_000)]
    samples = [_sample(i, v) for i, v in enumerate(values)]
    rows = verdict_rows(samples, PolicySection(prompt="{question}|{answer}"))
    wrong = [r["prompt"][0]["content"].split("|")[1] for r in rows[1::2]]
    assert wrong[:4] == ["1", "1", "1", "2"] and wrong[-3:] == ["66666", "0", "0"]  # (wrapped)


def test_a_policy_runs_as_a_run_of_its_own_with_the_run_s_other_settings() -> None:
    cfg: JarlConfig = load_config(
        Path("configs/demo_calculator_cpu.yaml"),
        [
            *REQUIRED,
            "data.val=v.jsonl",
            "trainer.run_dir=/runs/x",
            "algorithm.adv_estimator=gigpo",
            "algorithm.turn_mode=per_turn",
            "algorithm.router_aux_loss_coef=0.01",  # the run's model's router
            "policies.judge.optim.lr=2e-5",
            "policies.judge.n=3",
            "policies.judge.sft.steps=10",
        ],
    )
    own = policy_config(cfg, "judge", cfg.policies["judge"])
    folder = Path("/runs/x/policies/judge")
    assert own.trainer.run_dir == str(folder) and own.policies == {}
    assert (own.model.path, own.optim.lr, own.group.n) == ("v", 2e-5, 3)
    assert own.data.val_size == 0  # two rows a held-out question: every one
    assert own.sft.data == str(folder / "sft.jsonl") and own.sft.steps == 10  # made from data.train
    assert own.data.val == str(folder / "val.jsonl") and own.data.reward == "math"
    assert own.tools.config == str(folder / "tools.yaml") and own.agent.max_turns == 1
    assert own.algorithm.adv_estimator == "grpo" and own.algorithm.turn_mode == "trajectory"
    assert (own.engine, own.sampling, own.learner) == (cfg.engine, cfg.sampling, cfg.learner)
    assert own.algorithm.clip_high == cfg.algorithm.clip_high
    assert own.algorithm.router_aux_loss_coef == 0.0  # the run's is its model's router's


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["policies.a/b.model.path=v"], "policies.a/b: a policy's name is 1-64 letters"),
        (['policies.judge.prompt="{question}"'], r"policies.judge.prompt fills \['question'\]"),
        (['policies.judge.prompt="{question}{answer}{answer}"'], "once each"),
        ([f"policies.judge.prompt={'x' * 5000}{{question}}{{answer}}"], "at most 4096"),
        (
            ['policies.judge.prompt="{question:>999999999}{answer}"'],
            "no conversion or format spec",
        ),
        (['policies.judge.prompt="{question.__class__}{answer}"'], "expected {question}"),
        (['policies.judge.prompt="{question}{answer} }"'], "Single '}' encountered"),
        (["policies.judge.model.lora.rank=4"], "policies.judge.model.lora.rank=4"),
        (["engine.backend=vllm"], "engine.backend=vllm: another policy trains"),
        (["policies.judge.n=0"], "policies.judge.n=0: expected >= 1"),
        (["policies.judge.n=1"], "policies.judge.n=1: a GRPO group of one sample"),
        (["policies.judge.optim.lr=-1"], "policies.judge.optim.lr=-1.0: expected > 0"),
        (
            ["policies.judge.sft.steps=5", "policies.judge.sft.batch_size=3"],
            "policies.judge.sft.batch_size=3 does not split",
        ),
        (["policies.judge.modle.path=v"], r"allowed here: \['model', 'n', 'optim', 'prompt'"),
        # wrong kinds of value inside an entry: OmegaConf's TypeError or a keyless message
        (["policies.judge=[]"], r"^policies.judge=.*: expected a section"),
        (["policies.judge.sft=3"], r"^policies.judge.sft='3': expected a section"),
        (["policies.judge.model.lora.targets={a: 1}"], "lora.targets=.*: expected a list"),
        (["policies.judge.model.exact_logprobs=2"], "exact_logprobs='2': expected true or"),
        (["policies={1: {n: 2}}"], r"^policies.1: a name \(text\) is expected as the key"),
    ],
)
def test_a_policy_s_config_is_checked_as_the_run_s(overrides: list[str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(Path("configs/demo_calculator_cpu.yaml"), [*REQUIRED, *overrides])


def test_a_missing_policy_checkpoint_is_named_before_the_run(tmp_path: Path) -> None:
    from tests.train.test_learning import WARM_STARTS, small_task

    files = small_task(tmp_path / "task", "tiny")
    cfg: JarlConfig = load_config(
        Path("configs/demo_solver_verifier_cpu.yaml"),
        [
            f"model.path={WARM_STARTS / 'tiny'}",
            f"data.train={files.train}",
            f"data.val={files.val}",
            f"sft.data={files.sft}",
            f"trainer.run_dir={tmp_path / 'run'}",
            f"policies.verifier.model.path={tmp_path / 'nowhere'}",
        ],
    )
    problems = check_run(cfg)
    assert len(problems) == 1 and problems[0].startswith("policies.verifier: model.path="), problems
    ok = dataclasses.replace(cfg, policies={})
    assert check_run(ok) == []
    fine = dataclasses.replace(cfg.policies["verifier"], model=ok.model)
    two = dataclasses.replace(cfg, policies={"verifier": fine})
    assert check_run(two) == []
    assert "policies: other policies train in a run of one process, not 2" in check_run(
        two, processes=2
    )
    # the dry run says what the memory plan leaves out
    (note,) = [n for n in run_notes(cfg) if n.startswith("policies.verifier:")]
    assert "not in the memory plan" in note and str(tmp_path / "run" / "policies") in note
    # its own demonstrations, and its model against the run's context and mesh, before the run
    # (they failed after the run's model had loaded), each problem said once
    short = tmp_path / "short"
    shutil.copytree(WARM_STARTS / "tiny", short)
    hf = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 64}))
    missing = dataclasses.replace(fine.sft, data=str(tmp_path / "verdicts.jsonl"))
    model = dataclasses.replace(fine.model, path=str(short))
    both = dataclasses.replace(
        cfg, policies={"verifier": dataclasses.replace(fine, sft=missing, model=model)}
    )
    assert check_run(both) == [
        "policies.verifier: engine.max_model_len=192 exceeds the model's "
        "max_position_embeddings=64: use engine.max_model_len <= 64",
        f"policies.verifier: sft.data={str(tmp_path / 'verdicts.jsonl')!r} does not exist",
    ]
    # the run's own mesh problems (its model, the device count) are not the policy's
    too_wide = dataclasses.replace(two, mesh=dataclasses.replace(cfg.mesh, tensor=4))
    problems = check_run(too_wide)
    assert any("mesh" in p for p in problems)
    assert not [p for p in problems if p.startswith("policies.")], problems


def test_a_verifier_resumes_at_the_run_s_step(tmp_path: Path) -> None:
    """Its hooks run before the run's, so a run killed between the two checkpoints of a step
    has the verifier's and not the run's: the rerun restores the verifier at the run's step
    (here: the run's checkpoint of step 2 removed), and both go on from there."""
    from tests.train.test_learning import SMALL_OVERRIDES, WARM_STARTS, small_task

    files = small_task(tmp_path / "task", "tiny")
    run = tmp_path / "run"
    overrides = [
        *SMALL_OVERRIDES,
        f"model.path={WARM_STARTS / 'tiny'}",
        f"data.train={files.train}",
        "data.val=",
        "sft.data=",
        f"tools.config={files.tools}",
        f"trainer.run_dir={run}",
        "trainer.steps=2",
        "trainer.save_every=1",
        "trainer.keep_checkpoints=3",
        "data.prompts_per_step=2",
        "group.n=2",
        "engine.warmup=false",
        f"policies.verifier.model.path={WARM_STARTS / 'tiny'}",
        "policies.verifier.n=2",
    ]
    cfg: JarlConfig = load_config(Path("configs/demo_calculator_cpu.yaml"), overrides)
    train(cfg)
    verifier = run / "policies" / "verifier"
    # a policy added to a run past its start is refused, naming it (it has no checkpoint there)
    late = [*overrides, f"policies.late.model.path={WARM_STARTS / 'tiny'}", "policies.late.n=2"]
    with pytest.raises(ConfigError, match=r"^policies.late: the run resumes at step 2 and"):
        train(load_config(Path("configs/demo_calculator_cpu.yaml"), late))
    stale = (verifier / "checkpoints" / "2").stat().st_mtime_ns
    shutil.rmtree(run / "checkpoints" / "2")
    train(cfg)
    assert _train_steps(run) == [1, 2, 2]  # step 2 done again
    # the verifier's checkpoint of step 2 is the redone step's (orbax saves no step at or below
    # its latest: the killed attempt's stayed, to be paired with the run's new one)
    assert (verifier / "checkpoints" / "2").stat().st_mtime_ns > stale
    for folder in (run, verifier):
        assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["0", "1", "2"]
        assert json.loads((folder / "hf" / "config.json").read_text())["model_type"] == "qwen2"
    # its folder is a run of its own for the tools that read one
    assert main(["view", str(verifier), "--out", str(tmp_path / "view")]) == 0
    assert "verifier" in (tmp_path / "view" / "index.html").read_text()


def _train_steps(run: Path) -> list[int]:
    """The steps of every train record, a step done twice (resumed) twice."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["phase"] == "train"]
