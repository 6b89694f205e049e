"""Prompt datasets in verl's column layout, read from ``.jsonl`` or ``.parquet``, and a sampler.

One row is one prompt::

    prompt        list of chat messages {role, content}; roles: system, user, assistant, tool
    reward_model  {"style": "rule", "ground_truth": ...}  (or a top-level ``ground_truth``)
    data_source   str, optional: which reward function / benchmark the row belongs to
    extra_info    dict, optional; ``extra_info["index"]`` numbers the row within its source
    agent_name    str, optional: the agent loop (verl's names: ``tool_agent``,
                  ``single_turn_agent``); it must be one of the names the caller passes (the
                  registered loops), so a misspelled one fails here, not mid-rollout. A row
                  without one runs the caller's ``default_agent`` (``agent.default_agent_loop``,
                  verl's ``single_turn_agent``), or ``tool_agent`` if it has an ``env_class``
    env_class     str, optional: the environment that answers its turns (SkyRL's column;
                  `jax_agent_rl.envs`); SkyRL's ``reward_spec`` stands for ``reward_model``

Every other column (SkyRL's ``reward_spec`` among them) is kept as it is (`Sample.columns`):
SkyRL's environments read theirs (``db_id``, ``data``, ...) from it.

Instead of a file, ``reasoning_gym:<task>?size=N&seed=S`` generates reasoning-gym rows
(`jax_agent_rl.data.reasoning_gym`).

A row becomes a `Sample` with ``uid = f"{data_source or file stem}-{index}"``, where ``index``
is ``extra_info["index"]`` when present, else the row number (from 0). Uids must be unique
within a file. Every problem is a `DatasetError` naming the file, the row and what is wrong.

`PromptSampler` walks the samples in a fresh random order each epoch; its whole state is two
integers, so a resumed run draws exactly the batches an uninterrupted one would have drawn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_agent_rl.console.visible import lone_surrogate
from jax_agent_rl.data.sample import DatasetError, Sample

SUFFIXES = (".jsonl", ".parquet")
ROLES = ("system", "user", "assistant", "tool")
SKYRL_AGENT = "tool_agent"  # SkyRL's generator plays an environment over many turns

Row = dict[str, Any]
# the columns a `Sample` holds in fields of its own; the others it keeps as they are (columns)
_READ = {"prompt", "env_class", "data_source", "extra_info", "agent_name"}
_READ |= {"reward_model", "ground_truth"}


Fail = Callable[[str], DatasetError]  # makes the error for one problem of the row at hand


def load_samples(
    path: str | Path, *, agents: Collection[str], default_agent: str, limit: int | None = None
) -> list[Sample]:
    """The first ``limit`` rows (all when None) of a ``.jsonl`` or ``.parquet`` file, whose
    agent names must be in ``agents`` (the registered loops, `AGENT_LOOPS`); a row naming
    none runs ``default_agent``."""
    if default_agent not in agents:
        raise DatasetError(
            f"{path}: rows without an agent_name would run {default_agent!r}, which is not a "
            f"registered loop: {sorted(agents)}"
        )
    if isinstance(path, str) and path.startswith("reasoning_gym:"):
        from jax_agent_rl.data import reasoning_gym

        return reasoning_gym.samples(path, default_agent, limit)
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unknown dataset suffix {path.suffix!r}; known: {SUFFIXES}")
    if limit is not None and limit < 0:
        raise DatasetError(f"{path}: limit must be >= 0, got {limit}")
    rows = _jsonl_rows(path, limit) if path.suffix == ".jsonl" else _parquet_rows(path, limit)
    samples: list[Sample] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        sample = _sample(row, path, where, len(samples), agents, default_agent)
        if sample.uid in seen:
            raise DatasetError(
                f"{path}: {where}: uid {sample.uid!r} repeats the uid of {seen[sample.uid]} "
                "(extra_info.index must be unique within a data_source)"
            )
        seen[sample.uid] = where
        samples.append(sample)
    return samples


def write_jsonl(path: str | Path, samples: Sequence[Sample]) -> Path:
    """Writes ``samples`` as verl rows; `load_samples` reads them back.

    The uid is not a column: it is rebuilt from ``data_source`` and ``extra["index"]`` (or the
    row number), so a sample keeps its uid when it was made that way (as loaded ones are).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(_row(sample), ensure_ascii=False) + "\n")
    return path


def _row(sample: Sample) -> Row:
    return {
        **sample.columns,
        "data_source": sample.data_source,
        "prompt": sample.messages,
        "reward_model": {"style": "rule", "ground_truth": sample.ground_truth},
        "extra_info": sample.extra,
        "agent_name": sample.agent_name,
        **({"env_class": sample.env_class} if sample.env_class else {}),
    }


