"""Console lines and plots of a run: one plain line a step, the equal-rewards warning with its
group count, steps that include compilation kept out of the throughput plot, and the reward
plot's held-out evaluations drawn as points and its (often equal) train curves both visible."""

import json
from pathlib import Path

import numpy as np

from jax_agent_rl.train.learn import reward_groups
from jax_agent_rl.train.metrics import (
    INCLUDES_COMPILE,
    equal_rewards_warning,
    plot_run,
    reward_figure,
    step_line,
    throughput_records,
)

STEP = {
    "reward": 0.4375,
    "success": 0.375,
    "time/rollout_tokens_per_s": 1234.56,
    "time/step_s": 12.345,
    INCLUDES_COMPILE: 0.0,
    "batch/groups": 4,
    "batch/groups_all_equal": 1,
}


def test_reward_groups_counts_groups_whose_rewards_are_all_equal() -> None:
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 2.0])
    gids = ["a", "a", "b", "b", "c", "c", "d", "d", "d", "e"]  # e: a group of one
    assert reward_groups(rewards, gids) == {"batch/groups": 5, "batch/groups_all_equal": 4}
    assert reward_groups(np.array([0.0, 1.0]), ["a", "a"])["batch/groups_all_equal"] == 0
    assert reward_groups(np.array([]), []) == {"batch/groups": 0, "batch/groups_all_equal": 0}


def test_step_line_reports_the_step() -> None:
    assert step_line(3, 24, STEP) == (
        "step 3/24  reward 0.438  success 0.375  rollout 1235 tok/s  12.3 s/step"
    )
    first = step_line(1, 24, {**STEP, INCLUDES_COMPILE: 1.0, "val/success": 0.5})
    assert first.endswith("12.3 s/step (compiling)  held-out 0.500")


def test_the_line_warns_when_every_group_has_equal_rewards() -> None:
    assert equal_rewards_warning(STEP) is None
    assert equal_rewards_warning({**STEP, "batch/groups": 0, "batch/groups_all_equal": 0}) is None
    flat = {**STEP, "batch/groups_all_equal": 4}
    warning = "WARNING: rewards equal within all 4 groups, zero GRPO advantage"
    assert equal_rewards_warning(flat) == warning
    assert step_line(2, 24, flat).endswith("12.3 s/step  " + warning)
    assert step_line(2, 24, flat, grpo=False).endswith("12.3 s/step")  # GAE: a critic's advantages


def test_throughput_plot_leaves_out_steps_that_compile(tmp_path: Path) -> None:
    train = [
        {"step": 1, INCLUDES_COMPILE: 1.0, "time/rollout_tokens_per_s": 10.0},
        {"step": 2, INCLUDES_COMPILE: 0.0, "time/rollout_tokens_per_s": 900.0},
        {"step": 3, INCLUDES_COMPILE: 1.0, "time/rollout_tokens_per_s": 12.0},  # resumed
        {"step": 4, INCLUDES_COMPILE: 0.0, "time/rollout_tokens_per_s": 950.0},
    ]
    assert [r["step"] for r in throughput_records(train)] == [2, 4]
    records = [{"phase": "train", "reward": 0.0, "success": 0.0, **r} for r in train]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "throughput.png"]


def test_the_reward_plot_draws_evaluations_as_points_and_equal_train_curves_apart() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [{"step": s, "reward": 0.5, "success": 0.5} for s in range(1, 9)]  # equal curves
    val = [{"step": 0, "success": 0.25}, {"step": 8, "success": 0.75}]
    fig = reward_figure(train, val)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    held_out = lines["held-out success"]
    assert held_out.get_linestyle() == "None" and held_out.get_marker() not in ("None", "", None)
    assert list(held_out.get_xdata()) == [0, 8] and list(held_out.get_ydata()) == [0.25, 0.75]
    reward, success = lines["train reward"], lines["train success"]
    assert list(reward.get_ydata()) == list(success.get_ydata())
    assert reward.get_linestyle() != success.get_linestyle()
    assert reward.get_linewidth() > success.get_linewidth()  # the wider one under the other
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["train reward", "train success", "held-out success"]
    plt.close(fig)
