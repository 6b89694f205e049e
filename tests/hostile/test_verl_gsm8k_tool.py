"""verl's GSM8K tool (`jax_agent_rl.compat.verl.gsm8k_tool`, served as verl.tools.gsm8k_tool)
under a policy that wants its reward: one trajectory's instance never scores against another's
ground truth, whatever the model puts in its arguments, and arguments of the wrong shape or size are
error observations or ordinary wrong answers, never a crash or a reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

from jax_agent_rl.tools.registry import LocalTools
from tests.tools.test_verl_tools import VERL_GSM8K_YAML, verl_registry

NAME = "calc_gsm8k_reward"


def test_interleaved_trajectories_score_only_against_their_own_ground_truth(
    tmp_path: Path,
) -> None:
    """Trajectory a (truth 15) submits b's answer, and tries to name b's instance or its own
    ground truth in the arguments: it scores 0; b's state is untouched by a's calls and by
    a's release."""
    tools = LocalTools(verl_registry(tmp_path, VERL_GSM8K_YAML))

    async def scenario() -> list[tuple[str, float, bool]]:
        a, b = {"ground_truth": "15"}, {"ground_truth": "99"}
        out = []
        for traj, args, kwargs in (
            ("a", {"answer": "14"}, a),
            ("b", {"answer": "99"}, b),
            ("a", {"answer": "99", "ground_truth": "99", "instance_id": "b"}, a),
            ("a", {"answer": "99"}, a),
        ):
            r = await tools.call(traj, NAME, args, kwargs)
            out.append((r.text, r.reward, r.error))
        await tools.release("a")
        r = await tools.call("b", NAME, {"answer": "99"}, b)  # b's best stays 1.0
        out.append((r.text, r.reward, r.error))
        await tools.release("b")
        return out

    results = asyncio.run(scenario())
    assert results[0][:2] == ("Current parsed answer='14' reward=0.0", -0.05)
    assert results[1][:2] == ("Current parsed answer='99' reward=1.0", 0.0)
    # extra arguments do not fit the schema: an error observation, nothing scored
    assert results[2][2] and "reward=" not in results[2][0]
    assert results[3][:2] == ("Current parsed answer='99' reward=0.0", -0.05)
    assert results[4][:2] == ("Current parsed answer='99' reward=1.0", -0.05)  # no improvement


def test_odd_arguments_are_errors_or_wrong_answers(tmp_path: Path) -> None:
    """A 1 MB answer with the right number buried early (verl's rule reads the last 300
    characters), a number where a string is declared, a list, no answer: none crashes the
    tool and none is rewarded."""
    tools = LocalTools(verl_registry(tmp_path, VERL_GSM8K_YAML))

    async def scenario() -> list[tuple[str, float, bool]]:
        out = []
        for i, args in enumerate(
            [{"answer": "15 " + "x" * 1_000_000}, {"answer": 15}, {"answer": ["15"]}, {}]
        ):
            r = await tools.call(f"t{i}", NAME, args, {"ground_truth": "15"})
            out.append((r.text[-40:], r.reward, r.error))
            await tools.release(f"t{i}")
        return out

    buried, number, listed, empty = asyncio.run(scenario())
    assert not buried[2] and buried[0].endswith("' reward=0") and buried[1] == -0.05
    for result in (number, listed, empty):
        assert result[2] and "reward=1" not in result[0] and result[1] <= 0.0
