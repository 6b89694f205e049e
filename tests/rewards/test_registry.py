"""Rewards named in the config: built-in names, user functions (ours and verl's signature, from
a module or a file) and the choice of reward per data_source. The user functions are the ones
defined in this module, loaded by name as a user's would be."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.config import ConfigError, DataSection, JarlConfig, load_config
from jax_agent_rl.rewards import Answer, Scorer, load_reward, make_reward

HERE = "tests.rewards.test_registry"
NOT_CALLABLE = 3


def exact_match(text: str, ground_truth: Any) -> float:
    """Our signature: (text, ground_truth)."""
    return float(text.strip() == str(ground_truth))


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None
) -> dict[str, Any]:
    """verl's signature; a dict result (its ``score`` is the reward, ``acc`` is extra)."""
    assert extra_info is not None
    correct = solution_str.strip() == str(ground_truth)
    bonus = 0.5 if data_source == "mine" and extra_info.get("split") == "train" else 0.0
    return {"score": float(correct) + bonus, "acc": correct}


def keyword_only(*, data_source: str, solution_str: str, ground_truth: Any, **kwargs: Any) -> int:
    """verl calls with keywords; ``extra_info`` arrives in ``**kwargs``."""
    del solution_str, ground_truth
    return len(kwargs["extra_info"]) + len(data_source)


def three_args(a: str, b: str, c: str) -> float:
    del a, b, c
    return 0.0


def verl_without_extra_info(data_source: str, solution_str: str, ground_truth: str) -> float:
    del data_source, solution_str, ground_truth
    return 0.0


async def async_reward(text: str, ground_truth: Any) -> float:
    del text, ground_truth
    return 0.0


def bad_dict(text: str, ground_truth: Any) -> Any:
    del text, ground_truth
    return {"acc": 1.0}


def a_string(text: str, ground_truth: Any) -> Any:
    del text, ground_truth
    return "high"


def not_a_number(text: str, ground_truth: Any) -> Any:
    del text, ground_truth
    return math.nan


def a_bool(text: str, ground_truth: Any) -> Any:
    return text == ground_truth


def test_builtin_names() -> None:
    assert load_reward("gsm8k", "data.reward")("openai/gsm8k", "#### 72", "#### 72", {}) == 1.0
    assert load_reward("math", "data.reward")("x", "\\boxed{7}", "7", {}) == 1.0
    assert load_reward("format", "data.reward")("x", "<answer>3</answer>", "9", {}) == 1.0


def test_user_function_with_our_signature() -> None:
    score = load_reward(f"{HERE}:exact_match", "data.reward")
    assert score("any", " 42 ", 42, {}) == 1.0
    assert score("any", "41", 42, {}) == 0.0


def test_user_function_with_verls_signature_gets_source_and_extra_info() -> None:
    score = load_reward(f"{HERE}:compute_score", "data.reward")
    assert score("mine", "42", "42", {"split": "train"}) == 1.5  # a dict: its "score"
    assert score("mine", "42", "42", {"split": "test"}) == 1.0
    assert score("other", "41", "42", {"split": "train"}) == 0.0
    keywords = load_reward(f"{HERE}:keyword_only", "data.reward")
    assert keywords("abc", "", None, {"index": 1, "split": "x"}) == 5.0  # 2 extra keys + 3


def test_a_bool_result_is_a_number() -> None:
    assert load_reward(f"{HERE}:a_bool", "data.reward")("s", "yes", "yes", {}) == 1.0


def test_user_function_from_a_file(tmp_path: Path) -> None:
    """verl's ``custom_reward_function.path`` is a file: ``path.py:function`` loads it."""
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return 2.0 if solution_str == ground_truth else 0.0\n"
    )
    score = load_reward(f"{path}:compute_score", "data.reward")
    assert score("s", "a", "a", {}) == 2.0


