"""A run folder read into what the page shows: one JSON-ready dict, all text made visible.

Each trace record (`jax_agent_rl.train.traces`) becomes a trajectory of tokens, each token
``[text, role, rollout logprob, learner logprob, advantage, weight version, learner
entropy, experts]``: role ``s``
(sampled, mask 1), ``t`` (a tool's output: inside a tool message's text) or ``p`` (template
or prompt scaffolding given to the model). Text goes through `visible` (escape sequences
shown, never obeyed); a non-finite number becomes the string ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (JSON has no such numbers; the page reads them back with ``Number``).
``experts``: a MoE policy's sampled token's experts (`expert_text`), else ``""``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_agent_rl.console.visible import visible
from jax_agent_rl.train.metrics import read_metrics
from jax_agent_rl.train.traces import NOT_A_RECORD, TRACES_FILE, read_traces, whole_step

PLOTS = ("reward.png", "throughput.png")  # the run's plots (train/metrics.py), linked
METRICS_FILE = "metrics.jsonl"
# the step metrics the step list shows, when the run has them
STEP_METRICS = (
    "reward",
    "success",
    "loss",
    "logprob_gap/mean",
    "staleness/max",
    "batch/trajectories",
    "time/step_s",
)


def finite(x: float | None) -> float | str | None:
    """``x`` for JSON: non-finite values as the strings JavaScript's ``Number`` reads."""
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def roles(pieces: Sequence[str], mask: Sequence[int], messages: Sequence[dict[str, Any]]) -> str:
    """One letter per token (see the module docstring): mask-0 tokens whose text lies inside
    a tool message's content are ``t``, in message order. Linear in the tokens and the tool
    messages: each span's tokens are walked once, from one tool text found to the next (a
    walk over the whole span for each made 100,000 one-character tool messages minutes)."""
    tool_texts = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
    out = ["s" if m else "p" for m in mask]
    start, next_text = 0, 0
    while start < len(pieces):
        end = start
        while end < len(pieces) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            text = "".join(pieces[start:end])
            ends = [0]  # ends[k]: where the span's token start + k - 1 ends in text
            for piece in pieces[start:end]:
                ends.append(ends[-1] + len(piece))
            at, first = 0, start  # first: the first token that may overlap a later hit
            while (
                next_text < len(tool_texts)
                and tool_texts[next_text]
                and (hit := text.find(tool_texts[next_text], at)) >= 0
            ):
                stop = hit + len(tool_texts[next_text])
                next_text += 1
                while first < end and ends[first - start + 1] <= hit:
                    first += 1
                i = first
                while i < end and ends[i - start] < stop:  # the tokens overlapping the hit
                    out[i] = "t"
                    i += 1
                at = stop
        start = end
    return "".join(out)


def expert_text(experts: Sequence[Sequence[int]] | None) -> str:
    """A token's experts as the page shows them, one group per sparse layer (``"3 5 | 0 7"``);
    ``""`` for none (a dense policy's token, or one the model did not sample)."""
    if not experts or any(i < 0 for layer in experts for i in layer):
        return ""
    return " | ".join(" ".join(str(int(i)) for i in layer) for layer in experts)


