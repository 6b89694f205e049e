"""reasoning-gym's procedural tasks as prompt rows, scored by each task's own ``score_answer``
(the ``envs`` extra: reasoning-gym 0.1.25).

``data.train`` (or ``data.val``) ``reasoning_gym:<task>?size=500&seed=1&<option>=<value>``
generates ``size`` rows of ``<task>`` (any name ``reasoning_gym.create_dataset`` knows; the
other options go to the task's config, read as YAML scalars) with the given seed, so the same
string always gives the same rows; a different seed gives held-out rows. Each row is reasoning-
gym's default system prompt (think, then ``<answer>...</answer>``) and the question; its
``data_source`` is ``reasoning_gym/<task>`` and ``extra_info.reasoning_gym`` keeps the entry
(question, answer, metadata) the scorer reads. With ``data.reward`` unset, such rows are scored
by the ``reasoning_gym`` reward (`score`): the task's ``score_answer`` of the text inside the
response's last ``<answer>`` tags (reasoning-gym's ``extract_answer``), 0 without one, 0 for
an answer that would run as code in a scorer that evaluates it (`answer_code.harmless`), and 0
for an answer the scorer raises on: a wrong answer, which must be scored as one rather than end
its episode untrained (a scorer that raises on the task's own answer too is broken: that error
is raised). So is an answer that keeps the scorer running past ``data.reward_timeout_s``, once
the task's own answer (`answer_text`) is scored in time (`rewards.registry`).
"""

from __future__ import annotations

import functools
import importlib
import urllib.parse
from collections.abc import Callable
from typing import Any

import yaml

from jax_agent_rl.data.answer_code import harmless
from jax_agent_rl.data.sample import DatasetError, Sample
from jax_agent_rl.tokenization.tags import tagged

SCHEME = "reasoning_gym:"
SOURCE_PREFIX = "reasoning_gym/"
MAX_ROWS = 100_000  # size: the rows are generated when the data loads, every one of them
# any other number of an option (a task's term count, depth, digits, a range's bounds): a task
# builds its questions with loops and recursion over these, so a huge one runs for ever or overflows
MAX_OPTION = 10_000
# MiB a scorer's call may grow its worker's address space by (`CallProcesses.run`): an answer
# `harmless` lets through can still make sympy's simplify grow without end (the integral of
# ``(a+b+c+d+e+f+g+h+X)**100``: 35 MiB a second, for as long as data.reward_timeout_s lets it,
# in each of data.reward_workers at once); past it, the scorer's MemoryError scores 0
SCORER_MEMORY_MIB = 2048


class ReasoningGymError(DatasetError):
    """A ``reasoning_gym:`` data spec that names no task or sets a bad option."""


def samples(spec: str, default_agent: str, limit: int | None = None) -> list[Sample]:
    """The rows ``spec`` generates (the first ``limit``)."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    task, options = _parse(spec)
    try:
        dataset = reasoning_gym.create_dataset(task, **options)
        n = len(dataset) if limit is None else min(limit, len(dataset))
        entries = [dataset[i] for i in range(n)]
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError, OverflowError) as e:
        problem = f"{type(e).__name__}: {e}"
        raise ReasoningGymError(f"{spec}: reasoning-gym cannot make this task: {problem}") from e
    out = []
    for i, entry in enumerate(entries):
        out.append(
            Sample(
                uid=f"{SOURCE_PREFIX}{task}-{i}",
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                    {"role": "user", "content": entry["question"]},
                ],
                ground_truth=entry["answer"],
                data_source=f"{SOURCE_PREFIX}{task}",
                agent_name=default_agent,
                extra={"index": i, "reasoning_gym": entry},
            )
        )
    return out


def _parse(spec: str) -> tuple[str, dict[str, Any]]:
    """``reasoning_gym:<task>?k=v&...`` as (task, options); ``size`` and ``seed`` must be
    given (the rows are then fixed by the spec)."""
    rest = spec[len(SCHEME) :]
    task, _, query = rest.partition("?")
    if not task:
        raise ReasoningGymError(f"{spec}: no task name (reasoning_gym:<task>?size=N&seed=S)")
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise ReasoningGymError(f"{spec}: options must be key=value joined by '&': {e}") from e
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise ReasoningGymError(f"{spec}: option {key!r} is given twice")
        try:
            options[key] = yaml.safe_load(value) if value else value
        except yaml.YAMLError as e:
            raise ReasoningGymError(f"{spec}: option {key}={value!r} is not a value: {e}") from e
        except RecursionError:  # (the YAML reader recurses once per level)
            raise ReasoningGymError(f"{spec}: option {key} is nested too deep") from None
    for key, least in (("size", 1), ("seed", 0)):
        given = options.get(key)
        if isinstance(given, bool) or not isinstance(given, int) or given < least:
            raise ReasoningGymError(f"{spec}: {key} must be an integer >= {least}, got {given!r}")
    if options["size"] > MAX_ROWS:
        raise ReasoningGymError(
            f"{spec}: size={options['size']} is over {MAX_ROWS} rows (generated as the data loads)"
        )
    for key, option in options.items():
        for number in () if key in ("size", "seed") else _numbers(option):
            if abs(number) > MAX_OPTION:
                raise ReasoningGymError(
                    f"{spec}: option {key}={number} is over {MAX_OPTION} in size (the bound on a "
                    "task's options: tasks build questions by loops and recursion over them)"
                )
    return task, options


def _numbers(value: Any) -> list[int | float]:
    """The numbers in an option's value, those in its lists and mappings too (a range's
    bounds): a task loops over them as over a number given alone."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int | float) and not isinstance(item, bool):
            found.append(item)
        elif isinstance(item, list | tuple | set):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend([*item, *item.values()])
    return found


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def loaded_score() -> Callable[[str, str, Any, dict[str, Any]], float]:
    """`score`, reasoning-gym imported (seconds): what a reward worker process loads before its
    first call is timed (`jax_agent_rl.usercode.processes`)."""
    importlib.import_module("reasoning_gym")
    return score


def answer_text(extra_info: dict[str, Any]) -> str:
    """A response that gives the row's own answer (what its entry in ``extra_info`` holds)."""
    entry = extra_info.get("reasoning_gym")
    return f"<answer>{entry.get('answer') if isinstance(entry, dict) else ''}</answer>"


def score(data_source: str, text: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    """The reasoning-gym score of a response (see the module docstring)."""
    del ground_truth  # the entry holds it, with the metadata the task's scorer reads
    entry = extra_info.get("reasoning_gym")
    if not isinstance(entry, dict):
        raise ValueError(
            f"data_source {data_source!r}: the row has no extra_info.reasoning_gym entry (rows "
            "scored by the reasoning_gym reward come from data.train=reasoning_gym:<task>?...)"
        )
    task = entry.get("metadata", {}).get("source_dataset") or data_source[len(SOURCE_PREFIX) :]
    # reasoning-gym's extract_answer (the last block, stripped), without its regex's time
    # quadratic in the response (`tagged`)
    answers = tagged(text)
    if not answers or not harmless(task, answers[-1].strip()):  # (an answer that runs code)
        return 0.0
    scorer = _scorer(task)
    try:
        value = scorer(answers[-1].strip(), entry)
    except Exception:  # it cannot read the answer (prime_factorization's int("x")): wrong
        scorer(entry.get("answer"), entry)  # unless it cannot read its own either: broken
        return 0.0
    return float(value)
