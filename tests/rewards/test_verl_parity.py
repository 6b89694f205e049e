"""verl's rule scorers, ours against verl's own: every case below (hand-written, then seeded
fuzz) is scored by `jax_agent_rl.compat.verl.rules` here and by the real verl 0.9.1
(``.verl-ref``, `scripts/setup.sh verl-ref`) in one subprocess for the module, and the results
must be equal, types included (verl's int ``0`` is not ``0.0``; dapo's dict field by field).
verl is imported only in that subprocess: in this process it would be found as ``verl`` by the
tests of our own ``verl`` compatibility package.

Then: `default_compute_score` routes every source we ship as verl's does, and the trainer's
scoring (`trajectory_reward`) reads what verl reads for verl data: the whole decoded response.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.compat.verl import rules as verl_rules
from jax_agent_rl.config import load_config
from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.train.rollout_score import scored_text, trajectory_reward

VERL_REF = Path(__file__).resolve().parents[2] / ".verl-ref"
FUZZ_PER_SCORER = 200
MIN_HAND_WRITTEN = 50

# what verl's process runs: each case {"scorer", "args", "kwargs"} through verl's function
VERL_SCRIPT = """
import json, sys
import verl
from verl.utils.reward_score import default_compute_score, gsm8k, math_dapo, math_reward
from verl.utils.reward_score import search_r1_like_qa_em
assert verl.__file__.startswith(sys.argv[3]), verl.__file__  # the real verl, nothing else
FNS = {"gsm8k": gsm8k.compute_score, "math": math_reward.compute_score,
       "dapo": math_dapo.compute_score, "qa_em": search_r1_like_qa_em.compute_score,
       "default": default_compute_score}
def tagged(x):
    if isinstance(x, dict):
        return {k: tagged(v) for k, v in x.items()}
    return [type(x).__name__, x]
out = []
for case in json.load(open(sys.argv[1])):
    try:
        out.append(tagged(FNS[case["scorer"]](*case["args"], **case["kwargs"])))
    except Exception as e:
        out.append(["raises", type(e).__name__])
