"""A reasoning-gym scorer that the policy's answer hangs for good: simple_integration's scorer
has sympy simplify the derivative of the answer minus the integrand, and for a product of a
dozen sines that runs for minutes (measured with sympy 1.13: 8 factors 8.5 s, 12 over 40 s,
then stopped). In a thread such a call could only be abandoned: 32 such answers held every
reward thread for the rest of the run, and every later reward timed out (this test's last
assertion failed so, "32 of 32 reward threads busy"). In a worker process, a call past
``data.reward_timeout_s`` kills its worker, so more hanging answers than the pool has workers
leave it whole: a correct answer scored after them scores 1. Such an answer is wrong, and
scores 0 (`tests/hostile/test_eleventh_pass.py`). Closing the rewards stops every worker: no
child process of this one is left."""

from __future__ import annotations

import asyncio

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.data.reasoning_gym import samples
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import Answer, AnswerFaultError, Rewards, make_reward
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
