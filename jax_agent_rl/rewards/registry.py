"""Which reward scores a row, loaded once at startup from the config's data section.

A reward is named by a built-in name (`REWARDS`) or by a user function, ``package.module:function``
or ``path/to/file.py:function`` (verl's ``custom_reward_function.path`` / ``.name`` in one
string). The built-in names:

- ``verl_gsm8k``, ``verl_math``, ``verl_dapo``, ``verl_qa_em``: verl's own rules, registered
  by the verl wing (`jax_agent_rl.compat.verl.rules`: GSM8K's strict ``#### N``, MATH's boxed
  answer, DAPO's ``Answer:`` line, Search-R1's exact match), results as verl's (dapo's dict
  gives its score);
- ``math``: ours, the last ``<answer>`` or ``\\boxed{}`` compared as a number or string;
- ``gsm8k_lenient``: ours, GSM8K's number however it is written (``#### 15.0``, ``<answer>``,
  ``\\boxed{}``, the last number); not verl's rule;
- ``format``: one ``<answer>`` block and no unclosed ``<think>``;
- ``reasoning_gym``: a reasoning-gym row's task scorer;
- ``judge``: a model asks instead (`jax_agent_rl.rewards.judge`, set up by ``data.judge``).

A user function is called in the form its signature accepts:

- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called with
  keywords as verl calls it (any function that binds those four keywords, ``**kwargs`` too);
- else ours, ``fn(text, ground_truth)``, called positionally (verl's per-dataset scorers such as
  ``gsm8k.compute_score(solution_str, ground_truth)`` fit it).

It returns a number (a bool, NumPy's too, is 0 or 1), or (as verl allows) a dict whose
``score`` is the number; the other keys of such a dict are not recorded. Anything else, and a
reward that is not finite, is an error naming the config key.

Which reward scores a row (`make_reward`), as verl picks one: its source's entry in
``data.rewards_by_source``, else ``data.reward`` when set (it overrides every other source, as
verl's ``custom_reward_function`` does), else, with ``data.reward`` unset (empty), by source:
verl's rule for the sources verl's ``default_compute_score`` knows (`jax_agent_rl.compat.
verl.rules.default_compute_score`; those it routes to scorers not shipped here raise, naming
the source), the task's scorer for reasoning-gym rows (``reasoning_gym/<task>``), ``math``
for the rest. An empty entry in ``data.rewards_by_source`` is an error: it would leave open
whether the row falls back to ``data.reward`` or to its source's default.

What a reward reads (`Answer.text`) is verl's rule for verl data: for rows of a source verl's
``default_compute_score`` knows, the whole response decoded as verl decodes it (every token after
the prompt, tool responses included, special tokens skipped); for other rows the last assistant
message (`jax_agent_rl.train.rollout_score.scored_text`). Rewards are awaited (`Rewards`), so that a
step's judge requests are sent together, and no synchronous reward runs on the event loop:

- ours (the built-in rules, verl's included) in a thread of a bounded pool (`CallThreads`,
  ``REWARD_THREADS`` threads): pure functions over bounded text, written and attacked here
  (``tests/hostile``), that return;
- reasoning-gym's scorers and a user's function in a worker process (`CallProcesses`, at most
  ``data.reward_workers``): code not written here, reading the policy's text, which the policy
  can make run for ever (sympy simplifying the derivative of a product of a dozen sines). A
  call past ``data.reward_timeout_s`` kills its worker, and a later call starts another, so
  such answers never use up the pool. A user's function is loaded in each worker by its spec
  (imported once there, before the worker's first call is timed): its module's state is the
  worker's own.

Each call has ``data.reward_timeout_s``; past it, it raises `RewardError` naming the setting
and the reward. In a thread, the wait for a free one counts, and a thread cannot be stopped,
only abandoned (it keeps its place until it returns); in a worker, only the call counts (a busy
worker is free again within the timeout). `Rewards.close` (the run's end) stops the worker
processes.

Whose fault a failed call is (`_Sync.attributed`): a reward that raises or times out on the
policy's answer is called on it once more, and on the row's own answer (a reasoning-gym row's
answer, else the ground truth written out, ``str(ground_truth)`` of a string or a number, bare
and as an answer is marked (``<answer>``, ``\\boxed{}``, ``####``), so that a reward that
raises on an unmarked answer has one it reads; no such probe for other ground truths). Failing
on the answer twice and not on a probe, the
answer is at fault: `AnswerFaultError`, which scores it 0 and trains on it as the wrong answer it is
(`jax_agent_rl.train.rollout_score.score_episodes`, counted in ``rewards/answer_faults``). Ended
untrained instead (``reward_error``), it would take none of the negative advantage a wrong
answer takes in its group: a policy that learns to make the reward raise or hang escapes the
penalty of being wrong. Otherwise (the probe fails too: the reward, or what it calls, is
broken; or there is no probe) the first error stands: ``reward_error``, untrained, as before.

Every reward is checked where it enters (`checked_reward`): a real number, finite, within
``MAX_ABS_REWARD``. A user function's result here; an environment's step reward in
`jax_agent_rl.envs.checked_step`; each episode's final reward in
`jax_agent_rl.train.rollout_score.score_episodes`, which ends a trajectory whose reward
fails with stop reason ``reward_error`` rather than let a NaN into its group's advantages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import numpy as np

from jax_agent_rl.config import ConfigError, DataSection
from jax_agent_rl.config.ranges import MAX_ABS_REWARD
from jax_agent_rl.config.wings import load_wing
from jax_agent_rl.data import arithmetic, reasoning_gym
from jax_agent_rl.rewards.hooks import REWARDS, register_reward, source_rule
from jax_agent_rl.rewards.math import format_reward, gsm8k_lenient_reward, math_reward
from jax_agent_rl.usercode.load import load_function
from jax_agent_rl.usercode.processes import CallProcesses, CallTimeoutError, raised_in
from jax_agent_rl.usercode.threads import CallThreads

# every loaded reward: (data_source, text, ground truth, extra_info) -> reward
ScoreFn = Callable[[str, str, Any, dict[str, Any]], float]

register_reward("math", math_reward)
register_reward("gsm8k_lenient", gsm8k_lenient_reward)
register_reward("format", lambda text, _truth: format_reward(text))

JUDGE = "judge"  # the reward name that asks a model (data.judge)
_BY_SOURCE_FALLBACK = "math"  # rows of no known source, with data.reward unset

_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
REWARD_THREADS = 32  # threads running a run's built-in rules at once


class RewardError(ValueError):
    """A reward that is not a finite number within ``MAX_ABS_REWARD`` (the message names where
    it came from and the value)."""


class _LateError(RewardError):
    """A reward call past ``data.reward_timeout_s``."""


class AnswerFaultError(Exception):
    """The reward failed (raised, or ran past its timeout) on an answer twice and scored the
    row's own answer: the answer is at fault, a wrong answer scored 0 (`_Sync.attributed`; the
    message says why)."""


def checked_reward(value: Any, source: str) -> float:
    """``value`` as a float if it is a real number (a NumPy bool counts, as a Python bool
    does: ``np.isclose`` gives one), finite, within ``MAX_ABS_REWARD``; else a `RewardError`
    naming ``source`` (what gave it)."""
    if isinstance(value, np.bool_):
        value = bool(value)
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"{source} gave reward {_shown(value)}, a {type(value).__name__}: expected a "
            "number (an int or a float)"
        )
    try:  # (an int past float's range, 10**400, does not convert: OverflowError)
        finite = math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        raise RewardError(f"{source} gave reward {_shown(value)}: not a finite number")
    if abs(float(value)) > MAX_ABS_REWARD:
        raise RewardError(
            f"{source} gave reward {_shown(value)}: outside "
            f"[-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]"
        )
    return float(value)


def _shown(value: Any) -> str:
    """``value``'s repr, cut; for a number too long to write out (more than the 4,300 digits
    Python writes: an int, or a `Fraction` of such ints), its size instead."""
    try:
        return f"{value!r:.60}"
    except ValueError:
        if isinstance(value, int):
            return f"an int of {value.bit_length()} bits"
        if isinstance(value, numbers.Rational):  # (the ratio of two such ints)
            bits = max(int(value.numerator).bit_length(), int(value.denominator).bit_length())
            return f"a {type(value).__name__} of {bits}-bit terms"
        return f"a {type(value).__name__} too long to write out"


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a reward scores: a trajectory's ``text`` (the last assistant message, or for verl
    data the whole decoded response: `jax_agent_rl.train.rollout_score.scored_text`) with its row's
    ``data_source``, ``prompt`` (the last user message), ``ground_truth`` and ``extra_info``."""

    data_source: str
    prompt: str
    text: str
    ground_truth: Any
    extra: dict[str, Any]