json.dump(out, open(sys.argv[2], "w"))
"""

OURS: dict[str, Callable[..., Any]] = {
    "gsm8k": verl_rules.gsm8k_score,
    "math": verl_rules.math_score,
    "dapo": verl_rules.dapo_score,
    "qa_em": verl_rules.qa_em_score,
    "default": verl_rules.default_compute_score,
}


def _tagged(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tagged(v) for k, v in x.items()}
    return [type(x).__name__, x]


def _ours(case: dict[str, Any]) -> Any:
    try:
        return _tagged(OURS[case["scorer"]](*case["args"], **case["kwargs"]))
    except Exception as e:  # verl raised too (checked by the caller), maybe another type
        return ["raises", type(e).__name__]


def _case(scorer: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"scorer": scorer, "args": list(args), "kwargs": kwargs}


PAD = "Let me think about this step by step. " * 10  # 380 characters


def _gsm8k_cases() -> list[dict[str, Any]]:
    responses_15 = [
        "The answer is 15", "#### 15.0", "\\boxed{15}", "<answer>15</answer>", "#### 15",
        "####15", "#### 15 apples", "#### 15.", "#### $15", "#### 15\n", "####  15", "### 15",
        "# 15", "#### 15 #### 16", "#### 16 #### 15", "#### +15", "#### 1 5", "#### 015",
        "#### 15,", "#### ,15", "#### 1,5", "#### \u0661\u0665", "#### \uff11\uff15",
        "\uff03" * 4 + " 15",
        "##### 15", "#### -15", "#### 15\u00a0", "#### 15 is it", "It is 15.\n#### 15",
        PAD + "#### 15", "#### 15" + PAD, "#### 15" + "y" * 293, "#### 15" + "y" * 294,
        "x" * 296 + "#### 15", "x" * 294 + "#### 15", "",
        "<tool_response>#### 15</tool_response>\nassistant\nI think 14.",
        "<think>#### 15</think>", "#### 15\n#### ", "#### .", "####", "15 #### 15 #### x",
        "total = 5 + 10 = 15", "#### 15.00", "#### 1.5e1", "#### 15🙂", "日本語 #### 15",
    ]  # fmt: skip
    cases = [_case("gsm8k", r, "15") for r in responses_15]
    cases += [
        _case("gsm8k", "#### 1,500", "1500"),
        _case("gsm8k", "#### 1,500.00", "1500"),
        _case("gsm8k", "#### -3", "-3"),
        _case("gsm8k", "#### - 3", "-3"),
        _case("gsm8k", "#### \u22123", "-3"),  # a minus sign
        _case("gsm8k", "#### .5", "0.5"),
        _case("gsm8k", "#### 0.5", ".5"),
        _case("gsm8k", "#### 15", 15),  # an int ground truth never equals the extracted string
        _case("gsm8k", "#### 15", "#### 15"),
        _case("gsm8k", "#### ,", ""),
    ]
    for r in ("The answer is 15", "I get 15. Done.", "15, or maybe 16.", "nothing", ". . .",
              "#### 15", "-15", "1,5", "x" * 310 + "15", "15" + "x" * 310):  # fmt: skip
        cases.append(_case("gsm8k", r, "15", method="flexible"))
    cases += [
        _case("gsm8k", "#### 15", "15", format_score=0.1, score=2.0),
        _case("gsm8k", "#### 16", "15", format_score=0.1, score=2.0),
        _case("gsm8k", "no answer", "15", format_score=0.1, score=2.0),
        _case("gsm8k", "#### 16", "15", "strict", 0.25, 3),
    ]
    return cases


def _math_cases() -> list[dict[str, Any]]:
    pairs = [
        ("\\boxed{15}", "15"), ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"), ("\\boxed{\\tfrac12}", "\\frac{1}{2}"),
        ("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{.5}", "0.5"), ("\\boxed{\\frac12}", "\\frac{1}{2}"),
        ("\\boxed{\\frac1{2}}", "\\frac{1}{2}"), ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ("\\boxed 15$ and more", "15"), ("\\boxed 15", "15"), ("\\boxed 15 \\boxed{16}", "15"),
        ("\\fbox{15}", "15"), ("\\boxed{15", "15"), ("\\boxedx{15}", "15"), ("15", "15"),
        ("\\boxed{10\\text{ cm}}", "10"), ("\\boxed{10\\text{ cm}\\text{ m}}", "10"),
        ("\\boxed{10\\text{ cm}\\text{ m}}", "10\\text{ cm}\\text{ m}"),
        ("\\boxed{10\\text{cm}}", "10"), ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt2"), ("\\boxed{x = 5}", "5"), ("\\boxed{xyz = 5}", "5"),
        ("\\boxed{90^\\circ}", "90"), ("\\boxed{90^{\\circ}}", "90"), ("\\boxed{50\\%}", "50"),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"), ("\\boxed{\\frac{\\sqrt{3}}{2}}",
        "\\frac{\\sqrt{3}}{2}"), ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{{a}{b}}", "{a}{b}"), ("\\boxed{15} then \\boxed{16}", "16"),
        ("\\boxed{2\\sqrt}", "2\\sqrt"), ("\\boxed{\\frac}", "\\frac"), ("\\boxed{\\frac1}", "1"),
        ("\\boxed{15}", 15), ("\\boxed{15}", None), ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("\\boxed{\\$15}", "15"), ("\\boxed{15\\!000}", "15000"), ("\\boxed{1,000}", "1000"),
        ("\\boxed{π}", "π"), (PAD * 3 + "\\boxed{15}", "15"), ("\\boxed{-1/2}", "\\frac{-1}{2}"),
        ("\\boxed{01/2}", "\\frac{1}{2}"), ("\\boxed{1/2/3}", "1/2/3"), ("\\boxed{}", ""),
        ("\\boxed{ }", ""), ("\\boxed{\n15\n}", "15"), ("\\boxed{\\\\frac{1}{2}}", "\\frac{1}{2}"),
        ("$\\boxed{15}$", "15"), ("\\boxed{\\left.5\\right.}", "5"), ("\\boxed{ .5}", "0.5"),
        ("\\boxed{a=b=c}", "c"), ("\\boxed{}}", ""), ("", "15"), ("}\\boxed{15}{", "15"),
    ]  # fmt: skip
    return [_case("math", r, t) for r, t in pairs]


def _dapo_cases() -> list[dict[str, Any]]:
    pairs = [
        ("Answer: 15", "15"), ("answer : 15", "15"), ("Answer:15", "15"), ("ANSWER: 15", "15"),
        ("Answer: 15 dollars", "15"), ("Answer: $15$", "15"), ("Answer: \\boxed{15}", "15"),
        ("Answer: x = 15", "15"), ("Answer: 1,000", "1000"), ("Answer: 1,000", "1,000"),
        ("Answer: \\frac12", "\\frac{1}{2}"), ("Answer: 15\nmore", "15"), ("Answer:\n15", "15"),
        ("The final answer: 15", "15"), ("\\boxed{15}", "15"), ("\\boxed{15}" + "." * 95, "15"),
        ("\\boxed{15}" + "." * 100, "15"), ("Answer: 15" + PAD, "15"), (PAD + "Answer: 15", "15"),
        ("Answer: [INVALID]", "[INVALID]"), ("Answer: [INVALID] \\boxed{15}", "15"),
        ("Answer: a 15", "15"), ("Answer: 15 students", "15"), ("Answer: 2 ways", "2"),
        ("Answer: 10^\\circ", "10"), ("Answer: \\text{(B)}", "(B)"), ("Answer: \\textbf{7}", "7"),
        ("Answer: \\overline{12}", "12"), ("Answer: 3\\sqrt2", "3\\sqrt{2}"),
        ("Answer: $1$ and $2$", "1"), ("", "15"), ("Answer: 16", "15"), ("Answer: 15.", "15"),
        ("Answer: 15.0", "15"), ("Answer: -15", "-15"), ("Answer: ²", "2"),
        ("Answer: 15\nAnswer: 16", "16"), ("Answer: 15 \\boxed{16}", "16"),
        ("Answer: an apple", "apple"), ("Answer: \\mbox{cat}", "cat"), ("Answer: 5 km", "5"),
        ("Answer: 1\\text{ and }2", "1,2"), ("Answer: 12 \\text{m}", "12"),
        ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ 15}", "15"), ("Answer: 15", "x = 15"), ("Answer: 15", "$15$"),
        ("Answer: 15", "\\boxed{15}"), ("Answer: ", "15"), ("no answer at all", "15"),
        ("Answer: 15 \\ldots", "15"), ("Answer: \"15\"", "15"), ("Answer: 1{,}000", "1000"),
    ]  # fmt: skip
    cases = [_case("dapo", r, t) for r, t in pairs]
    for r in ("Answer: 15", "\\boxed{15}", "\\boxed{ 15}", "Answer: 15 \\boxed{15}",
              "\\boxed{15}" + "." * 100, PAD + "\\boxed{15}"):  # fmt: skip
        cases.append(_case("dapo", r, "15", strict_box_verify=True))
    cases += [
        _case("dapo", "\\boxed{15}" + "." * 150, "15", pause_tokens_index=[0, 0, 0, 60]),
        _case("dapo", "\\boxed{15}" + "." * 150, "15", pause_tokens_index=[0, 0, 0, 150]),
        _case("dapo", "\\boxed{15}" + "." * 150, "15", True, [1, 2, 3, 40]),
    ]
    return cases


def _qa_cases() -> list[dict[str, Any]]:
    paris = {"target": ["Paris"]}
    pairs = [
        ("<answer>Paris</answer>", paris), ("<answer> paris. </answer>", paris),
        ("<answer>The Paris</answer>", paris), ("<answer>Paris, France</answer>", paris),
        ("<answer>Paris</answer>", {"target": "Paris"}), ("<answer>Lyon</answer>", paris),
        ("<answer>Lyon</answer><answer>Paris</answer>", paris),
        ("<answer>Paris</answer><answer>Lyon</answer>", paris), ("Paris", paris),
        ("<answer>\nParis\n</answer>", paris), ("<answer>Paris", paris), ("<Answer>Paris</Answer>",
        paris), ("<answer>Zürich</answer>", {"target": ["zurich"]}),
        ("<answer>Zürich</answer>", {"target": ["ZÜRICH"]}), ("<answer>São Paulo</answer>",
        {"target": ["sao paulo", "São Paulo"]}), ("<answer>U.S.A.</answer>", {"target": ["USA"]}),
        ("<answer>an apple</answer>", {"target": ["apple"]}), ("<answer>theater</answer>",
        {"target": ["ater"]}), ("<answer>a</answer>", {"target": [""]}),
        ("<answer></answer>", {"target": [""]}), ("<answer></answer>", {"target": []}),
        ("<answer>1,000</answer>", {"target": ["1000"]}), ("<answer>1 000</answer>",
        {"target": ["1000"]}), ("<answer>New   York</answer>", {"target": ["new york"]}),
        ("<answer>New-York</answer>", {"target": ["newyork"]}), ("<answer>“Paris”</answer>",
        paris), ("<answer>Paris!</answer>" * 11, paris), ("<answer>Paris!</answer>" * 10, paris),
        ("<answer>" * 11 + "Paris</answer>", paris), ("<answer>Lyon</answer>" * 11, paris),
        ("<answer>A B</answer>", {"target": ["b", "a b"]}), ("<answer>THE END</answer>",
        {"target": ["end"]}), ("<answer>the end</answer>", {"target": ["The End."]}),
        ("<answer>42</answer>", {"target": ["42", "forty-two"]}),
        ("<answer>forty two</answer>", {"target": ["42", "forty-two"]}),
        ("<answer><answer>Paris</answer></answer>", paris), (PAD * 3 + "<answer>Paris</answer>",
        paris), ("<answer>Paris</answer>" + PAD * 3, paris), ("", paris),
        ("<answer>Pa\nris</answer>", paris), ("<answer>Paris\t</answer>", paris),
        ("<answer>ﬁ</answer>", {"target": ["fi"]}), ("<answer>İstanbul</answer>",
        {"target": ["istanbul"]}), ("<answer>an</answer>", {"target": ["the"]}),
        ("<answer>Barack Obama</answer>", {"target": ["Obama"]}),
        ("<answer>Obama</answer>", {"target": ["Barack Obama", "Obama"]}),
        ("text <answer>Paris</answer> text", paris), ("</answer>Paris<answer>", paris),
        ("<answer>Paris</answer>", {"target": ["Paris"], "extra": 1}),
    ]  # fmt: skip
    cases = [_case("qa_em", r, t) for r, t in pairs]
    cases += [
        _case("qa_em", "<answer>Paris</answer>", paris, format_score=0.1, score=2.0),
        _case("qa_em", "<answer>Lyon</answer>", paris, format_score=0.1, score=2.0),
        _case("qa_em", "<answer>Paris</answer>" * 12, paris, "strict", 0.0, 3.0),
    ]
    return cases


HAND_WRITTEN = {
    "gsm8k": _gsm8k_cases(),
    "math": _math_cases(),
    "dapo": _dapo_cases(),
    "qa_em": _qa_cases(),
}


# --- seeded fuzz ---------------------------------------------------------------------------

NUMBERS = ["15", "-15", "1500", "1,500", "15.0", "0.5", ".5", "007", "1.5e1", "\u0661\u0665", "3/4"]
NOISE = ["#", "####", "#### ", " ", ",", "$", "\\$", ".", "-", "\n", "=", "\\boxed{", "}", "{",
         "\\boxed ", "\\fbox{", "Answer: ", "answer:", "<answer>", "</answer>", "\\frac",
         "\\sqrt", "\\text{ cm}", "\\%", "^\\circ", "\\left(", "\\right)", "the ", "an ",
         "é", "🙂", "日本"]  # fmt: skip
FILLER = "We add the numbers and carry the one. "


def _mutate(rng: random.Random, text: str) -> str:
    """One random edit: insert noise, a number or filler (long enough to push an answer out of
    a 100- or 300-character window); delete, duplicate; keep a head or a tail."""
    at = rng.randint(0, len(text))
    edits = [
        lambda: text[:at] + rng.choice(NOISE) + text[at:],
        lambda: text[:at] + rng.choice(NUMBERS) + text[at:],
        lambda: text[:at] + FILLER * rng.randint(1, 9) + text[at:],
        lambda: text[:at] + text[at + rng.randint(1, 4) :],
        lambda: text[:at] + text[at : at + 6] * 2 + text[at + 6 :],
        lambda: text[rng.randint(0, len(text)) :],
        lambda: text[:at],
    ]
    return rng.choice(edits)()


def _fuzzed(rng: random.Random, seeds: list[tuple[str, Any]], truths: list[Any]) -> list[Any]:
    """A seed response after 1 to 3 random edits, and mostly its own ground truth."""
    text, truth = rng.choice(seeds)
    for _ in range(rng.randint(1, 3)):
        text = _mutate(rng, text)
    return [text, truth if rng.random() < 0.7 else rng.choice(truths)]


def _fuzz_cases() -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(31)
    n = range(FUZZ_PER_SCORER)
    seeds: list[tuple[str, Any]] = [
        ("#### 15", "15"),
        ("The answer is 15.\n#### 15", "15"),
        ("#### 1,500", "1500"),
        ("#### -15", "-15"),
        ("So 15 apples.", "15"),
    ]
    truths: list[Any] = ["15", "1500", "-15", "15.0"]
    gsm8k = [
        _case("gsm8k", *_fuzzed(rng, seeds, truths), rng.choice(["strict", "flexible"])) for _ in n
    ]
    seeds = [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("so \\boxed{15} cm", "15"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
        ("\\boxed 15$", "15"),
        ("\\boxed{x = \\dfrac{3}{4}}", "3/4"),
        ("\\boxed{10\\text{ cm}}", "10"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
    ]
    truths = ["\\frac{1}{2}", "15", "\\sqrt{2}", "\\frac{3}{4}", "10", "0.5", "3/4"]
    math = [_case("math", *_fuzzed(rng, seeds, truths)) for _ in n]
    seeds = [
        ("Answer: 15", "15"),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("The result is \\boxed{15}", "15"),
        ("answer: 1,000 dollars", "1000"),
        ("Answer: x = 15\n", "15"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ]
    truths = ["15", "\\frac{1}{2}", "1000", "1,000"]
    dapo = [
        _case(
            "dapo",
            *_fuzzed(rng, seeds, truths),
            strict_box_verify=rng.random() < 0.25,
            pause_tokens_index=[0, 0, 0, rng.randint(0, 400)] if rng.random() < 0.2 else None,
        )
        for _ in n
    ]
    seeds = [
        ("<answer>Paris</answer>", {"target": ["Paris"]}),
        ("I think <answer> the Paris. </answer>", {"target": "paris"}),
        ("<answer>New York City</answer>", {"target": ["new york city", "NYC"]}),
        ("<answer>Lyon</answer><answer>Paris</answer>", {"target": ["Paris", "Lyon"]}),
    ]
    truths = [{"target": ["Paris"]}, {"target": "Lyon"}, {"target": ["the new york city"]}]
    qa_em = [_case("qa_em", *_fuzzed(rng, seeds, truths)) for _ in n]
    return {"gsm8k": gsm8k, "math": math, "dapo": dapo, "qa_em": qa_em}


FUZZ = _fuzz_cases()

# verl's router over every source its default_compute_score routes to a rule we ship
ROUTED_SOURCES = [
    *verl_rules.GSM8K_SOURCES,
    *verl_rules.MATH_SOURCES,
    *verl_rules.DAPO_SOURCES,
    "aime2024",
    "aime25",
    *verl_rules.QA_EM_SOURCES,
]
ROUTED_RESPONSES = [
    ("#### 15", "15"),
    ("\\boxed{15}", "15"),
    ("Answer: 15", "15"),
    ("The answer is 15", "15"),
    ("#### 16 \\boxed{15}", "15"),
]


def _routing_cases() -> list[dict[str, Any]]:
    cases = []
    for source in ROUTED_SOURCES:
        for text, truth in ROUTED_RESPONSES:
            target = {"target": [truth]} if source.startswith("searchR1_") else truth
            tagged = f"<answer>{truth}</answer>" if source.startswith("searchR1_") else text
            cases.append(_case("default", source, tagged, target, {"index": 0}))
    cases.append(_case("default", "no_such_source", "#### 15", "15"))
    return cases


ROUTING = _routing_cases()
ALL_CASES = [c for cases in HAND_WRITTEN.values() for c in cases]
ALL_CASES += [c for cases in FUZZ.values() for c in cases] + ROUTING


@pytest.fixture(scope="module")
def verl_results(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """verl's results for ALL_CASES, from one process that imports the real verl."""
    if not (VERL_REF / "verl").is_dir():
        pytest.fail(f"{VERL_REF} has no verl: run `scripts/setup.sh verl-ref` (make test does)")
    tmp = tmp_path_factory.mktemp("verl")
    (tmp / "cases.json").write_text(json.dumps(ALL_CASES))
    subprocess.run(
        [sys.executable, "-c", VERL_SCRIPT, "cases.json", "results.json", str(VERL_REF)],
        cwd=tmp,  # not the repository: its folders must not shadow the real verl
        env={**os.environ, "PYTHONPATH": str(VERL_REF)},
        check=True,
        capture_output=True,  # verl's scorers print (a sampled debug line, caught errors)
    )
    results = json.loads((tmp / "results.json").read_text())
    assert len(results) == len(ALL_CASES)
    return results