BAD_SPECS = {
    "f1": r"data\.reward='f1' is not a reward; built in: \['format', 'gsm8k', 'math', "
    r"'reasoning_gym'\], 'judge' \(a model, data\.judge\), or a user function as "
    r"module:function or path/to/file\.py:function",
    "no_such_pkg_xyz.scores:fn": r"data\.reward='no_such_pkg_xyz\.scores:fn': cannot import "
    r"module 'no_such_pkg_xyz\.scores'",
    f"{HERE}:nope": rf"data\.reward='{HERE}:nope': {HERE} has no function 'nope'",
    f"{HERE}:NOT_CALLABLE": r"has no function 'NOT_CALLABLE'",
    "/no/such/reward.py:fn": r"data\.reward='/no/such/reward\.py:fn': no such file",
    f"{HERE}:three_args": r"its signature \(a: 'str', b: 'str', c: 'str'\) -> 'float' is neither "
    r"\(text, ground_truth\) nor verl's compute_score\(data_source, solution_str, ground_truth, "
    r"extra_info\)",
    f"{HERE}:verl_without_extra_info": r"is neither \(text, ground_truth\)",
    f"{HERE}:async_reward": r"a reward must be a plain function, not async",
}


@pytest.mark.parametrize("spec", sorted(BAD_SPECS))
def test_bad_reward_names_the_key_and_what_is_accepted(spec: str) -> None:
    with pytest.raises(ConfigError, match=BAD_SPECS[spec]):
        load_reward(spec, "data.reward")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("bad_dict", r"returned a dict without a 'score' key \(keys: \['acc'\]\)"),
        ("a_string", r"returned 'high'; a reward returns a finite number or a dict whose"),
        ("not_a_number", r"returned nan; a reward returns a finite number"),
    ],
)
def test_bad_result_names_the_reward(name: str, problem: str) -> None:
    score = load_reward(f"{HERE}:{name}", "data.rewards_by_source.mine")
    with pytest.raises(
        ValueError, match=rf"data\.rewards_by_source\.mine='{HERE}:{name}' {problem}"
    ):
        score("mine", "text", "truth", {})


def _scored(score: Scorer, source: str, text: str, truth: Any, extra: dict[str, Any]) -> float:
    return asyncio.run(score(Answer(source, "the question", text, truth, extra)))


def _config(*overrides: str) -> JarlConfig:
    return load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])


ANSWER = "She sold 48 + 24 = 72 clips.\n#### 72"


def test_verls_data_sources_pick_verls_scorer_by_default() -> None:
    """As verl's default_compute_score: openai/gsm8k rows by the GSM8K scorer, MATH rows by
    the boxed-answer one; other sources by ``data.reward``."""
    score = make_reward(_config().data)
    assert _scored(score, "openai/gsm8k", ANSWER, "#### 72", {}) == 1.0
    assert _scored(score, "my_gsm8k_copy", ANSWER, "#### 72", {}) == 0.0  # data.reward: math
    assert _scored(score, "my_gsm8k_copy", "<answer>72</answer>", "72", {}) == 1.0
    for source in (
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    ):
        assert _scored(score, source, "So \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", {}) == 1.0
        assert _scored(score, source, ANSWER, "72", {}) == 0.0  # no boxed answer


def test_rewards_by_source_entries_replace_and_add() -> None:
    cfg = _config(
        "data.rewards_by_source.openai/gsm8k=format",
        f"data.rewards_by_source.mine={HERE}:compute_score",
    )
    assert cfg.data.rewards_by_source["lighteval/MATH"] == "math"  # the others stay
    score = make_reward(cfg.data)
    assert _scored(score, "openai/gsm8k", ANSWER, "#### 72", {}) == 0.0  # format: no <answer> block
    assert _scored(score, "openai/gsm8k", "<answer>1</answer>", "#### 72", {}) == 1.0
    assert _scored(score, "mine", "7", "7", {"split": "train"}) == 1.5


def test_data_reward_scores_the_unlisted_sources() -> None:
    score = make_reward(_config(f"data.reward={HERE}:exact_match").data)
    assert _scored(score, "anything", "7", "7", {}) == 1.0
    assert _scored(score, "anything", "<answer>7</answer>", "7", {}) == 0.0
    assert (
        _scored(score, "openai/gsm8k", "<answer>7</answer>", "7", {}) == 1.0
    )  # still listed: gsm8k


def test_a_bad_entry_fails_when_the_rewards_are_made() -> None:
    data = DataSection(train="t.jsonl", rewards_by_source={"mine": f"{HERE}:three_args"})
    with pytest.raises(ConfigError, match=rf"data\.rewards_by_source\.mine='{HERE}:three_args'"):
        make_reward(data)
    with pytest.raises(ConfigError, match=r"data\.reward='gsm8kk' is not a reward"):
        make_reward(DataSection(train="t.jsonl", reward="gsm8kk"))
