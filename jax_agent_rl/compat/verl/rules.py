"""verl's rule-based scorers, written here so that data in verl's layout is scored as verl scores
it (verl 0.9.1, ``verl.utils.reward_score``); ``tests/rewards/test_verl_parity.py`` runs verl's own
functions on the same inputs and requires the same results, types included.

Each scorer has the signature and the return values of verl's:

- `gsm8k_score` (verl's ``gsm8k.compute_score``): only the last 300 characters of the response
  are read. ``method="strict"`` takes the last ``#### N`` (exactly one space after the hashes;
  ``N`` a run of digits, dots and commas, optionally after a minus sign) and drops its commas;
  ``method="flexible"`` takes the last such run anywhere that is neither empty nor a lone dot,
  commas kept. The answer is compared as a string with the ground truth (``"15.0"`` is not
  ``"15"``, an int ground truth never matches): ``score`` when equal, ``format_score`` when an
  answer was found but differs, the int ``0`` when none was found.
- `math_score` (verl's ``math_reward.compute_score``, the MATH / Hendrycks rule): the answer is
  what follows the last ``\\boxed `` (a space) up to the next ``$``, when the response has one
  anywhere; else the balanced-brace content of the last ``\\boxed{``. No box, an unbalanced one,
  or a last ``\\boxed`` not followed by ``{`` (``\\fbox`` included) scores 0.0. Answer and
  ground truth are both normalised (`_strip_math`: line breaks, ``\\!``, ``\\left``/``\\right``,
  degrees, ``\\$``, a units ``\\text{ ...}`` suffix, ``\\%`` and spaces dropped; ``\\dfrac`` and
  ``\\tfrac`` read as ``\\frac``; ``.5`` read as ``0.5``; a short ``k = `` prefix dropped;
  ``\\sqrt3``, ``\\frac12`` and ``a/b`` of integers braced as ``\\frac{a}{b}``; ``0.5`` read as
  ``\\frac{1}{2}``) and compared as strings; when either normalisation fails (two ``\\text{ ``
  units, a trailing ``\\sqrt`` or ``\\frac``, a non-string ground truth), the raw strings are
  compared. 1.0 when equal, else 0.0.
- `dapo_score` (verl's ``math_dapo.compute_score``, used for DAPO, ``math`` and AIME sources):
  only the last 300 characters are read. Unless ``strict_box_verify``, the answer is the rest of
  the line after the last ``Answer:`` (any case, spaces allowed around the colon), normalised
  (`_normalize_dapo`: the part after the last ``=``, a fixed list of substitutions and removed
  unit words, ``$...$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and ``\\boxed{}``
  unwrapped, ``\\frac12`` and ``\\sqrt2`` braced, commas dropped from a bare integer) and
  compared with the normalised ground truth. Without an ``Answer:`` line (or with
  ``strict_box_verify``), the answer is the content of the last ``\\boxed{...}`` in the last 100
  characters (or in the 100 before ``pause_tokens_index[-1]``, a list of 4 indices), compared
  with the ground truth exactly as written. It returns a dict: ``score`` 1.0 or -1.0, ``acc`` a
  bool, ``pred`` the extracted (normalised, for ``Answer:``) answer, ``"[INVALID]"`` or None
  when there was none.
- `qa_em_score` (verl's ``search_r1_like_qa_em.compute_score``, Search-R1's exact match): the
  answer is the stripped text inside the last ``<answer>...</answer>`` (across lines); it and
  each of ``ground_truth["target"]`` (a string or a list of them) are lower-cased, stripped of
  ASCII punctuation and of the words a/an/the, and whitespace-collapsed. ``score`` on a match
  (a quarter of it when the response has more than 10 opening or closing answer tags),
  ``format_score`` on a mismatch, the int ``0`` without an answer. ``method`` is unused, as in
  verl.

`default_compute_score` routes ``data_source`` as verl's does to these four, and returns a float
(or dapo's dict). Sources verl routes to scorers we do not ship (prime math and code, sandbox
fusion, geometry3k), and sources verl does not know, raise NotImplementedError, as verl does for
unknown sources: such rows need ``data.reward``.
"""

from __future__ import annotations

import re
import string
from typing import Any

from jax_agent_rl.tokenization.tags import tagged

