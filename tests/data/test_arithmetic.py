"""The demo task: problems are right and the demonstrator is as imperfect as it claims."""

import json
import math
import random
import re

import pytest

from jax_agent_rl.data.arithmetic import ArithmeticTask, evaluate
from jax_agent_rl.data.compaction import SUMMARY_ASK, SUMMARY_PREFIX, VAGUE_SUMMARY, CompactionTask


def _binomial_bound(p: float, n: int) -> float:
    """Five standard deviations of a share estimated from n draws (false alarm ~6e-7)."""
    return 5 * math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def samples():
    return ArithmeticTask().samples(4000, seed=0, split="train")


def test_problems_are_right_and_chains_use_the_first_result(samples) -> None:
    for s in samples:
        steps = s.extra["steps"]
        operands = [int(x) for x in re.findall(r"\d+", s.messages[-1]["content"])]
        results = [evaluate(e) for e in steps]
        assert results[-1] == int(s.ground_truth)
        assert all(0 <= int(x) < 1000 for e in steps for x in e.split()[::2])
        if s.extra["kind"] == "chain":
            a, b, c = operands
            assert steps == [f"{a} * {b}", f"{a * b} + {c}"]
        else:
            assert len(steps) == 1 and [int(x) for x in steps[0].split()[::2]] == operands


def test_the_mix_has_the_stated_shares(samples) -> None:
    task = ArithmeticTask()
    for kind, share in zip(("add", "mul", "chain"), task.mix, strict=True):
        got = sum(s.extra["kind"] == kind for s in samples) / len(samples)
        assert abs(got - share) < _binomial_bound(share, len(samples)), kind


def test_splits_draw_different_problems() -> None:
    task = ArithmeticTask()
    train = [s.messages[-1]["content"] for s in task.samples(50, 0, "train")]
    val = [s.messages[-1]["content"] for s in task.samples(50, 0, "val")]
    assert train != val
    assert train == [s.messages[-1]["content"] for s in task.samples(50, 0, "train")]


def test_the_demonstrator_is_as_imperfect_as_configured(samples) -> None:
    task = ArithmeticTask()
    rng = random.Random(0)
    sums = [s for s in samples if s.extra["kind"] == "add"]
    with_tool, mental_right, mental = 0, 0, 0
    for s in samples:
        turns = task.demonstration(s, rng)
        final = re.fullmatch(r"<answer>(\d+)</answer>", turns[-1][0])
        assert final is not None
        calls = [json.loads(t.split("\n")[1])["arguments"]["expression"] for t, _ in turns[:-1]]
        if calls:  # the tool path is always right, with one call per step
            assert calls == s.extra["steps"] and final.group(1) == s.ground_truth
            for (_, outputs), expression in zip(turns[:-1], calls, strict=True):
                assert outputs == [("calculator", str(evaluate(expression)))]
        else:
            assert s.extra["kind"] == "add", "products and chains always use the tool"
            mental += 1
            mental_right += final.group(1) == s.ground_truth
        with_tool += s.extra["kind"] == "add" and bool(calls)
    p = task.tool_use_on_add
    assert abs(with_tool / len(sums) - p) < _binomial_bound(p, len(sums))
    q = task.mental_accuracy
    assert abs(mental_right / mental - q) < _binomial_bound(q, mental)


def test_a_compacted_demonstration_is_the_two_samples_the_loop_trains() -> None:
    """The compaction task's demonstrator (`data.compaction`): its first conversation is the
    first two calls, the loop's request and the summary; its second the question and that
    summary as a user message, then the last call and the answer (or, after a vague summary,
    a guess); the summary keeps the total and the guesses are right as often as configured."""
    task = CompactionTask()
    rng = random.Random(0)
    samples = task.samples(400, 0, "sft")
    kept, guessed, guessed_right = 0, 0, 0
    for s in samples:
        steps = s.extra["steps"]
        results = [evaluate(e) for e in steps]
        assert results[-1] == int(s.ground_truth) and all(0 <= r < 1000 for r in results)
        first, second = task.conversations(s, rng)
        assert first[:2] == s.messages == second[:2]
        said = [m["content"] for m in first if m["role"] == "assistant"]
        calls = [json.loads(t.split("\n")[1])["arguments"]["expression"] for t in said[:-1]]
        assert calls == steps[:2]
        assert first[-2] == {"role": "user", "content": SUMMARY_ASK}
        summary = first[-1]["content"]
        assert second[2] == {"role": "user", "content": SUMMARY_PREFIX + summary}
        answer = re.fullmatch(r"<answer>(\d+)</answer>", second[-1]["content"])
        assert answer is not None
        if summary == f"The total so far is {results[1]}.":
            kept += 1
            assert steps[2] in second[3]["content"] and answer.group(1) == s.ground_truth
        else:
            assert summary == VAGUE_SUMMARY and len(second) == 4
            guessed += 1
            guessed_right += answer.group(1) == s.ground_truth
    p = 1 - task.vague_summary
    assert abs(kept / len(samples) - p) < _binomial_bound(p, len(samples))
    q = task.mental_accuracy
    assert abs(guessed_right / guessed - q) < _binomial_bound(q, guessed)
