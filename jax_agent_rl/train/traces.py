"""Rollout traces a person can read: one JSON line per trajectory, rendered in the terminal.

A record holds the token ids, the loss mask and the sampler's logprobs of a `Trajectory`, and
also their text (``prompt_text``, and ``response_pieces``: one string per response token), so
that rendering needs no tokenizer. Traces of a run go to ``<run_dir>/traces.jsonl``.

Rendering colours the response by who wrote it: tokens the model sampled (loss mask 1, the ones
trained on) and tokens it was given (mask 0: tool results, chat-template scaffolding). Text is
shown through `visible` (escape sequences shown, never obeyed) and numbers through `number`
(a diverged run's NaN and infinite logprobs render as such). A trajectory the learner trained
on also records, per response token, its learner logprob, the learner's entropy there and its
advantage (``learner_logprobs``, ``learner_entropy``, ``advantages``; `jarl view` shows them).

A run with ``trainer.trace_backend=mlflow`` also records them in an MLflow store in the run
folder (``mlflow.db``, written by `jax_agent_rl.train.mlflow_traces`); ``jarl traces RUN
--mlflow`` prints the command that serves its UI.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.text import Text

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cluster import device_turns
from jax_agent_rl.console.visible import number, visible
from jax_agent_rl.files import drop_cut_line
from jax_agent_rl.rl.batch import TrainBatch
from jax_agent_rl.rl.sequence import TrainSequence
from jax_agent_rl.tokenization import Tokenizer

TRACES_FILE = "traces.jsonl"
MLFLOW_DB = "mlflow.db"  # the run's MLflow store (SQLite)
ARTIFACTS_DIR = "mlflow-artifacts"  # its artifacts (mlflow keeps a copy of each trace there)

PROMPT_STYLE = "dim"
MODEL_STYLE = "bold green"
GIVEN_STYLE = "cyan"
ERROR_STYLE = "bold red"
# Model tokens by the probability the sampler gave them (with show_logprobs): (min p, style).
PROB_STYLES = (
    (0.9, "bold green"),
    (0.5, "bold yellow"),
    (0.1, "bold dark_orange"),
    (0.0, "bold red"),
)
_MAX_PENDING = 8  # tokens held back while they end inside a multi-byte character
# what the learner computed at each response token of a traced trajectory, by name
# ("learner_logprobs", "learner_entropy", "advantages"; None where it trained no such token)
TokenSignals = dict[str, list[float | None]]


def trace_picks(episodes: Sequence[Episode], k: int) -> list[Episode]:
    """The ``k`` episodes of a step whose traces are written, spread over them."""
    return list(episodes[:: max(1, len(episodes) // max(k, 1))][:k])


def trace_record(
    episode: Episode,
    tokenizer: Tokenizer,
    step: int,
    signals: Mapping[str, Sequence[float | None]] | None = None,
) -> dict[str, Any]:
    """A JSON-serialisable record of ``episode`` (its trajectory and outcome) taken at
    training step ``step``, with the learner's ``signals`` at its tokens when it trained on it
    (`learner_signals`)."""
    traj = episode.traj
    return {
        "step": int(step),
        "uid": traj.uid,
        "group_id": traj.group_id,
        "reward": float(episode.reward),
        "stop_reason": episode.stop_reason,
        "filtered_by": episode.filtered_by,
        "forked_from": traj.forked_from,  # a tree rollout's branch: whose prefix it shares
        "turn_kinds": list(traj.turn_kinds),
        "error": episode.error,
        "answer_fault": episode.answer_fault,
        "num_turns": int(traj.num_turns),
        "tool_calls": int(traj.tool_calls),
        "malformed_calls": int(traj.malformed_calls),
        "refused_calls": int(traj.refused_calls),
        "cut_observations": int(traj.cut_observations),
        "turn_rewards": [float(r) for r in traj.turn_rewards],
        "env_reward": traj.env_reward,
        "weight_versions": [int(v) for v in traj.weight_versions],
        # requests sent again from their prompts after their engine died (its restart)
        "resent_requests": int(traj.resent_requests),
        "messages": [dict(m) for m in traj.messages],
        "prompt_ids": [int(t) for t in traj.prompt_ids],
        "response_ids": [int(t) for t in traj.response_ids],
        "loss_mask": [int(m) for m in traj.loss_mask],
        "rollout_logprobs": [float(lp) for lp in traj.rollout_logprobs],
        "prompt_text": tokenizer.decode(traj.prompt_ids),
        "response_pieces": token_pieces(tokenizer, traj.response_ids, traj.loss_mask),
        "token_versions": [int(v) for v in traj.token_versions],
        "kv_versions": [int(v) for v in traj.kv_versions],
        # a MoE policy's: per response token, its experts [sparse layers][k] (-1: none)
        "expert_ids": None if traj.expert_ids is None else traj.expert_ids.tolist(),
        # the episode's other samples (a harness that compacted its context, a sub-agent's),
        # by index; the fields above hold sample ``sample``
        "sample": traj.sample,
        "other_samples": {
            str(k): {
                "prompt_ids": [int(t) for t in seq.prompt_ids],
                "response_ids": [int(t) for t in seq.response_ids],
                "loss_mask": [int(m) for m in seq.loss_mask],
                "rollout_logprobs": [float(lp) for lp in seq.rollout_logprobs],
            }
            for k, seq in sorted(traj.parked.items())
        },
        **(signals or {}),
    }


def trace_index(
    batch: TrainBatch, rows: Sequence[TrainSequence], traced: Sequence[Trajectory]
) -> np.ndarray:
    """[len(traced), T]: where in ``batch``'s rows (flattened) each response token of each
    traced trajectory is predicted (-1: nowhere, e.g. an untrained trajectory's). ``rows`` are
    the batch's sequences in order (a trajectory, or with per-turn samples its turns, uid
    ``<uid>#<k>``: their prompts hold the response before them; a uid may hold ``#`` itself,
    a row's data_source's)."""
    T = batch.shape[1]
    index = np.full((len(traced), T), -1, np.int64)
    sequence = np.where(batch.segment_ids > 0, batch.sequence, -1).reshape(-1)
    slot = {t.sample_uid(t.sample): s for s, t in enumerate(traced)}  # its sample's row(s)
    for i, row in enumerate(rows):
        s = slot.get(row.uid)
        s = slot.get(row.uid.rpartition("#")[0]) if s is None else s
        if s is None:
            continue
        start = int(np.flatnonzero(sequence == i)[0])
        P, n = len(row.prompt_ids), len(row.response_ids)
        offset = P - len(traced[s].prompt_ids)  # the response before this turn
        index[s, offset : offset + n] = start + P - 1 + np.arange(n)
    return index


def learner_signals(
    traced: Sequence[Trajectory], index: np.ndarray, values: dict[str, np.ndarray]
) -> dict[str, TokenSignals]:
    """The `TokenSignals` of each traced trajectory the learner trained on, by uid, from
    ``values`` [len(traced), T], an update's per-token values at ``index`` (`trace_index`)."""
    signals: dict[str, TokenSignals] = {}
    for s, traj in enumerate(traced):
        n = len(traj.response_ids)
        if (index[s, :n] >= 0).any():
            signals[traj.uid] = {
                name: [
                    float(v) if at >= 0 else None
                    for v, at in zip(x[s, :n], index[s, :n], strict=True)
                ]
                for name, x in values.items()
            }
    return signals