Scorer = Callable[[Answer], Awaitable[float]]  # the reward of one answer, awaited
JudgeFn = Scorer  # a judge (`rewards.judge.Judge`): scores an answer, never raises


def scored_by_fallback(data: DataSection, sources: Iterable[str]) -> list[str]:
    """The data sources among ``sources`` that the ``math`` fallback scores (``data.reward``
    unset, no ``data.rewards_by_source`` entry, no verl rule and no reasoning-gym task), sorted;
    the project's own arithmetic rows, which ``math`` scores by design, are not among them."""
    if data.reward:
        return []
    load_wing("verl")  # verl's rules score the sources verl knows
    return sorted(
        {
            s
            for s in sources
            if s not in data.rewards_by_source
            and source_rule(s) is None
            and not s.startswith((reasoning_gym.SOURCE_PREFIX, arithmetic.SOURCE_PREFIX))
        }
    )


def make_reward(data: DataSection, judge: JudgeFn | None = None) -> Rewards:
    """The reward of every row (the module docstring says which). Every named reward is loaded
    and checked here, before anything runs; rows whose reward is ``judge`` go to ``judge``
    (required when ``data.judged``; without it, this only checks the names). No worker process
    starts until a call needs one. The verl wing's rules are registered first: they score the
    sources verl knows, by name (``verl_gsm8k`` ...) or with ``data.reward`` unset."""
    load_wing("verl")
    for source, spec in data.rewards_by_source.items():
        if not spec.strip():
            raise ConfigError(
                f"data.rewards_by_source.{source} is empty: name its reward, or remove the entry "
                "to score the source by data.reward (or, with data.reward unset, by source)"
            )
    sync = _Sync(
        CallThreads(REWARD_THREADS, "reward-call"),
        CallProcesses(data.reward_workers, "reward worker"),
        data.reward_timeout_s,
        data.reward_memory_limit_mib or None,
    )
    by_source = {
        source: _load(spec, f"data.rewards_by_source.{source}", judge, sync)
        for source, spec in data.rewards_by_source.items()
    }
    fallback = _load(data.reward or _BY_SOURCE_FALLBACK, "data.reward", judge, sync)
    source_default = _source_default(fallback, sync)

    def pick(answer: Answer) -> Scorer:
        fn = by_source.get(answer.data_source)
        if fn is None:
            fn = fallback if data.reward else source_default(answer.data_source)
        return fn

    return Rewards(pick, sync.processes)


