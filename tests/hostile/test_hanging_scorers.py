"""A reasoning-gym scorer that the policy's answer hangs for good: simple_integration's scorer
has sympy simplify the derivative of the answer minus the integrand, and for a product of a
dozen sines that runs for minutes (measured with sympy 1.13: 8 factors 8.5 s, 12 over 40 s,
then stopped). In a thread such a call could only be abandoned: 32 such answers held every
reward thread for the rest of the run, and every later reward timed out (this test's last
assertion failed so, "32 of 32 reward threads busy"). In a worker process, a call past
``data.reward_timeout_s`` kills its worker, so more hanging answers than the pool has workers
leave it whole: a correct answer scored after them scores 1. Such an answer is wrong, and
scores 0 (`test_an_answer_that_hangs_a_reasoning_gym_scorer_scores_zero`). Closing the
rewards stops every worker: no child process of this one is left.

Before: such an answer ended its episode with ``reward_error``: not trained on, so in its group
it was no worse than the right answer, while a wrong one got a negative advantage. Hanging the
scorer was the policy's way out of a wrong answer (and every such step took the whole
timeout). It now scores 0 once the row's own answer is scored in time; a row whose own answer
hangs the scorer too is still the `RewardError`. And an answer `answer_code.harmless` lets
through to simple_integration's scorer, ``(a+b+c+d+e+f+g+h+X)**100``, had sympy's simplify
grow its worker's memory without end (35 MiB a second here) until ``data.reward_timeout_s``,
in every worker at once: no bound but the host's memory. A scorer's call may now grow its
worker by at most `reasoning_gym.SCORER_MEMORY_MIB`; past it, the MemoryError scores 0."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.reasoning_gym import samples
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import (
    Answer,
    AnswerFaultError,
    RewardError,
    Rewards,
    make_reward,
)
from tests.processes import children

WORKERS = 2
# an answer the scorer reads (`answer_code.harmless`: arithmetic of sines), and sympy hangs on
HANGING = "*".join(f"sin({k}*X)" for k in range(1, 13))


def _answer(row: Sample, text: str) -> Answer:
    return Answer(row.data_source, "", f"<answer>{text}</answer>", row.ground_truth, row.extra)


async def _scored(score: Rewards, answers: list[Answer]) -> list[float | BaseException]:
    return await asyncio.gather(*(score(a) for a in answers), return_exceptions=True)


def test_answers_that_hang_the_scorer_are_stopped_and_leave_the_pool_whole() -> None:
    row = samples("reasoning_gym:simple_integration?size=1&seed=0", "x")[0]
    assert row.ground_truth == "-5*X**9 - 2*X**6/3 + 4*X**3 + C"
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.train=t.jsonl",
            "data.reward_timeout_s=2",
            f"data.reward_workers={WORKERS}",
        ],
    )
    before = children()
    with make_reward(cfg.data) as score:
        assert children() == before  # no worker until a call needs one
        with pytest.raises(AnswerFaultError):  # (a wrong answer, 0: `score_episodes`)
            asyncio.run(score(_answer(row, HANGING)))
        hanging = asyncio.run(_scored(score, [_answer(row, HANGING)] * (WORKERS + 1)))
        assert all(isinstance(h, AnswerFaultError) for h in hanging), hanging
        correct = _answer(row, row.ground_truth)
        assert asyncio.run(_scored(score, [correct] * WORKERS)) == [1.0] * WORKERS
        assert asyncio.run(score(_answer(row, "-5*X**9 + C"))) == 0.0  # wrong: scored 0
        workers = children() - before
        assert 0 < len(workers) <= WORKERS
    assert not children() & workers
    assert children() <= before


def test_an_answer_that_grows_sympy_without_end_scores_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(The bound lowered to 64 MiB, for the test to reach it in seconds; the timeout is a
    minute: before, the answer took all of it and ended as a RewardError.)"""
    monkeypatch.setattr(reasoning_gym, "SCORER_MEMORY_MIB", 64)
    row = reasoning_gym.samples("reasoning_gym:simple_integration?size=1&seed=0", "x")[0]
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "data.reward_workers=1"])
    growing = "<answer>(a+b+c+d+e+f+g+h+X)**100</answer>"
    with make_reward(cfg.data) as score:
        answer = Answer(row.data_source, "", growing, row.ground_truth, row.extra)
        assert asyncio.run(score(answer)) == 0.0
        right = f"<answer>{row.ground_truth}</answer>"
        assert (
            asyncio.run(score(Answer(row.data_source, "", right, row.ground_truth, row.extra)))
            == 1.0
        )


def test_an_answer_that_hangs_a_reasoning_gym_scorer_scores_zero() -> None:
    row = reasoning_gym.samples("reasoning_gym:simple_integration?size=1&seed=0", "x")[0]
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", "data.reward_timeout_s=2", "data.reward_workers=1"],
    )

    def answer(text: str, entry: dict[str, Any]) -> Answer:
        extra = {**row.extra, "reasoning_gym": entry}
        return Answer(row.data_source, "", f"<answer>{text}</answer>", row.ground_truth, extra)

    entry = row.extra["reasoning_gym"]
    broken = {**entry, "answer": HANGING}  # (a task whose own answer hangs its scorer)
    with make_reward(cfg.data) as score:
        with pytest.raises(AnswerFaultError, match="the answer's fault, scored 0"):
            asyncio.run(score(answer(HANGING, entry)))  # (a wrong answer: `score_episodes`)
        assert asyncio.run(score(answer(row.ground_truth, entry))) == 1.0
        late = (
            r"^the reasoning-gym task's scorer \(data\.reward unset\) took longer than "
            r"data\.reward_timeout_s=2s \(its worker process was stopped\)$"
        )
        with pytest.raises(RewardError, match=late):
            asyncio.run(score(answer(HANGING, broken)))