@dataclasses.dataclass(frozen=True)
class UpdateTokens:
    """What an update gives a trace: its per-token values (`Learner.rl_update`'s learner
    logprobs, entropies and advantages, [M, b, T] arrays on the devices) and where a
    trajectory's tokens lie in them: the host ``batch`` and its ``rows`` in order
    (`trace_index`). One process's: a multi-process update's arrays span processes."""

    values: dict[str, jax.Array]
    batch: TrainBatch
    rows: Sequence[TrainSequence]

    def signals(self, traced: Sequence[Trajectory]) -> dict[str, TokenSignals]:
        """The `TokenSignals` of each of ``traced`` the update trained on, by uid
        (`learner_signals`): the arrays are copied off the devices here, for traced steps
        only."""
        index = trace_index(self.batch, self.rows, traced)
        at = np.maximum(index, 0)
        with device_turns.TURN:  # an engine's thread may share the devices (async training)
            flat = {k: np.asarray(v).reshape(-1) for k, v in self.values.items()}
        return learner_signals(traced, index, {k: v[at] for k, v in flat.items()})


def token_pieces(tokenizer: Tokenizer, ids: Sequence[int], mask: Sequence[int]) -> list[str]:
    """The text of each token: ``tokenizer.decode([id])``, except across split characters.

    A byte-level token may end inside a multi-byte UTF-8 character (decoding alone to U+FFFD);
    such a token gets "" and the whole character goes to the token that completes it, so the
    pieces of a run of equal mask join to exactly the decoded text of that run.
    """
    pieces: list[str] = []
    pending: list[int] = []
    for i, token in enumerate(ids):
        pending.append(token)
        text = tokenizer.decode(pending)
        run_ends = i + 1 == len(ids) or mask[i + 1] != mask[i]
        if text.endswith("\ufffd") and not run_ends and len(pending) < _MAX_PENDING:
            pieces.append("")
            continue
        pieces.append(text)
        pending = []
    return pieces