def _compare(cases: list[dict[str, Any]], verl_results: list[Any]) -> int:
    start = next(i for i, c in enumerate(ALL_CASES) if c is cases[0])
    theirs = verl_results[start : start + len(cases)]
    differ = [
        (case, want, got)
        for case, want in zip(cases, theirs, strict=True)
        if (got := _ours(case)) != want
    ]
    assert not differ, f"{len(differ)} of {len(cases)} differ from verl, e.g. {differ[:3]}"
    return len(cases)


@pytest.mark.parametrize("scorer", sorted(HAND_WRITTEN))
def test_hand_written_responses_score_as_verls(scorer: str, verl_results: list[Any]) -> None:
    assert _compare(HAND_WRITTEN[scorer], verl_results) >= MIN_HAND_WRITTEN


@pytest.mark.parametrize("scorer", sorted(FUZZ))
def test_fuzzed_responses_score_as_verls(scorer: str, verl_results: list[Any]) -> None:
    assert _compare(FUZZ[scorer], verl_results) == FUZZ_PER_SCORER
    outcomes = {json.dumps(_ours(c)) for c in FUZZ[scorer]}
    assert len(outcomes) >= 2  # the fuzz reaches more than one outcome


def test_the_issues_examples_score_0_under_verls_gsm8k_rule() -> None:
    """Ground truth 15: only ``#### 15`` scores, as in verl (our lenient rule accepts all)."""
    for text in ("The answer is 15", "#### 15.0", "\\boxed{15}", "<answer>15</answer>"):
        assert verl_rules.gsm8k_score(text, "15") == 0
    assert verl_rules.gsm8k_score("#### 15", "15") == 1.0


