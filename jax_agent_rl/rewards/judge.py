"""A model as the reward: `Judge` asks a rollout backend to rate an answer and parses a score.

The reward named ``judge`` (``data.reward=judge``, or per source in ``data.rewards_by_source``)
fills ``data.judge.template`` with the row's prompt, the final answer and the ground truth,
sends it as one user message of the judge's chat template (greedy by default) and reads the
last match of ``score_pattern`` in what comes back (`parse_score`), divided by ``score_max``.

- Batched, bounded: every answer of a step is scored concurrently, so the judge's requests go
  to its backend together (which batches them), at most ``max_concurrency`` in flight.
- Cached: the score of each judge prompt (so of each prompt, response and ground truth) is
  kept in memory for the rest of the run, the newest ``cache_size``; a cached answer is not
  sent again, nor one being judged already (it waits for that request). Failures are not
  cached.
- Never fatal: an answer with no score in range, a backend error or a request that exceeds
  ``timeout_s`` gets the ``fallback`` reward; each is counted. `Judge.counters` gives the
  running totals ``reward/judge_calls`` (requests sent), ``reward/judge_failures`` and
  ``reward/judge_cache_hits``; each step reports what they grew by.

The judge is the policy's own backend (``backend: policy``: it rates with the weights being
trained, the version of the step's rollout) or a separate backend started from its own
checkpoint (`jax_agent_rl.train.build`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import re

from jax_agent_rl.config import JudgeSection
from jax_agent_rl.engine.sampling import SamplingParams
from jax_agent_rl.rewards.registry import Answer
from jax_agent_rl.rollout.protocol import GenerateRequest, RolloutBackend
from jax_agent_rl.tokenization import Tokenizer


class JudgeAnswerError(ValueError):
    """A judge's answer that holds no score in range."""


def parse_score(text: str, pattern: str, score_max: float) -> float:
    """The last match of ``pattern`` in ``text`` (its first group, if it has groups) as a
    number in [0, ``score_max``], divided by ``score_max``. Raises `JudgeAnswerError` when there
    is no match, it is not a number, or it is out of range."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        raise JudgeAnswerError(f"no match of {pattern!r} in the judge's answer {text[-200:]!r}")
    last = matches[-1]
    found = last.group(1) if last.re.groups else last.group(0)
    try:
        value = float(found)
    except (TypeError, ValueError) as e:
        raise JudgeAnswerError(f"the judge's score {found!r} is not a number") from e
    if not 0.0 <= value <= score_max:  # NaN fails this too
        raise JudgeAnswerError(f"the judge's score {value:g} is outside [0, {score_max:g}]")
    return value / score_max


def judge_prompt(template: str, answer: Answer) -> str:
    """``template`` filled in with the answer's prompt, response and ground truth."""
    truth = "" if answer.ground_truth is None else str(answer.ground_truth)
    return template.format(prompt=answer.prompt, response=answer.text, ground_truth=truth)


class Judge:
    """Scores answers with ``backend`` (see the module docstring); one per run, called from
    one event loop. ``stop_token_ids``: where a judge's answer ends (its tokenizer's end of
    turn)."""

    def __init__(
        self,
        section: JudgeSection,
        backend: RolloutBackend,
        tokenizer: Tokenizer,
        stop_token_ids: tuple[int, ...],
    ) -> None:
        self.section = section
        self.backend = backend
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(
            max_tokens=section.max_tokens,
            temperature=section.temperature,
            stop_token_ids=stop_token_ids,
            logprobs=False,
        )
        self._slots = asyncio.Semaphore(section.max_concurrency)
        self._cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._asking: dict[bytes, asyncio.Future[float]] = {}
        self._ids = itertools.count()
        self.calls = 0
        self.failures = 0
        self.cache_hits = 0

    def counters(self) -> dict[str, float]:
        """Running totals by metric name."""
        return {
            "reward/judge_calls": self.calls,
            "reward/judge_failures": self.failures,
            "reward/judge_cache_hits": self.cache_hits,
        }

    async def __call__(self, answer: Answer) -> float:
        """The judge's reward of ``answer`` in [0, 1], or ``fallback`` if judging it failed."""
        s = self.section
        try:
            prompt_ids = self.tokenizer.encode_chat(
                [{"role": "user", "content": judge_prompt(s.template, answer)}],
                add_generation_prompt=True,
            )
        except Exception:  # a template that does not fit the answer (a stray brace)
            self.failures += 1
            return s.fallback
        if not s.cache:
            return (await self._score(prompt_ids))[0]
        key = hashlib.sha256(repr(prompt_ids).encode()).digest()
        if key in self._cache:
            self.cache_hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        if key in self._asking:  # the same answer, being judged now: wait for that request
            self.cache_hits += 1
            return await asyncio.shield(self._asking[key])
        asking = self._asking[key] = asyncio.get_running_loop().create_future()
        try:
            score, judged = await self._score(prompt_ids)
        except BaseException:  # cancelled: so are those waiting for it
            asking.cancel()
            raise
        finally:
            del self._asking[key]
        asking.set_result(score)
        if judged:  # a failure is asked again next time
            self._cache[key] = score
            if len(self._cache) > s.cache_size:
                self._cache.popitem(last=False)
        return score

    async def _score(self, prompt_ids: list[int]) -> tuple[float, bool]:
        """The judge's score and True, or the fallback and False (counted) if asking failed."""
        try:
            return await self._ask(prompt_ids), True
        except Exception:  # no score, an error of the backend, a timeout
            self.failures += 1
            return self.section.fallback, False

    async def _ask(self, prompt_ids: list[int]) -> float:
        s = self.section
        request = GenerateRequest(f"judge/{next(self._ids)}", tuple(prompt_ids), self.sampling)
        async with self._slots:
            self.calls += 1
            # a backend frees a cancelled request (the embedded engine aborts it)
            result = await asyncio.wait_for(self.backend.generate(request), s.timeout_s)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return parse_score(text, s.score_pattern, s.score_max)