def append_traces(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Appends ``records`` to the JSONL file ``path``, after its last complete line (a record a
    killed run cut short is dropped: `drop_cut_line`); they are on disk when this returns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    drop_cut_line(path)
    # (a lone surrogate, which UTF-8 cannot hold, is written as its JSON escape: read back the
    # same; a prompt or an environment's observation can hold one)
    with path.open("a", encoding="utf-8", errors="backslashreplace") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()


def read_traces(path: Path, step: int | None = None) -> list[dict[str, Any]]:
    """The records of ``path`` in file order, only those of ``step`` when given."""
    if not path.is_file():
        raise FileNotFoundError(f"no traces file {path}")
    records = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            # (nested past what it reads; a number of more digits than int() reads: ValueError)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{path}: line {line_number} is not valid JSON: {e}") from e
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path}: line {line_number} is not a trace record")
            if step is None or record["step"] == step:
                records.append(record)
    return records


def header_text(record: dict[str, Any]) -> Text:
    """One line: step, uid, reward, stop reason, turns, tool calls (and weight versions)."""
    parts = [
        f"step {record['step']}",
        f"uid {record['uid']}",
        f"reward {number(record['reward'])}",
        f"stop {record['stop_reason']}",
        f"turns {record['num_turns']}",
        f"tool calls {record['tool_calls']} ({record['malformed_calls']} malformed)",
    ]
    versions = record["weight_versions"]
    if versions:
        low, high = min(versions), max(versions)
        parts.append(f"weights v{low}" if low == high else f"weights v{low}-v{high}")
    return Text(visible(" | ".join(parts)), style="bold")


def response_text(record: dict[str, Any], show_logprobs: bool = False) -> Text:
    """The response, model tokens in `MODEL_STYLE` and given ones in `GIVEN_STYLE`.

    With ``show_logprobs`` each model token is coloured by its sampling probability instead
    (see `PROB_STYLES`).
    """
    text = Text()
    pieces, mask = record["response_pieces"], record["loss_mask"]
    logprobs = record["rollout_logprobs"]
    start = 0
    while start < len(pieces):
        end = start
        while end < len(pieces) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            text.append(visible("".join(pieces[start:end])), style=GIVEN_STYLE)
        elif show_logprobs:
            for piece, logprob in zip(pieces[start:end], logprobs[start:end], strict=True):
                text.append(visible(piece), style=probability_style(logprob))
        else:
            text.append(visible("".join(pieces[start:end])), style=MODEL_STYLE)
        start = end
    return text


def probability_style(logprob: float) -> str:
    """The `PROB_STYLES` style of a token of ``logprob``; a NaN or a positive logprob (no
    probability: a diverged run) gets `ERROR_STYLE`."""
    if not logprob <= 0.0:
        return ERROR_STYLE
    p = math.exp(logprob)
    return next(style for low, style in PROB_STYLES if p >= low)


def legend_text(show_logprobs: bool) -> Text:
    legend = Text()
    if show_logprobs:
        legend.append("model tokens")
        for low, style in PROB_STYLES:
            legend.append(" ")
            legend.append(f"p>={low:g}" if low > 0 else f"p<{PROB_STYLES[-2][0]:g}", style=style)
    else:
        legend.append("model tokens (mask 1)", style=MODEL_STYLE)
    legend.append(" | ")
    legend.append("tool results, template (mask 0)", style=GIVEN_STYLE)
    legend.append(" | ")
    legend.append("prompt", style=PROMPT_STYLE)
    return legend