def test_default_compute_score_routes_as_verls(verl_results: list[Any]) -> None:
    """Every source we ship a rule for gets verl's rule and verl's result type; an unknown
    source raises NotImplementedError in both."""
    _compare(ROUTING, verl_results)
    assert verl_results[-1] == ["raises", "NotImplementedError"]
    for source in verl_rules.UNSHIPPED_SOURCES:  # verl's, with scorers we do not ship
        with pytest.raises(NotImplementedError, match=rf"{source!r}.*set data\.reward"):
            verl_rules.default_compute_score(source, "#### 15", "15")


# --- what the trainer scores for verl data -------------------------------------------------

CORPUS = ["<|im_start|>user\nWhat is 7 + 8?<|im_end|>\n<|im_start|>assistant\n#### 15 is it"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path, train_bpe(CORPUS, vocab_size=300), chat_template("chatml_tools"))
    return Tokenizer.from_pretrained(path)


def _two_turns(tok: Tokenizer, sample: Sample, first: str, last: str) -> Trajectory:
    """An episode in chatml: the model writes ``first``, a tool answers, the model writes
    ``last``; its response is every token after the prompt, as the loop records it."""
    traj = Trajectory(uid=sample.uid, group_id=sample.uid, prompt_ids=[1, 2])
    traj.append([*tok.encode(first), tok.token_id("<|im_end|>")], model=True)
    tool = "\n<|im_start|>user\n<tool_response>\n15\n</tool_response><|im_end|>\n"
    traj.append(tok.encode(tool + "<|im_start|>assistant\n"), model=False)
    traj.append([*tok.encode(last), tok.token_id("<|im_end|>")], model=True)
    traj.messages = [
        *sample.messages,
        {"role": "assistant", "content": first},
        {"role": "tool", "content": "15"},
        {"role": "assistant", "content": last},
    ]
    return traj