class Rewards:
    """The rewards of a run (`make_reward`): awaited, an `Answer`'s reward (a `Scorer`);
    `close` (or leaving ``with``) stops the worker processes."""

    def __init__(self, pick: Callable[[Answer], Scorer], processes: CallProcesses) -> None:
        self._pick, self._processes = pick, processes

    async def __call__(self, answer: Answer) -> float:
        return await self._pick(answer)(answer)

    def close(self) -> None:
        self._processes.close()

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _source_default(fallback: Scorer, sync: _Sync) -> Callable[[str], Scorer]:
    """The reward of a source when ``data.reward`` is unset: the rule registered for it
    (verl's, for the sources verl knows: `jax_agent_rl.rewards.hooks`), the task's scorer for
    reasoning-gym rows, ``fallback`` for the rest."""

    def rule_score(source: str, text: str, truth: Any, extra: dict[str, Any]) -> float:
        rule = source_rule(source)
        assert rule is not None  # picked below only for a source a rule knows
        result = rule.score(source, text, truth, extra)
        return _score(result, f"{rule.what} for {source}", "data.reward")

    by_rule = sync.in_thread(rule_score, "the source's rule (data.reward unset)")
    generated = sync.in_process(
        reasoning_gym.loaded_score,
        "the reasoning-gym task's scorer (data.reward unset)",
        reasoning_gym.SCORER_MEMORY_MIB,
        _own_answer,
    )

    def pick(data_source: str) -> Scorer:
        if source_rule(data_source) is not None:
            return by_rule
        if data_source.startswith(reasoning_gym.SOURCE_PREFIX):
            return generated
        return fallback

    return pick


