"""Rollout traces in MLflow (``trainer.trace_backend=mlflow``): each trajectory written to
``traces.jsonl`` is also recorded as an MLflow trace, in a SQLite store in the run folder
(``mlflow.db``, one experiment named after the folder), for the MLflow UI (``jarl traces RUN
--mlflow`` prints the command that serves it).

A trace is one episode, its spans in the order the agent loop ran them::

    episode <uid>        AGENT  uid, group_id, step, reward, stop_reason, num_turns,
    │                           tool_calls, filtered_by, weight_versions, prompt_text, ...
    ├── turn 1           LLM    its text, token_ids, num_tokens, mean_logprob,
    │                           weight_versions (of its tokens), kind (``turn_kinds``)
    ├── tool <name>      TOOL   the tool message's text (inputs: the call's arguments)
    ├── turn 2           LLM
    ...

The model turns are the runs of mask-1 tokens; the tool messages of a turn are those that
follow its assistant message in ``messages``. A trajectory times only the whole episode and
its tools (``timings``), so the spans are laid end to end over the episode's
``total_s``, ending when they are recorded: the turns share the model's time by their token
counts, the tool messages the tools' time equally. Those times are estimates; the attribute
``timings`` on the episode holds what was measured.

This module imports mlflow (the ``traces`` extra), and is itself imported only by runs that
record MLflow traces: the core package does not need mlflow.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Span, SpanType

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.tokenization import Message, Tokenizer
from jax_agent_rl.train.traces import ARTIFACTS_DIR, tracking_uri


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    """One run of mask-1 tokens of a trajectory; ``message`` is its assistant message (None
    for an aborted turn, which has none) and ``replies`` the tool messages that answered it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # the weight version that sampled each token
    kind: str | None  # its `Trajectory.turn_kinds` entry (None where the loop records none)
    message: Message | None
    replies: list[Message]


def split_messages(traj: Trajectory) -> tuple[list[Message], list[tuple[Message, list[Message]]]]:
    """The prompt's messages, and each assistant message the episode added with the messages
    that follow it (its tool results).

    The episode adds one assistant message per model turn but an aborted one, after the
    prompt's messages: the prompt is what precedes the first of them (all of them, for a loop
    that adds fewer).
    """
    added = traj.num_turns - traj.turn_kinds.count("aborted")
    assistant_at = [i for i, m in enumerate(traj.messages) if m["role"] == "assistant"]
    start = assistant_at[-added] if 0 < added <= len(assistant_at) else len(traj.messages)
    exchanges: list[tuple[Message, list[Message]]] = []
    for message in traj.messages[start:]:
        if message["role"] == "assistant":
            exchanges.append((message, []))
        else:
            exchanges[-1][1].append(message)
    return list(traj.messages[:start]), exchanges


def model_turns(traj: Trajectory) -> list[ModelTurn]:
    """The model turns of ``traj`` in order (see `ModelTurn`)."""
    _, exchanges = split_messages(traj)
    turns = []
    for i, (start, end) in enumerate(_model_runs(traj.loss_mask)):
        message, replies = exchanges[i] if i < len(exchanges) else (None, [])
        turns.append(
            ModelTurn(
                token_ids=traj.response_ids[start:end],
                logprobs=traj.rollout_logprobs[start:end],
                versions=traj.token_versions[start:end],
                kind=traj.turn_kinds[i] if i < len(traj.turn_kinds) else None,
                message=message,
                replies=replies,
            )
        )
    return turns


def _model_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of 1s in ``mask``."""
    runs = []
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def record_traces(
    run_dir: Path, episodes: Sequence[Episode], tokenizer: Tokenizer, step: int
) -> None:
    """Records ``episodes``, sampled at training step ``step``, as MLflow traces in
    ``run_dir``'s store; they are in it when this returns."""
    uri = tracking_uri(run_dir)
    # mlflow's tracer exports spans to the process's tracking URI, not to a client's
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment_id = _experiment_id(client, run_dir)
    end_ns = time.time_ns()
    for episode in episodes:
        _record(client, experiment_id, episode, tokenizer, step, end_ns)
    mlflow.flush_trace_async_logging()


def _experiment_id(client: MlflowClient, run_dir: Path) -> str:
    """The run's experiment (named after its folder), created on first use with its
    artifacts (mlflow keeps a copy of each trace there) in the run folder too."""
    name = run_dir.resolve().name
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    return client.create_experiment(
        name, artifact_location=(run_dir / ARTIFACTS_DIR).resolve().as_uri()
    )


