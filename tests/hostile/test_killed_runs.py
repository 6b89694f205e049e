"""A run killed while it writes its logs, then resumed: the record it was writing is cut short
(a trace record of tens of kilobytes takes several writes, and SIGKILL lands between them),
and the resumed run appends after it. What the run writes stays readable: the cut line is
dropped before anything is appended (its step is redone: the checkpoint after it was never
written), so `jarl view`, `jarl traces` and the run's own plots read every complete record."""

from __future__ import annotations

import json
from pathlib import Path

from jax_agent_rl.train.metrics import MetricsLog, read_metrics
from jax_agent_rl.train.traces import append_traces, read_traces
from tests.train.test_view import hostile_record


def _cut_short(path: Path, record: dict[str, object]) -> None:
    """What a process killed halfway through writing ``record`` as a line leaves."""
    line = json.dumps(record)
    with path.open("a", encoding="utf-8") as f:
        f.write(line[: len(line) // 2])


def test_a_trace_record_cut_by_a_kill_is_dropped_when_the_run_resumes(tmp_path: Path) -> None:
    """Before: the redone step's records were appended to the cut line, which then held half
    a record and a whole one, and the whole file was refused ('line 2 is not valid JSON')."""
    path = tmp_path / "traces.jsonl"
    append_traces(path, [{**hostile_record("a/0", None), "step": 1}])
    _cut_short(path, {**hostile_record("a/1", None), "step": 2})
    append_traces(path, [{**hostile_record("a/1", None), "step": 2}])  # the resumed run
    assert [(r["step"], r["uid"]) for r in read_traces(path)] == [(1, "a/0"), (2, "a/1")]


def test_a_metrics_record_cut_by_a_kill_is_dropped_when_the_run_resumes(tmp_path: Path) -> None:
    """Before: the resumed run's first record joined the cut one, and reading the file (the
    run's plots at its end, the demo's summary, jarl view) raised a JSONDecodeError."""
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(1, "train", {"reward": 0.5})
    log.close()
    _cut_short(tmp_path / "metrics.jsonl", {"step": 2, "phase": "train", "reward": 0.75})
    log = MetricsLog(tmp_path, tensorboard=False)  # the resumed run
    log.write(2, "train", {"reward": 0.25})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert [(r["step"], r["reward"]) for r in records] == [(1, 0.5), (2, 0.25)]
