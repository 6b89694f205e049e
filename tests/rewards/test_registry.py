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
    assert load_reward("verl_gsm8k", "data.reward")("x", "#### 72", "72", {}) == 1.0
    assert load_reward("verl_gsm8k", "data.reward")("x", "#### 72.0", "72", {}) == 0.0
    assert load_reward("gsm8k_lenient", "data.reward")("x", "#### 72.0", "#### 72", {}) == 1.0
    assert load_reward("verl_math", "data.reward")("x", "\\boxed{0.5}", "\\frac12", {}) == 1.0
    assert load_reward("verl_dapo", "data.reward")("x", "Answer: 7", "7", {}) == 1.0  # its dict
    assert load_reward("verl_dapo", "data.reward")("x", "Answer: 8", "7", {}) == -1.0
    assert (
        load_reward("verl_qa_em", "data.reward")(
            "x", "<answer>A B</answer>", {"target": ["b", "a b"]}, {}
        )
        == 1.0
    )
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
    "f1": r"data\.reward='f1' is not a reward; built in: format, gsm8k_lenient, math, "
    r"reasoning_gym, verl_dapo, verl_gsm8k, verl_math, verl_qa_em, judge \(a model, "
    r"data\.judge\); or a user function as module:function or path/to/file\.py:function",
    "gsm8k": r"data\.reward='gsm8k' is not a reward; built in: .*gsm8k_lenient.*verl_gsm8k",
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
        ("a_string", r"gave reward 'high', a str: expected a number \(an int or a float\)"),
        ("not_a_number", r"gave reward nan: not a finite number"),
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


def test_with_data_reward_unset_rows_are_scored_by_source() -> None:
    """As verl's default_compute_score: openai/gsm8k rows by verl's strict GSM8K rule, MATH rows
    by its boxed-answer rule, math/aime rows by its DAPO rule; reasoning-gym rows by their task;
    other sources by ``math``."""
    data = _config().data
    assert data.reward == "" and data.rewards_by_source == {}
    score = make_reward(data)
    assert _scored(score, "openai/gsm8k", ANSWER, "72", {}) == 1.0
    assert _scored(score, "openai/gsm8k", "The answer is 72", "72", {}) == 0.0  # verl: strict
    assert _scored(score, "openai/gsm8k", "<answer>72</answer>", "72", {}) == 0.0
    assert _scored(score, "my_gsm8k_copy", ANSWER, "72", {}) == 0.0  # math: no <answer>
    assert _scored(score, "my_gsm8k_copy", "<answer>72</answer>", "72", {}) == 1.0
    for source in (
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    ):
        assert _scored(score, source, "So \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", {}) == 1.0
        assert _scored(score, source, ANSWER, "72", {}) == 0.0  # no boxed answer
    for source in ("math_dapo", "math", "aime2024"):
        assert _scored(score, source, "Answer: 72", "72", {}) == 1.0
        assert _scored(score, source, "<answer>72</answer>", "72", {}) == -1.0
    for source in ("hiyouga/geometry3k", "codecontests"):  # verl's, scorers not shipped here
        with pytest.raises(NotImplementedError, match=rf"{source}.*set data\.reward"):
            _scored(score, source, "\\boxed{1}", "1", {})


def test_data_reward_set_overrides_every_source() -> None:
    """verl's custom_reward_function: the user's reward scores verl's sources too."""
    with make_reward(_config(f"data.reward={HERE}:exact_match").data) as score:
        for source in ("anything", "openai/gsm8k", "lighteval/MATH", "aime2024", "reasoning_gym/x"):
            assert _scored(score, source, "7", "7", {}) == 1.0
            assert _scored(score, source, "#### 7", "7", {}) == 0.0
    assert (
        _scored(
            make_reward(_config("data.reward=gsm8k_lenient").data),
            "openai/gsm8k",
            "#### 7.0",
            "7",
            {},
        )
        == 1.0
    )


def test_rewards_by_source_wins_over_data_reward() -> None:
    cfg = _config(
        f"data.reward={HERE}:exact_match",
        "data.rewards_by_source.openai/gsm8k=format",
        f"data.rewards_by_source.mine={HERE}:compute_score",
    )
    with make_reward(cfg.data) as score:
        assert _scored(score, "openai/gsm8k", ANSWER, "72", {}) == 0.0  # format: no <answer>
        assert _scored(score, "openai/gsm8k", "<answer>1</answer>", "72", {}) == 1.0
        assert _scored(score, "mine", "7", "7", {"split": "train"}) == 1.5
        assert _scored(score, "lighteval/MATH", "7", "7", {}) == 1.0  # not listed: data.reward
    unset = make_reward(_config("data.rewards_by_source.mine=format").data)
    assert _scored(unset, "mine", "<answer>1</answer>", "7", {}) == 1.0
    assert _scored(unset, "openai/gsm8k", ANSWER, "72", {}) == 1.0  # not listed: by source


def test_an_empty_rewards_by_source_entry_is_a_one_line_error() -> None:
    """An empty entry would leave open whether data.reward or the source's default applies."""
    data = DataSection(train="t.jsonl", reward="math", rewards_by_source={"openai/gsm8k": " "})
    with pytest.raises(
        ConfigError, match=r"^data\.rewards_by_source\.openai/gsm8k is empty: name"
    ) as e:
        make_reward(data)
    assert "\n" not in str(e.value)


def test_a_bad_entry_fails_when_the_rewards_are_made() -> None:
    data = DataSection(train="t.jsonl", rewards_by_source={"mine": f"{HERE}:three_args"})
    with pytest.raises(ConfigError, match=rf"data\.rewards_by_source\.mine='{HERE}:three_args'"):
        make_reward(data)
    with pytest.raises(ConfigError, match=r"data\.reward='gsm8kk' is not a reward"):
        make_reward(DataSection(train="t.jsonl", reward="gsm8kk"))
