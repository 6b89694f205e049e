"""``jarl eval``: the held-out evaluation of a run's saved weights equals the training run's
own for the same weights; an HF export of them is the same weights; sampled evaluation reports
pass@k; a bad input is one line and exit code 2. Each evaluation builds (compiles) an engine:
two do here."""

import itertools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.train.evaluation import eval_target, load_policy, pass_at_k, pass_ks
from jax_agent_rl.train.metrics import read_metrics
from tests.train.conftest import STEPS

# held-out greedy evaluations: optimized code pays (compiled at O0 the file took 100 s of a
# suite run's CPU, 84 s optimized)
pytestmark = pytest.mark.compute_bound


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_success(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in pass_ks(n):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is mean@n
    assert pass_ks(1) == [1] and pass_ks(5) == [1, 2, 4, 5] and pass_ks(8) == [1, 2, 4, 8]


def test_jarl_eval_equals_the_training_runs_held_out_evaluation(
    run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    val = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl", "val")}
    assert sorted(val) == [0, STEPS]
    expected = {k: v for k, v in val[STEPS].items() if k not in ("step", "phase")}
    assert any(k.startswith("success/") for k in expected)

    assert main(["eval", str(run_dir), "--step", str(STEPS)]) == 0
    out = capsys.readouterr().out
    record = json.loads((run_dir / "eval" / f"step_{STEPS}.json").read_text())
    assert record["metrics"] == expected
    assert (record["step"], record["n"], record["sampling"]["temperature"]) == (STEPS, 1, 0.0)
    rates = record["pass_rates"]
    assert rates["all"] == {
        "prompts": 16.0,
        "mean@1": expected["success"],
        "pass@1": expected["success"],
    }
    for source, row in rates.items():
        if source != "all":
            assert row["pass@1"] == row["mean@1"] == expected[f"success/{source}"]
    assert "pass@1" in out and f"wrote {run_dir / 'eval' / f'step_{STEPS}.json'}" in out
    # every episode's answer beside it (docs/verl.md: trainer.log_val_generations), whose
    # successes are the figures above
    answers_file = run_dir / "eval" / f"step_{STEPS}.answers.jsonl"
    assert record["answers"] == str(answers_file)
    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    assert len(answers) == 16 and len({a["uid"] for a in answers}) == 16
    assert sum(a["success"] for a in answers) / 16 == expected["success"]
    for a in answers:
        assert a["attempt"] == 0 and a["prompt"] and a["ground_truth"] is not None
        assert a["messages"][-1]["role"] == "assistant" or a["stop_reason"] != "eos"
        said = [m["content"] for m in a["messages"] if m["role"] == "assistant"]
        assert a["answer"] == (said[-1] if said else None)


def test_a_runs_hf_export_is_the_weights_of_its_checkpoint(run: tuple[Path, str]) -> None:
    """``--checkpoint RUN/hf`` (the trainer's export of its final policy) evaluates the
    weights ``--step 2`` does, so it reports the same figures (without a second engine)."""
    run_dir, _ = run
    saved = load_policy(eval_target(str(run_dir), step=STEPS))
    hf = load_policy(eval_target(str(run_dir), checkpoint=str(run_dir / "hf")))
    assert hf.policy == saved.policy
    for a, b in zip(jax.tree.leaves(hf.params), jax.tree.leaves(saved.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hf.tokenizer.encode("12 + 30") == saved.tokenizer.encode("12 + 30")


def test_sampled_evaluation_of_an_hf_folder_reports_pass_at_k(
    run: tuple[Path, str], tmp_path: Path
) -> None:
    """``--n 4``: four episodes per prompt at the rollout temperature, on the first four
    held-out prompts (an override of the run's config)."""
    run_dir, _ = run
    out = tmp_path / "n4.json"
    overrides = ["data.val_size=4"]
    args = ["--checkpoint", str(run_dir / "hf"), "--n", "4", "--out", str(out)]
    assert main(["eval", str(run_dir), *overrides, *args]) == 0
    record = json.loads(out.read_text())
    assert (record["prompts"], record["n"], record["step"]) == (4, 4, None)
    assert record["checkpoint"] == str(run_dir / "hf")
    assert record["sampling"]["temperature"] == 0.7  # configs/demo_calculator_cpu.yaml
    assert record["metrics"]["rollout/episodes"] == 16
    rates = record["pass_rates"]["all"]
    assert set(rates) == {"prompts", "mean@4", "pass@1", "pass@2", "pass@4"}
    assert rates["pass@1"] == pytest.approx(rates["mean@4"])
    assert rates["pass@1"] <= rates["pass@2"] <= rates["pass@4"]
    assert rates["mean@4"] == pytest.approx(record["metrics"]["success"])
    assert (
        sum(row["prompts"] for source, row in record["pass_rates"].items() if source != "all") == 4
    )
    answers = [
        json.loads(line) for line in (tmp_path / "n4.answers.jsonl").read_text().splitlines()
    ]
    assert sorted(a["attempt"] for a in answers) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert sum(a["success"] for a in answers) / 16 == pytest.approx(rates["mean@4"])


def test_bad_inputs_are_one_line_and_exit_code_2(
    run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "hf", broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "config.json").write_text("{")
    cases = {
        "no such run folder or config file": [str(tmp_path / "missing")],
        "is not a run folder: it has no config.yaml": [str(tmp_path)],
        f"has no checkpoint of step 7; saved steps: [1, {STEPS}]": [str(run_dir), "--step", "7"],
        "--n 0: samples per prompt must be at least 1": [str(run_dir), "--n", "0"],
        "--step and --checkpoint both name weights": [
            str(run_dir),
            "--step",
            "1",
            "--checkpoint",
            str(broken),
        ],
        f"--checkpoint {garbled}": [str(run_dir), "--checkpoint", str(garbled)],
        str(broken): [str(run_dir), "--checkpoint", str(broken)],
        "data.val is empty": [str(run_dir), "data.val="],
        "missing.jsonl": [str(run_dir), f"data.val={tmp_path / 'missing.jsonl'}"],
        "unknown config key": [str(run_dir), "data.vall=x.jsonl"],
    }
    for message, args in cases.items():
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("jarl: ") and message in err, (args, err)