def message_blocks(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation as blocks: role, text and, for an assistant turn, its tool calls."""
    blocks = []
    for m in messages:
        calls = m.get("tool_calls")
        blocks.append(
            {
                "role": visible(str(m.get("role", ""))),
                "text": visible(str(m.get("content") or "")),
                "calls": visible(json.dumps(calls, ensure_ascii=False)) if calls else "",
            }
        )
    return blocks


def trajectory(record: dict[str, Any]) -> dict[str, Any]:
    """One trace record as the page reads it (see the module docstring)."""
    pieces, mask = record["response_pieces"], record["loss_mask"]
    n = len(pieces)
    # written before these were recorded, or by a step that did not train the trajectory
    learner = record.get("learner_logprobs") or [None] * n
    advantages = record.get("advantages") or [None] * n
    entropy = record.get("learner_entropy") or [None] * n
    versions = record.get("token_versions") or [-1] * n
    experts = record.get("expert_ids") or [None] * n
    kinds = roles(pieces, mask, record["messages"])
    tokens = [
        [
            visible(pieces[i]),
            kinds[i],
            finite(record["rollout_logprobs"][i]),
            finite(learner[i]),
            finite(advantages[i]),
            int(versions[i]),
            finite(entropy[i]),
            expert_text(experts[i]),
        ]
        for i in range(n)
    ]
    # whole numbers: an infinite version (JSON reads "Infinity") made the staleness one the
    # page's JSON refused, naming no file (int() of it raises: a record of the wrong shape)
    sampled = [int(v) for v in record["weight_versions"] if v >= 0]
    group = str(record["group_id"])
    return {
        "step": record["step"],
        "uid": visible(str(record["uid"])),
        "group": visible(group),
        # a prompt's id is "<data source>-<row>" (jax_agent_rl.data)
        "source": visible(group.rsplit("-", 1)[0]),
        "reward": finite(float(record["reward"])),
        "stop": visible(str(record["stop_reason"])),
        "filter": visible(str(record["filtered_by"] or "")),
        "forked_from": visible(str(record["forked_from"])) if record["forked_from"] else None,
        # a record's step counts the steps done: it trained the policy of version step - 1
        "staleness": record["step"] - 1 - min(sampled) if sampled else 0,
        # counts as whole numbers: a value passed through as read (a list nested as deep as
        # the reader reads) failed to encode into the page
        "turns": int(record["num_turns"]),
        "tool_calls": int(record["tool_calls"]),
        "error": visible(record["error"] or ""),
        "prompt": visible(record["prompt_text"]),
        "tokens": tokens,
        "blocks": message_blocks(record["messages"]),
        "trained": any(v is not None for v in learner),
    }


def pick_steps(available: Sequence[int], spec: str | None, last: int) -> list[int]:
    """The steps of ``available`` that ``spec`` names: ``"7"``, ``"10:20"`` (both included),
    ``"10:"`` or ``":20"``; without one, the ``last`` latest (a long run's traces would make a
    page no browser opens). Raises ValueError for a malformed ``spec``."""
    steps = sorted(set(available))
    if spec is None:
        return steps[-last:]
    lo_text, sep, hi_text = spec.partition(":")
    try:
        lo = int(lo_text) if lo_text.strip() else None
        hi = int(hi_text) if hi_text.strip() else None
    except ValueError:
        raise ValueError(f"--steps {spec!r}: expected N, A:B, A: or :B (whole numbers)") from None
    if not sep:
        hi = lo
    return [s for s in steps if (lo is None or s >= lo) and (hi is None or s <= hi)]


def run_data(run_dir: Path, steps: str | None = None, last: int = 50) -> dict[str, Any]:
    """Everything the page of ``run_dir`` shows: its trajectories (of the steps `pick_steps`
    picks), step metrics and plots, and how many trace records were ``skipped``
    (`whole_step`). Raises ValueError naming the file for a traces or metrics file that is not
    this project's (a record missing a field or holding a value of another type, a line cut by
    a killed run)."""
    read = read_traces(run_dir / TRACES_FILE)
    records = [r for r in read if whole_step(r)]
    shown = set(pick_steps([r["step"] for r in records], steps, last))
    try:
        trajectories = [trajectory(r) for r in records if r["step"] in shown]
    except NOT_A_RECORD as e:
        raise ValueError(f"{run_dir / TRACES_FILE}: a record is not a trace record ({e!r})") from e
    metrics_path = run_dir / METRICS_FILE
    table = {}
    try:
        for m in read_metrics(metrics_path, "train") if metrics_path.is_file() else []:
            if not whole_step(m):  # a NaN or infinite step: no JSON the page can hold
                raise ValueError(f"step {m['step']!r} is not a whole number")
            table[m["step"]] = {k: finite(m[k]) for k in STEP_METRICS if k in m}
        step_rows = [{"step": s, **v} for s, v in sorted(table.items())]
    except NOT_A_RECORD as e:
        raise ValueError(f"{metrics_path}: a record is not a metrics record ({e!r})") from e
    return {
        "run": visible(run_dir.resolve().name),
        "plots": [p for p in PLOTS if (run_dir / p).is_file()],
        "steps": step_rows,
        "trajectories": trajectories,
        "traced_steps": sorted(shown),
        "skipped": len(read) - len(records),
    }
