"""Run metrics: one JSON line per record in ``metrics.jsonl``, the same scalars in TensorBoard,
PNG plots of reward and throughput drawn from the JSONL at the end of a run, and the plain
one-line summary of a step that goes to the console when it is not a terminal (a log file).

The first RL step of a process compiles the engine and the learner step, so its times measure
compilation, not throughput: it is marked with ``time/includes_compile = 1`` and left out of
the throughput plot."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax_agent_rl.files import drop_cut_line

INCLUDES_COMPILE = "time/includes_compile"


class MetricsLog:
    """Appends ``{"step": s, "phase": p, **scalars}`` records; TensorBoard tags are
    ``phase/name``. Appending (not truncating) keeps the history of a resumed run, after its
    last complete line (`drop_cut_line`). Not ``enabled`` (every process of a multi-process
    run but the first), it writes nothing."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        if enabled:
            drop_cut_line(self.path)
            self._file = self.path.open("a")
        self._tb = None
        if tensorboard and enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, phase: str, scalars: Mapping[str, float]) -> None:
        if self._file is None:
            return
        clean = {k: float(v) for k, v in scalars.items() if math.isfinite(float(v))}
        self._file.write(json.dumps({"step": step, "phase": phase, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{phase}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path, phase: str | None = None) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` (of one phase); for a step logged twice (a resumed run
    redoing it), the last record wins."""
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if phase is None or r["phase"] == phase:
                by_key[(r["phase"], r["step"])] = r
    return sorted(by_key.values(), key=lambda r: (r["phase"], r["step"]))


def equal_rewards_warning(m: Mapping[str, float]) -> str | None:
    """The warning for a step in which every trained group's rewards were equal (GRPO's
    advantages, reward minus group mean, are then zero everywhere: the step learns nothing)."""
    groups = int(m["batch/groups"])
    if groups == 0 or m["batch/groups_all_equal"] < groups:
        return None
    return f"WARNING: rewards equal within all {groups} groups, zero GRPO advantage"


def step_line(step: int, steps: int, m: Mapping[str, float], grpo: bool = True) -> str:
    """One plain line for a finished RL step: reward, success, rollout tokens/s, step time,
    and with ``grpo`` advantages the equal-rewards warning (a critic's advantages, GAE, are
    not zeroed by equal rewards)."""
    parts = [
        f"step {step}/{steps}",
        f"reward {m['reward']:.3f}",
        f"success {m['success']:.3f}",
        f"rollout {m['time/rollout_tokens_per_s']:.0f} tok/s",
        f"{m['time/step_s']:.1f} s/step" + (" (compiling)" if m[INCLUDES_COMPILE] else ""),
    ]
    if "val/success" in m:
        parts.append(f"held-out {m['val/success']:.3f}")
    warning = equal_rewards_warning(m) if grpo else None
    if warning is not None:
        parts.append(warning)
    return "  ".join(parts)


def throughput_records(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The train records whose times measure throughput: not those that include compilation."""
    return [r for r in train if not r.get(INCLUDES_COMPILE, 0)]


def reward_figure(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> Any:
    """The figure of ``reward.png``: train reward and success per step as lines (often equal:
    a wide solid line under a narrow dashed one keeps both visible), held-out success as
    markers only at the evaluated steps (nothing was measured between them)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["reward"] for r in train], "-", lw=3.0, alpha=0.5, label="train reward")
        ax.plot(steps, [r["success"] for r in train], "--", lw=1.2, label="train success")
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["success"] for r in val],
            linestyle="None",
            marker="D",
            markersize=7,
            label="held-out success",
        )
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if train or val:  # (a run with neither, SFT alone, has no line to name)
        ax.legend()
    ax.set_title("reward")
    fig.tight_layout()
    return fig


def plot_run(run_dir: Path) -> list[Path]:
    """``reward.png`` (`reward_figure`) and ``throughput.png`` (tokens/s and the step-time
    breakdown, steps that include compilation left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = read_metrics(run_dir / "metrics.jsonl", "train")
    val = read_metrics(run_dir / "metrics.jsonl", "val")
    fig = reward_figure(train, val)
    written = [run_dir / "reward.png"]
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if train:
        timed = throughput_records(train)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        steps = [r["step"] for r in timed]
        a1.plot(steps, [r.get("time/rollout_tokens_per_s", 0) for r in timed], label="rollout")
        a1.plot(steps, [r.get("time/train_tokens_per_s", 0) for r in timed], label="train")
        a1.set_title("tokens / s (steps with compilation left out)")
        a1.set_xlabel("RL step")
        a1.legend()
        bottom = [0.0] * len(timed)
        for part in ("rollout_s", "train_s", "weight_push_s"):
            values = [r.get(f"time/{part}", 0.0) for r in timed]
            a2.bar(steps, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        a2.set_title("step time (s)")
        a2.set_xlabel("RL step")
        a2.legend()
        fig.tight_layout()
        written.append(run_dir / "throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