def _record(
    client: MlflowClient,
    experiment_id: str,
    episode: Episode,
    tokenizer: Tokenizer,
    step: int,
    end_ns: int,
) -> None:
    """One episode as a trace ending at ``end_ns`` (the layout of the module docstring)."""
    traj = episode.traj
    prompt, exchanges = split_messages(traj)
    turns = model_turns(traj)
    total_ns = int(traj.timings.get("total_s", 0.0) * 1e9)
    tools_ns = min(int(traj.timings.get("tools_s", 0.0) * 1e9), total_ns)
    model_tokens = max(1, sum(len(t.token_ids) for t in turns))
    tool_messages = max(1, sum(len(t.replies) for t in turns))
    clock = end_ns - total_ns
    root = client.start_trace(
        f"episode {traj.uid}",
        span_type=SpanType.AGENT,
        inputs={"messages": prompt},
        tags={
            "step": str(step),
            "uid": traj.uid,
            "reward": f"{episode.reward:g}",
            "stop_reason": episode.stop_reason,
        },
        experiment_id=experiment_id,
        start_time_ns=clock,
    )
    for i, turn in enumerate(turns, start=1):
        duration = (total_ns - tools_ns) * len(turn.token_ids) // model_tokens
        span = client.start_span(
            f"turn {i}",
            trace_id=root.trace_id,
            parent_id=root.span_id,
            span_type=SpanType.LLM,
            attributes={
                "token_ids": [int(t) for t in turn.token_ids],
                "num_tokens": len(turn.token_ids),
                "mean_logprob": statistics.fmean(turn.logprobs) if turn.logprobs else 0.0,
                "weight_versions": sorted({int(v) for v in turn.versions}),
                "kind": turn.kind,
            },
            start_time_ns=clock,
        )
        clock += duration
        text = tokenizer.decode(turn.token_ids)
        client.end_span(root.trace_id, span.span_id, outputs=text, end_time_ns=clock)
        for reply, arguments in zip(turn.replies, _call_arguments(turn), strict=True):
            clock = _record_reply(client, root, reply, arguments, clock, tools_ns // tool_messages)
    answers = [message["content"] for message, _ in exchanges]
    client.end_trace(
        root.trace_id,
        outputs=answers[-1] if answers else None,
        attributes=_episode_attributes(episode, tokenizer, step),
        status="ERROR" if episode.error else "OK",
        end_time_ns=end_ns,
    )


def _episode_attributes(episode: Episode, tokenizer: Tokenizer, step: int) -> dict[str, Any]:
    """The attributes of an episode's root span."""
    traj = episode.traj
    return {
        "uid": traj.uid,
        "group_id": traj.group_id,
        "step": int(step),
        "reward": float(episode.reward),
        "stop_reason": episode.stop_reason,
        "num_turns": int(traj.num_turns),
        "tool_calls": int(traj.tool_calls),
        "malformed_calls": int(traj.malformed_calls),
        "refused_calls": int(traj.refused_calls),
        "filtered_by": episode.filtered_by,
        "weight_versions": [int(v) for v in traj.weight_versions],
        "turn_kinds": list(traj.turn_kinds),
        "prompt_text": tokenizer.decode(traj.prompt_ids),
        "timings": dict(traj.timings),
        "error": episode.error,
    }


def _call_arguments(turn: ModelTurn) -> list[Any]:
    """What each reply of ``turn`` answers: the arguments of its call where the assistant
    message lists one call per reply (chat-style parsers), else None."""
    calls = (turn.message or {}).get("tool_calls") or []
    if len(calls) != len(turn.replies):
        return [None] * len(turn.replies)
    return [call["function"] for call in calls]


def _record_reply(
    client: MlflowClient,
    root: Span,
    reply: Message,
    arguments: Any,
    start_ns: int,
    duration_ns: int,
) -> int:
    """A tool message as a span from ``start_ns``; returns its end."""
    name = reply.get("name")
    span = client.start_span(
        f"tool {name}" if name else "observation",
        trace_id=root.trace_id,
        parent_id=root.span_id,
        span_type=SpanType.TOOL,
        inputs=arguments,
        attributes={"name": name},
        start_time_ns=start_ns,
    )
    end_ns = start_ns + duration_ns
    client.end_span(root.trace_id, span.span_id, outputs=reply["content"], end_time_ns=end_ns)
    return end_ns