def _jsonl_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Row]]:
    """(where, row) per non-blank line; ``where`` names the row number and the line. A line
    that is not UTF-8, or that JSON cannot read (nested past the recursion limit, a number
    past the 4,300 digits int() reads), is a `DatasetError` naming it."""
    n = 0
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if limit is not None and n >= limit:
                return
            if not raw.strip():
                continue
            where = f"row {n} (line {line_number})"
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{path}: {where}: not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
                    f"{e.start} of the line"
                ) from None
            except RecursionError:
                raise DatasetError(f"{path}: {where}: not valid JSON: nested too deep") from None
            except ValueError as e:  # JSONDecodeError, or an int of too many digits
                raise DatasetError(f"{path}: {where}: not valid JSON: {e}") from e
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: {where}: a row must be a JSON object")
            yield where, row
            n += 1


def _parquet_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Row]]:
    # imported here: the learner and the engine import this package, and need no pyarrow
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: not a readable parquet file: {e}") from e
    if limit is not None:
        table = table.slice(0, limit)
    for n, row in enumerate(table.to_pylist()):
        yield f"row {n}", row


def _sample(
    row: Row, path: Path, where: str, row_number: int, agents: Collection[str], default_agent: str
) -> Sample:
    def fail(problem: str) -> DatasetError:
        return DatasetError(f"{path}: {where}: {problem}")

    if "prompt" not in row:
        raise fail(f"no 'prompt' column (columns: {sorted(row)})")
    messages = _messages(row["prompt"], fail)
    ground_truth = _ground_truth(row)
    if ground_truth is None:
        raise fail(
            "no ground truth (expected reward_model.ground_truth, reward_spec.ground_truth or "
            "ground_truth)"
        )
    data_source = _optional_str(row, "data_source", "", fail)
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise fail(f"extra_info must be a dict, got {type(extra).__name__}")
    index = extra.get("index")
    env_class = _optional_str(row, "env_class", "", fail)
    agent_name = _optional_str(row, "agent_name", SKYRL_AGENT if env_class else default_agent, fail)
    if agent_name not in agents:
        raise fail(f"unknown agent_name {agent_name!r}; registered: {sorted(agents)}")
    return Sample(
        uid=f"{data_source or path.stem}-{row_number if index is None else index}",
        messages=messages,
        ground_truth=ground_truth,
        data_source=data_source,
        agent_name=agent_name,
        env_class=env_class,
        extra=extra,
        columns={k: v for k, v in row.items() if k not in _READ},
    )


def _messages(prompt: Any, fail: Fail) -> list[dict[str, Any]]:
    """Checked chat messages. Null fields are dropped: parquet gives every message of a column
    every field any message has (``name``, ``tool_calls``), null where it had none."""
    if not isinstance(prompt, list) or not prompt:
        raise fail(f"prompt must be a non-empty list of messages, got {_describe(prompt)}")
    messages = []
    for i, raw in enumerate(prompt):
        if not isinstance(raw, dict):
            raise fail(f"prompt message {i} must be a dict, got {_describe(raw)}")
        message = {k: v for k, v in raw.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            raise fail(f"prompt message {i} has role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise fail(f"prompt message {i} ({role}) has no string 'content'")
        # (the tokenizer cannot take one: each episode of the row failed; tool_calls, name:
        # the template writes them too)
        for key, value in message.items():
            where = lone_surrogate(value)
            if where is not None:
                raise fail(
                    f"prompt message {i} ({role}) holds a lone surrogate {where} in {key!r} "
                    "(half of a JSON \\ud83d\\ude00 pair): not text"
                )
        messages.append(message)
    return messages


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _ground_truth(row: Row) -> Any:
    for column in ("reward_model", "reward_spec"):  # verl's, SkyRL's
        spec = row.get(column)
        if isinstance(spec, dict) and spec.get("ground_truth") is not None:
            return spec["ground_truth"]
    return row.get("ground_truth")


def _optional_str(row: Row, key: str, default: str, fail: Fail) -> str:
    value = row.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise fail(f"{key} must be a string, got {type(value).__name__}")
    where = lone_surrogate(value)  # (data_source names the episodes: their ids, metrics)
    if where is not None:
        raise fail(f"{key} holds a lone surrogate {where}: not text")
    return value


class PromptSampler:
    """Batches of samples in a new random order each epoch, with checkpointable state.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so the state is
    just ``{"epoch", "position"}`` (the next sample is ``order(epoch)[position]``). A batch that
    runs past the end of an epoch continues at the start of the next one.
    """

    def __init__(self, samples: Sequence[Sample], seed: int) -> None:
        if not samples:
            raise ValueError("PromptSampler needs at least one sample")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.samples = list(samples)
        self.seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        rng = np.random.default_rng([self.seed, epoch])
        return [int(i) for i in rng.permutation(len(self.samples))]

    def next_batch(self, n: int) -> list[Sample]:
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch = []
        for _ in range(n):
            batch.append(self.samples[self._order[self._position]])
            self._position += 1
            if self._position == len(self.samples):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
        return batch

    def state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}

    def restore(self, state: dict[str, int]) -> None:
        """Continues from a `state` of a sampler over the same samples and seed."""
        if set(state) != {"epoch", "position"}:
            raise ValueError(f"sampler state needs keys epoch and position, got {sorted(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.samples):
            raise ValueError(
                f"sampler state {state} is out of range for {len(self.samples)} samples"
            )
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
