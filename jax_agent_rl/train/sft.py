"""Supervised warm start: masked cross-entropy on demonstration conversations.

A demonstration file is JSONL, one conversation per line: ``{"messages": [...]}`` with the
prompt (system/user), then assistant turns, each followed by what answered it: tool messages,
or user messages (an environment's or an interaction's reply, a user's next question), or
both. Each conversation becomes the exact token sequence a rollout would produce if the model
wrote those assistant turns (`demonstration_trajectory`): the assistant turns trained (mask 1),
everything between them not (mask 0), so SFT trains the very tokens that RL later samples and
scores, for tool, environment and interaction tasks alike.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from jax_agent_rl.agent.trajectory import Trajectory, demonstration_trajectory
from jax_agent_rl.config import JarlConfig
from jax_agent_rl.console import progress
from jax_agent_rl.console.visible import lone_surrogate
from jax_agent_rl.data.datasets import ROLES
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rl.batch import make_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train.metrics import MetricsLog

Turns = list[tuple[str, list[dict[str, Any]]]]
ANSWERS = ("tool", "user")  # the roles that may answer an assistant turn


def split_conversation(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], Turns]:
    """(prompt messages, [(assistant text, [the tool and user messages that answered it]),
    ...]). A message that is no object with a role and text content is a ValueError naming it
    (the tokenizer refused it later, a TypeError naming nothing: "TextInputSequence must be
    str"), and so is a system message after the first assistant turn."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"message {i} must be an object with a role among {ROLES}")
        if not isinstance(m.get("content"), str) or not isinstance(m.get("name", ""), str):
            raise ValueError(f"message {i} ({m['role']}) has no string 'content'")
        for key in ("content", "name"):
            where = lone_surrogate(m.get(key, ""))
            if where is not None:
                raise ValueError(
                    f"message {i} ({m['role']}) holds a lone surrogate {where} in {key!r} "
                    "(half of a JSON \\ud83d\\ude00 pair): not text"
                )
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant message")
    turns: Turns = []
    for m in messages[first:]:
        if m["role"] == "assistant":
            turns.append((m["content"], []))
        elif m["role"] in ANSWERS:
            answer = {"role": m["role"], "content": m["content"]}
            turns[-1][1].append(
                {**answer, "name": m.get("name", "")} if m["role"] == "tool" else answer
            )
        else:
            raise ValueError(
                f"unexpected {m['role']!r} message after the first assistant turn (an "
                f"assistant turn is answered by {' or '.join(ANSWERS)} messages)"
            )
    return [dict(m) for m in messages[:first]], turns


def load_demonstrations(
    path: str | Path, builder: TurnBuilder, limit: int | None = None
) -> list[Trajectory]:
    """The first ``limit`` demonstrations (all when None) as trajectories."""
    out: list[Trajectory] = []
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}"
        ) from None
    for i, line in enumerate(text.splitlines()):
        if len(out) == limit:
            break
        if not line.strip():
            continue
        try:
            prompt, turns = split_conversation(json.loads(line)["messages"])
        except RecursionError:
            raise ValueError(
                f"{path}: line {i + 1}: not a demonstration (nested too deep)"
            ) from None
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: line {i + 1}: not a demonstration ({e})") from None
        out.append(
            demonstration_trajectory(Sample(uid=f"demo-{i}", messages=prompt), builder, turns)
        )
    return out


def write_demonstrations(
    path: str | Path, conversations: Sequence[Sequence[dict[str, Any]]]
) -> None:
    with Path(path).open("w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": list(messages)}) + "\n")


def run_sft(
    learner: Learner,
    state: LearnerState,
    demos: Sequence[Trajectory],
    *,
    steps: int,
    batch_size: int,
    bucket: int,
    seed: int,
    on_step: Callable[[int, dict[str, float]], None] = lambda _step, _metrics: None,
) -> LearnerState:
    """``steps`` updates of ``state`` (donated) on batches drawn by epochs (a fresh shuffle
    each epoch); returns the last state."""
    rng = random.Random(seed)
    order: list[int] = []
    for step in range(steps):
        while len(order) < batch_size:
            perm = list(range(len(demos)))
            rng.shuffle(perm)
            order += perm
        chosen, order = order[:batch_size], order[batch_size:]
        batch = make_batch([demos[i].train_sequence(0.0) for i in chosen], bucket)
        state, metrics = learner.sft_update(state, batch)
        on_step(step, metrics)
    return state


def warm_start(
    cfg: JarlConfig,
    learner: Learner,
    state: LearnerState,
    tokenizer: Tokenizer,
    registry: ToolRegistry,
    metrics: MetricsLog,
    console: Console,
) -> Any:
    """The SFT stage of a run: ``sft.steps`` updates of ``state`` (donated) by ``learner`` on
    the demonstrations of ``sft.data`` (rendered with the tools' schemas, as rollouts see
    them), with its progress on ``console`` and ``sft`` metrics; returns the warm-started
    params."""
    demos = load_demonstrations(cfg.sft.data, TurnBuilder(tokenizer, registry.schemas() or None))
    console.print(
        f"SFT: {cfg.sft.steps} steps on {len(demos)} demonstrations "
        "(the first compiles the SFT step)"
    )
    with progress.phase(console, "sft step", cfg.sft.steps) as bar:

        def on_step(step: int, scalars: dict[str, float]) -> None:
            metrics.write(step + 1, "sft", scalars)
            bar.update(step + 1, f"loss {scalars['sft_loss']:.3f}")

        state = run_sft(
            learner,
            state,
            demos,
            steps=cfg.sft.steps,
            batch_size=cfg.sft.batch_size,
            bucket=cfg.learner.seq_bucket,
            seed=cfg.trainer.seed,
            on_step=on_step,
        )
    return state.policy.params
