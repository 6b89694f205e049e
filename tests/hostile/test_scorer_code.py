"""reasoning-gym scorers that evaluate the answer as Python (``eval``, sympy's ``parse_expr``)
attacked by the policy whose answer they read: the scorer runs in the trainer's process, so an
answer that ran there could set its own reward, reach its siblings' episodes or end the run.

Before the fix each payload below ran (it set an environment variable of the trainer's
process), and ``9**9**9**9`` was computed, holding the interpreter's lock for good. An answer
a scorer raises on is scored as the wrong answer it is, not an episode ended untrained."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.answer_code import EVAL_TASKS, SYMPY_TASKS

MARK = "JARL_SCORER_RAN_ANSWER"
# the answer as each kind of scorer would run it: sympy rewrites names into Symbols, but a
# builtin called by name is kept, as is everything reached from it
PAYLOAD = f"__import__('os').environ.__setitem__('{MARK}', '1')"
RUNS_IN_SYMPY = f"{PAYLOAD}!"  # no Python, until sympy reads "...!" as factorial(...)


def _row(task: str) -> reasoning_gym.Sample:
    (row,) = reasoning_gym.samples(f"reasoning_gym:{task}?size=1&seed=3", "tool_agent")
    return row


def _score(row: reasoning_gym.Sample, answer: str) -> float:
    text = f"<think>...</think><answer>{answer}</answer>"
    return reasoning_gym.score(row.data_source, text, row.ground_truth, row.extra)


@pytest.mark.parametrize("task", sorted(EVAL_TASKS | SYMPY_TASKS))
def test_an_answer_that_is_code_never_runs_in_the_scorer(task: str) -> None:
    row = _row(task)
    os.environ.pop(MARK, None)
    payloads = [PAYLOAD, f"[{PAYLOAD}]", f"({PAYLOAD}) or 24"]
    if task in SYMPY_TASKS:
        payloads.append(RUNS_IN_SYMPY)
    for answer in payloads:
        assert _score(row, answer) == 0.0, answer
        assert MARK not in os.environ, f"{task} ran {answer!r}"
    # the right answer still scores (countdown's and puzzle24's ground truths are expressions,
    # n_queens' a board of text, spiral_matrix's numbers, string_insertion's a word)
    assert _score(row, str(row.ground_truth)) == 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "answer",
    ["9**9**9**9", "(9**99)**99", "3**(100*100*100*100)", "factorial(10**9)", "2**" + "9" * 30],
)
def test_an_expression_that_would_not_end_is_not_evaluated(answer: str) -> None:
    for task in ("countdown", "simple_integration"):
        assert _score(_row(task), answer) == 0.0


def test_the_usual_answers_of_an_expression_task_still_reach_its_scorer() -> None:
    row = _row("simple_integration")
    integrand = row.extra["reasoning_gym"]["metadata"]["integrand"]
    assert _score(row, str(row.ground_truth)) == 1.0
    assert _score(row, f"{row.ground_truth} + 1") == 1.0  # any constant of integration
    assert _score(row, integrand) < 1.0  # (a wrong answer is scored by the scorer: 0 or more)


@pytest.mark.parametrize("answer", ["x", "2 * 3", "seven", "2 x 3"])
def test_an_answer_the_scorer_cannot_read_is_wrong_not_an_error(answer: str) -> None:
    """prime_factorization's scorer raises on an answer that is not its "p × q" form: the
    episode ended as a reward error, which is not trained on, so a policy unsure of its answer
    escaped its penalty by writing one the scorer cannot read (before: ValueError)."""
    row = _row("prime_factorization")
    assert _score(row, answer) == 0.0
    assert _score(row, str(row.ground_truth)) == 1.0


def test_a_scorer_that_cannot_read_its_own_answer_is_an_error() -> None:
    row = _row("prime_factorization")
    entry = {**row.extra["reasoning_gym"], "answer": "not a factorization"}
    broken = dataclasses.replace(row, extra={**row.extra, "reasoning_gym": entry})
    with pytest.raises(ValueError, match="invalid literal"):
        _score(broken, "x")