class _Sync:
    """Synchronous rewards as `Scorer`s, each call within ``timeout_s``
    (``data.reward_timeout_s``): in a thread of ``threads``, or in a worker of ``processes``."""

    def __init__(
        self,
        threads: CallThreads,
        processes: CallProcesses,
        timeout_s: float,
        user_memory_mib: int | None,
    ) -> None:
        self.threads, self.processes, self.timeout_s = threads, processes, timeout_s
        self.user_memory_mib = user_memory_mib  # (data.reward_memory_limit_mib; None: unbounded)

    def in_thread(self, fn: ScoreFn, name: str) -> Scorer:
        """``fn`` awaited; past the timeout (its wait for a thread included) a `RewardError`
        naming ``name``."""

        async def rule(a: Answer) -> float:
            call = self.threads.run(fn, a.data_source, a.text, a.ground_truth, a.extra)
            try:
                return float(await asyncio.wait_for(call, self.timeout_s))
            except TimeoutError:
                raise self._late(
                    name, f"{self.threads.busy} of {self.threads.size} reward threads busy"
                ) from None

        return self.attributed(rule, name, _truth_answers)

    def in_process(
        self,
        load: Callable[[], ScoreFn],
        name: str,
        memory_mib: int | None = None,
        probe: Callable[[Answer], list[Answer]] | None = None,
    ) -> Scorer:
        """``load()``'s function (``load`` a picklable function of no arguments: a worker
        loads it once) awaited; past the timeout its worker is killed, and a `RewardError`
        names ``name``. Its failures are `attributed` by ``probe`` (default `_truth_answers`)."""

        async def run(a: Answer) -> float:
            args = (a.data_source, a.text, a.ground_truth, a.extra)
            try:
                return float(await self.processes.run(load, args, self.timeout_s, memory_mib))
            except CallTimeoutError:  # (not a TimeoutError the function raised: that is its error)
                raise self._late(name, "its worker process was stopped") from None

        return self.attributed(run, name, probe or _truth_answers)

    @staticmethod
    def attributed(score: Scorer, name: str, probe: Callable[[Answer], list[Answer]]) -> Scorer:
        """``score``, whose failure on an answer (it raised, or ran past its timeout) is the
        answer's when ``score`` fails on it once more and scores one of ``probe(a)``, the row's
        own answer written out (tried in turn; a probe past the timeout ends the trial): an
        `AnswerFaultError` (a wrong answer, 0, trained on). Otherwise its first error: when every
        probe fails too, or there is none, the reward or its service is broken, not the answer
        (``reward_error``, untrained).

        Why once more: a reward that fails now and then (a flaky service, a worker lost) at
        rate p would otherwise score a right answer 0 whenever it failed on it and then
        scored the probe, about p of them; failing twice on it, about p^2. Why the probe: a
        reward that fails on every text (broken, misconfigured, its service down) must stay
        an error, which stops a run whose every episode hits it (`train.episodes.
        all_failed_error`), not become a run of wrong answers."""

        async def scored(a: Answer) -> float:
            try:
                return await score(a)
            except Exception as e:  # (the function's error, a RewardError: late or not a number)
                first = e
            probes = probe(a)
            if not probes:
                raise first
            try:
                return await score(a)  # a failure that does not repeat was not the answer's
            except Exception:
                pass
            for own in probes:
                try:
                    await score(own)
                except _LateError:  # (slow on the row's own answer: no telling)
                    break
                except Exception:
                    continue
                raise AnswerFaultError(
                    f"{name} failed on the answer twice ({error_line(first)}) and scored the "
                    f"row's own answer ({own.text[:80]!r}): the answer's fault, scored 0 as a "
                    "wrong answer"
                )
            raise first

        return scored

    def _late(self, name: str, what: str) -> RewardError:
        return _LateError(
            f"{name} took longer than data.reward_timeout_s={self.timeout_s:g}s ({what})"
        )


