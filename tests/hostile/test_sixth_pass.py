"""Model text against the rewards and parsers, a sixth pass: what a policy can write to make a
reward take unbounded time, score an answer that is not the ground truth, or reach a tool
with values no strict JSON writer takes.

Before the fixes: ``####`` followed by 100,000 spaces held the ``gsm8k_lenient`` reward for
about three minutes (its final-answer regex split the run of spaces between two ``\\s*`` every
way, quadratic in the run; a reward thread is abandoned at the timeout, not freed)."""

from __future__ import annotations

import pytest

from jax_agent_rl.rewards.math import gsm8k_answer, gsm8k_lenient_reward


@pytest.mark.timeout(60)  # a bound on a hang: the linear scan takes milliseconds
def test_a_final_answer_mark_followed_by_a_long_run_of_spaces_is_read_in_linear_time() -> None:
    spaces = " " * 100_000  # quadratic: ~3 minutes; 8,000 spaces took 1 s
    assert gsm8k_lenient_reward(f"####{spaces}x", "42") == 0.0
    assert gsm8k_lenient_reward(f"####{spaces}$ 42", "42") == 1.0
    assert gsm8k_lenient_reward(f"#### ${spaces}x the answer is 42", "42") == 1.0
    # every way GSM8K's line is written still reads
    for line in ("####42", "#### 42", "#### $42", "####$ 42", "#### \n $ \t42", "#### $1,042.5"):
        assert gsm8k_answer(f"so {line}") == line.rpartition("$")[2].split()[-1].lstrip("#")