def trace_texts(record: dict[str, Any], show_logprobs: bool = False) -> list[Text]:
    """What `render_trace` prints: the header, the prompt (dimmed) and the coloured response,
    the traceback that ended the trajectory if one did, and a legend."""
    body = Text()
    body.append(visible(record["prompt_text"]), style=PROMPT_STYLE)
    body.append_text(response_text(record, show_logprobs))
    texts = [header_text(record), body]
    if record.get("error"):  # traces written before errors were recorded have none
        texts.append(Text(visible(str(record["error"])), style=ERROR_STYLE))
    return [*texts, legend_text(show_logprobs)]


def render_trace(record: dict[str, Any], console: Console, show_logprobs: bool = False) -> None:
    """Prints `trace_texts` of ``record`` below a rule."""
    console.rule()
    for text in trace_texts(record, show_logprobs):
        console.print(text)


def whole_step(record: dict[str, Any]) -> bool:
    """Whether a trace record's ``step`` is a whole number (a bool is not): a record whose
    step is text, a list, a float... is not one the trainer wrote, and is skipped."""
    step = record["step"]
    return isinstance(step, int) and not isinstance(step, bool)


# what reading a record of the wrong shape raises: a field missing, or of another type (text
# where a number goes: ValueError; an int past float's range: OverflowError; a number where
# text goes: AttributeError), or a value nested as deep as the reader reads, which writing
# out (as text, as JSON) takes deeper (RecursionError)
NOT_A_RECORD = (
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    ValueError,
    OverflowError,
    RecursionError,
)


def render_run(
    run_dir: Path,
    console: Console,
    step: int | None = None,
    limit: int = 4,
    show_logprobs: bool = False,
) -> int:
    """Renders up to ``limit`` traces of ``step`` (default: the last step traced) of a run.

    Returns how many were rendered (0 when nothing is traced yet); a step that was not traced
    is a ValueError naming the steps that were, and so is a record of the wrong shape (a field
    missing or of another type), naming the file. Records whose step is not a whole number
    (`whole_step`) are skipped.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = run_dir / TRACES_FILE
    read = read_traces(path)
    records = [r for r in read if whole_step(r)]  # (a step of text and one of int: no order)
    if not records:
        return 0
    steps = sorted({r["step"] for r in records})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(
            f"{path} has no traces of step {step}; traced steps: {steps[0]} to {steps[-1]} "
            f"({len(steps)} in all)"
        )
    selected = [r for r in records if r["step"] == chosen][:limit]
    try:  # all built before any is printed: a bad record leaves no page half drawn
        shown = [trace_texts(r, show_logprobs) for r in selected]
    except NOT_A_RECORD as e:
        raise ValueError(f"{path}: a record is not a trace record ({e!r})") from e
    for texts in shown:
        console.rule()
        for text in texts:
            console.print(text)
    return len(selected)


def tracking_uri(run_dir: Path) -> str:
    """The MLflow tracking URI of ``run_dir``'s store, an absolute path (usable from anywhere)."""
    return f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"


def mlflow_ui_command(run_dir: Path) -> str:
    return f"mlflow ui --backend-store-uri {tracking_uri(run_dir)} --port 5000"


def traces_command(
    run_dir: str, step: int | None, limit: int, show_logprobs: bool, mlflow: bool = False
) -> int:
    """``jarl traces``: renders a run's traces, or with ``mlflow`` prints the command that
    serves them in the MLflow UI; 2 (with a message) when there are none to read."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return _error(f"no run folder {folder}")
    if mlflow:
        if not (folder / MLFLOW_DB).is_file():
            return _error(
                f"no {MLFLOW_DB} in {folder}: runs write it with trainer.trace_backend=mlflow"
            )
        print(mlflow_ui_command(folder))
        return 0
    if not (folder / TRACES_FILE).is_file():
        return _error(f"no {TRACES_FILE} in {folder}")
    console = Console()
    try:
        rendered = render_run(folder, console, step, limit, show_logprobs)
    except ValueError as e:
        return _error(str(e))
    if rendered == 0:
        console.print(Text(f"{folder / TRACES_FILE} holds no traces yet"), soft_wrap=True)
    return 0


def _error(message: str) -> int:
    """Prints ``message`` to stderr, unwrapped (paths stay whole); the exit status 2."""
    Console(stderr=True).print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
    return 2