_GSM8K_CLIP = 300  # characters of the response the gsm8k rule reads
_DAPO_CLIP = 300  # characters of the response the dapo rule reads
_DAPO_BOX_WINDOW = 100  # characters the dapo rule searches for its \boxed{} answer
_QA_TAG_LIMIT = 10  # answer tags beyond which a correct qa_em answer earns a quarter
_INVALID = "[INVALID]"  # dapo's prediction when no "Answer:" line was found

_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"-?[0-9.,]+")

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every source "aime..."
QA_EM_SOURCES = tuple(
    f"searchR1_{name}"
    for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
)
# sources verl scores with rules this package does not ship
UNSHIPPED_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
    "codecontests",
    "apps",
    "codeforces",
    "taco",
    "hiyouga/geometry3k",
)


def knows_source(data_source: str) -> bool:
    """Whether verl's ``default_compute_score`` has a rule for ``data_source``."""
    return (
        data_source in GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES + QA_EM_SOURCES
        or data_source.startswith("aime")
        or data_source in UNSHIPPED_SOURCES
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """``solution_str`` scored by the rule verl's ``default_compute_score`` picks for
    ``data_source``: a float, or dapo's dict."""
    del extra_info, kwargs  # verl's signature; none of its rules we ship reads them
    result: Any
    if data_source in GSM8K_SOURCES:
        result = gsm8k_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        result = math_score(solution_str, ground_truth)
    elif data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return dapo_score(solution_str, ground_truth)
    elif data_source in QA_EM_SOURCES:
        result = qa_em_score(solution_str, ground_truth)
    elif data_source in UNSHIPPED_SOURCES:
        raise NotImplementedError(
            f"data_source {data_source!r}: verl scores it with a rule jax_agent_rl does not ship; "
            "set data.reward (or data.rewards_by_source) to a reward for it"
        )
    else:
        raise NotImplementedError(
            f"Reward function is not implemented for data_source={data_source!r}; set "
            "data.reward (or data.rewards_by_source) to a reward for it"
        )
    return float(result)


# --- gsm8k ---------------------------------------------------------------------------------


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float | int:
    """verl's GSM8K rule (see the module docstring)."""
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K rule reads in a response (verl's ``gsm8k.extract_solution``):
    a string, or None when there is none."""
    return _gsm8k_answer(solution_str[-_GSM8K_CLIP:], method)


def _gsm8k_answer(text: str, method: str) -> str | None:
    if method == "strict":
        marked = _GSM8K_STRICT.findall(text)
        return marked[-1].replace(",", "") if marked else None
    if method == "flexible":
        runs = _GSM8K_FLEXIBLE.findall(text)
        meaningful = [run for run in runs if run not in ("", ".")]
        if meaningful:
            return meaningful[-1]
        return runs[0] if runs else None  # only lone dots: verl keeps the first of them
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")


# --- MATH (Hendrycks) ----------------------------------------------------------------------


def math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's MATH rule (see the module docstring)."""
    answer = _math_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if _math_equivalent(answer, ground_truth) else 0.0


def _math_boxed_answer(text: str) -> str | None:
    """What the MATH rule reads as the answer: after the last ``\\boxed `` up to a ``$``, else
    inside the last ``\\boxed{...}``; None when the last box is malformed or missing."""
    spaced = "\\boxed "
    if spaced in text:
        return text.rsplit(spaced, 1)[1].split("$", 1)[0]
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("{", start + len("\\boxed")):
        return None  # no box, "\boxedx", or only "\fbox" (which verl's MATH rule rejects)
    return _balanced(text, start + len("\\boxed"))


def _balanced(text: str, open_at: int) -> str | None:
    """The text inside the brace group opening at ``open_at``, or None when it never closes."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def _math_equivalent(answer: str, truth: Any) -> bool:
    if truth is None:
        return False
    try:
        return _strip_math(answer) == _strip_math(truth)
    except (AttributeError, IndexError, TypeError, ValueError):
        return answer == truth  # a normalisation failed: verl compares the raw strings


class _UnitsError(ValueError):
    """More than one ``\\text{ `` units suffix: the MATH normalisation gives up."""


def _strip_math(s: str) -> str:
    """The MATH rule's normalised form of an answer (see the module docstring)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        s = s.replace(old, new)
    units = s.split("\\text{ ")
    if len(units) > 2:
        raise _UnitsError(s)
    s = units[0]
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _brace_sqrt(s)
    s = s.replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def _brace_sqrt(s: str) -> str:
    """``\\sqrt3`` as ``\\sqrt{3}``; IndexError on a trailing ``\\sqrt``."""
    head, *rests = s.split("\\sqrt")
    parts = [head]
    for rest in rests:
        parts.append("\\sqrt" + (rest if rest[0] == "{" else "{" + rest[0] + "}" + rest[1:]))
    return "".join(parts)


def _brace_fracs(s: str) -> str:
    """``\\frac12`` as ``\\frac{1}{2}``, ``\\frac1{2}`` as ``\\frac{1}{2}``; ``s`` unchanged when
    a ``\\frac`` is followed by a single character; IndexError on a trailing ``\\frac``."""
    head, *rests = s.split("\\frac")
    parts = [head]
    for rest in rests:
        if rest[0] == "{":
            parts.append("\\frac" + rest)
        elif len(rest) < 2:
            return s
        elif rest[1] == "{":
            parts.append("\\frac{" + rest[0] + "}" + rest[1:])
        else:
            parts.append("\\frac{" + rest[0] + "}{" + rest[1] + "}" + rest[2:])
    return "".join(parts)


def _slash_to_frac(s: str) -> str:
    """``a/b`` of two integers written in canonical form as ``\\frac{a}{b}``."""
    sides = s.split("/")
    if len(sides) != 2:
        return s
    try:
        a, b = int(sides[0]), int(sides[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


# --- DAPO / Minerva ------------------------------------------------------------------------

_DAPO_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# applied in order: (old, new) substitutions, then removals
_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVALS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# applied in order, each to every match
_DAPO_REWRITES = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep only the first $...$ of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def dapo_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """verl's DAPO rule (see the module docstring): ``{"score", "acc", "pred"}``."""
    text = solution_str[-_DAPO_CLIP:]
    correct, pred = _dapo_verify(text, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _dapo_verify(
    text: str, truth: str, strict_box_verify: bool, pause_tokens_index: list[int] | None
) -> tuple[bool, str | None]:
    if not strict_box_verify:
        lines = _DAPO_ANSWER_LINE.findall(text)
        pred = _normalize_dapo(lines[-1] if lines else _INVALID)
        line_correct = pred == _normalize_dapo(truth)
        if pred != _INVALID:
            return line_correct, pred
    boxed = _dapo_boxed(text, pause_tokens_index)
    if strict_box_verify or boxed is not None:
        return boxed == truth, boxed
    return line_correct, pred


def _dapo_boxed(text: str, pause_tokens_index: list[int] | None) -> str | None:
    """The content of the last ``\\boxed{...}`` in the window the dapo rule searches."""
    if pause_tokens_index is None:
        window = text[-_DAPO_BOX_WINDOW:]
    else:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {pause_tokens_index}")
        window = text[pause_tokens_index[-1] - _DAPO_BOX_WINDOW :]
    start = window.rfind("\\boxed{")
    return None if start < 0 else _balanced(window, start + len("\\boxed"))


def _normalize_dapo(answer: str) -> str:
    """The DAPO (Minerva) rule's normalised form of an answer (see the module docstring)."""
    answer = answer.rsplit("=", maxsplit=1)[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in _DAPO_REMOVALS:
        answer = answer.replace(removed, "")
    for pattern, replacement in _DAPO_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


# --- Search-R1 exact match -----------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def qa_em_score(
    solution_str: str,
    ground_truth: dict[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float | int:
    """verl's Search-R1 exact-match rule (see the module docstring); ``ground_truth["target"]``
    is the golden answer or a list of them."""
    del method  # verl's signature; its rule reads no method either
    answers = tagged(solution_str)  # (verl's regex findall, in linear time)
    if not answers:
        return 0
    golden = ground_truth["target"]
    if isinstance(golden, str):
        golden = [golden]
    predicted = _normalize_qa(answers[-1].strip())
    if not any(_normalize_qa(g) == predicted for g in golden):
        return format_score
    tags = max(solution_str.count("<answer>"), solution_str.count("</answer>"))
    return score / 4 if tags > _QA_TAG_LIMIT else score


def _normalize_qa(text: str) -> str:
    """Lower case, no ASCII punctuation, no articles, single spaces (SQuAD's normalisation)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())