def _reward(sample: Sample, traj: Trajectory, tok: Tokenizer, *overrides: str) -> float:
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])
    with make_reward(cfg.data) as score:
        return asyncio.run(trajectory_reward(sample, traj, score, 0.0, tok))


def test_verl_rows_are_scored_on_the_whole_response_as_verl_decodes_it(
    tokenizer: Tokenizer,
) -> None:
    """A verl GSM8K row whose final message lacks ``#### 15`` but whose first turn has it scores
    1.0, as in verl (its whole decoded response, tool turns included); the same episode of a
    source verl does not know is scored on its final message."""
    load_wing("verl")  # as a run's make_reward does: verl's rule knows openai/gsm8k
    question = [{"role": "user", "content": "What is 7 + 8?"}]
    gsm8k = Sample("g", question, ground_truth="15", data_source="openai/gsm8k")
    traj = _two_turns(tokenizer, gsm8k, "#### 15", "So it is 15.")
    text = scored_text(gsm8k, traj, tokenizer)
    assert text == tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    assert "<|im_end|>" not in text and "#### 15" in text and "<tool_response>" in text
    assert _reward(gsm8k, traj, tokenizer) == verl_rules.gsm8k_score(text, "15") == 1.0
    last_only = _two_turns(tokenizer, gsm8k, "So it is 15.", "So it is 15.")
    assert _reward(gsm8k, last_only, tokenizer) == 0.0  # no "#### N" anywhere
    assert _reward(gsm8k, traj, tokenizer, "data.reward=gsm8k_lenient") == 1.0
    mine = Sample("m", question, ground_truth="15", data_source="mine")
    assert scored_text(mine, traj, tokenizer) == "So it is 15."
    mine_traj = _two_turns(tokenizer, mine, "#### 15", "<answer>15</answer>")
    assert _reward(mine, mine_traj, tokenizer) == 1.0  # math: the final <answer>
    assert _reward(mine, traj, tokenizer, "data.reward=verl_gsm8k") == 0.0  # final message only