def _load(spec: str, key: str, judge: JudgeFn | None, sync: _Sync) -> Scorer:
    """The awaited reward ``spec`` names: the judge, or `load_reward`'s function."""
    if spec == JUDGE:
        return judge or _no_judge
    name = f"{key}={spec!r}"
    if spec in REWARDS:
        return sync.in_thread(load_reward(spec, key), name)
    if spec == "reasoning_gym":
        return sync.in_process(
            reasoning_gym.loaded_score, name, reasoning_gym.SCORER_MEMORY_MIB, _own_answer
        )
    load_reward(spec, key)  # its errors here, as the config is read (a worker loads it again)
    return sync.in_process(functools.partial(load_reward, spec, key), name, sync.user_memory_mib)


def _own_answer(answer: Answer) -> list[Answer]:
    """``answer`` with the text of its reasoning-gym row's own answer (`_Sync.attributed`)."""
    return [dataclasses.replace(answer, text=reasoning_gym.answer_text(answer.extra))]


def _truth_answers(answer: Answer) -> list[Answer]:
    """``answer`` with its ground truth as the text (`_Sync.attributed`), bare and marked as the
    built-in rules find an answer: a string's, a number's (not a bool's); none for other ground
    truths (a list, a dict: no one text answers them)."""
    truth = answer.ground_truth
    if not isinstance(truth, str | numbers.Real) or isinstance(truth, bool | np.bool_):
        return []
    forms = ("{}", "<answer>{}</answer>", "\\boxed{{{}}}", "#### {}")
    return [dataclasses.replace(answer, text=form.format(truth)) for form in forms]


def error_line(error: BaseException) -> str:
    """``error``'s type, the first line of its message (cut) and where it was raised (the
    function's frame, in its worker for a call run in one), for one line of a message."""
    lines = str(error).splitlines()
    where = raised_in(error)
    return (
        f"{type(error).__name__}: {lines[0][:200] if lines else ''} in {where.name} "
        f"({where.filename}:{where.lineno})"
    )


async def _no_judge(answer: Answer) -> float:
    raise RuntimeError(f"row of {answer.data_source!r} names the judge, and none was built")


def load_reward(spec: str, key: str) -> ScoreFn:
    """The reward ``spec`` names (see the module docstring); errors name ``key``."""
    if spec == "reasoning_gym":
        return reasoning_gym.score
    if ":" not in spec:
        load_wing("verl")  # verl's rule names (verl_gsm8k ...)
    if spec in REWARDS:
        builtin = REWARDS[spec]
        return lambda _source, text, truth, _extra: _score(builtin(text, truth), spec, key)
    if ":" not in spec:
        names = ", ".join(sorted([*REWARDS, "reasoning_gym"]))
        raise ConfigError(
            f"{key}={spec!r} is not a reward; built in: {names}, {JUDGE} (a model, data.judge);"
            " or a user function as module:function or path/to/file.py:function (docs/rewards.md)"
        )
    return _adapt(load_function(spec, key), spec, key)


def _adapt(fn: Callable[..., Any], spec: str, key: str) -> ScoreFn:
    """``fn`` called in the form its signature accepts, its result checked."""
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}={spec!r}: a reward must be a plain function, not async")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: cannot read its signature: {e}") from e

    def checked(result: Any) -> float:
        return _score(result, spec, key)

    if _binds(signature, **dict.fromkeys(_VERL_ARGS)):
        return lambda source, text, truth, extra: checked(
            fn(data_source=source, solution_str=text, ground_truth=truth, extra_info=extra)
        )
    if _binds(signature, None, None):
        return lambda _source, text, truth, _extra: checked(fn(text, truth))
    raise ConfigError(
        f"{key}={spec!r}: its signature {signature} is neither (text, ground_truth) nor verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info)"
    )


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _score(result: Any, spec: str, key: str) -> float:
    """A user reward's result as a `checked_reward`: a number, or a dict's ``score``."""
    value = result
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(
                f"{key}={spec!r} returned a dict without a 'score' key (keys: {list(result)})"
            )
        value = result["score"]
    return checked_reward(value, f"{key}={spec!r}")
