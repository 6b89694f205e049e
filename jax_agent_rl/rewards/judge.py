"""A model as the reward: `Judge` asks a rollout backend to rate an answer and parses a score.

The reward named ``judge`` (``data.reward=judge``, or per source in ``data.rewards_by_source``)
fills ``data.judge.template`` with the row's prompt, the final answer and the ground truth,
sends it as one user message of the judge's chat template (greedy by default) and reads the
number in the ``<score>N</score>`` of what comes back (`parse_score`), divided by
``score_max``. Anything else is a failure: a judge that says "Rating: 3/10", or only quotes
the response's own "10/10", has not rated it; nor has one whose answer holds two different
scores (it quoted the score the response claims for itself: the first tag won, and paid it).

The policy writes the answer the judge reads, and under GRPO it gains by raising its score, so
the answer is data the judge cannot mistake for its prompt (`response_block`):

- it sits between ``<response>`` and ``</response>``, and every "<" in it is written
  ``&lt;``, as is every character a reader takes for one (`LESS_THAN`: the fullwidth ``＜``,
  ``‹``, ``˂``...): no tag opens inside it, whatever letters follow (fullwidth, mathematical,
  Cyrillic or Greek look-alikes, a "/" escaped as JSON writes it), so it can neither close the
  block (and add a forged "Reference answer" line after it) nor hand the judge a score tag;
- special-token spellings in it (``<|im_start|>``) are encoded as plain text
  (`Tokenizer.encode_text`), never as the tokens: it cannot open turns of its own;
- invisible characters (Unicode tag characters, zero-width ones, `visible.INVISIBLE`) are
  removed: no hidden message reaches the judge;
- a response longer than ``max_response_chars`` is cut to its head and tail, and the prompt
  is built in a worker thread: huge answers neither fill the judge's context nor stall the
  event loop.

- Batched, bounded: every answer of a step is scored concurrently, so the judge's requests go
  to its backend together (which batches them), at most ``max_concurrency`` in flight.
- Cached: the score of each judge prompt (so of each prompt, response and ground truth) under
  the judge's weight version (``weight_version``: the policy's changes with every push, a
  separate judge's never) is kept in memory for the rest of the run, the newest
  ``cache_size``; a cached answer is not sent again, nor one being judged already (it waits
  for that request, and one waiter cancelled leaves the others waiting). Failures, and scores
  asked across a weight push, are not cached.
- Never fatal: an answer with no score in range, a backend error or a request that exceeds
  ``timeout_s`` gets the ``fallback`` reward (0 unless set, never above 0: breaking the
  judge must not pay more than its lowest rating); each is counted. `Judge.counters` gives
  the running totals ``reward/judge_calls`` (requests sent), ``reward/judge_failures`` and
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
from collections.abc import Callable

from jax_agent_rl.config import JudgeSection
from jax_agent_rl.console.visible import without_invisible
from jax_agent_rl.protocol import GenerateRequest, RolloutBackend, SamplingParams
from jax_agent_rl.rewards.registry import Answer
from jax_agent_rl.tokenization import Tokenizer

_OPEN_SCORE = re.compile("<score>", re.IGNORECASE)
_CLOSE_SCORE = re.compile("</score>", re.IGNORECASE)
# what reads as "<": itself, what NFKC or NFKD folds to it or to one with a mark on it
# (fullwidth, small, "≮"), its look-alikes in Unicode's confusables.txt, and the left angle
# brackets (〈 ⟨ 〈, the ornaments ❬ ❰, ⦑ ⦓, the curved ⧼ and the vertical ︿: every single
# left angle bracket Unicode names) a reader may take for it
LESS_THAN = (
    "<\uff1c\ufe64\u226e\u02c2\u1438\u16b2\u2039\u276e\U0001d236\u2329\u3008\u27e8"
    "\u276c\u2770\u2991\u2993\u29fc\ufe3f"
)
_LESS_THAN = re.compile(f"[{LESS_THAN}]")
_CONTENT = "\x00judge-content\x00"  # where the message goes in the rendered chat


class JudgeAnswerError(ValueError):
    """A judge's answer that holds no score in range."""


def _score_texts(text: str) -> list[str]:
    """What each ``<score>...</score>`` of ``text`` holds (tags in any case), without the
    spaces around it, in order. What ``re.findall(r"<score>\\s*(.*?)\\s*</score>", text,
    re.I | re.S)`` finds, in linear time: that regex took time cubic in a run of spaces after
    a tag never closed (4,000 of them: 44 s, on the event loop)."""
    found, at = [], 0
    while (opened := _OPEN_SCORE.search(text, at)) is not None:
        closed = _CLOSE_SCORE.search(text, opened.end())
        if closed is None:  # none closed after this one: none after a later one
            break
        found.append(text[opened.end() : closed.start()].strip())
        at = closed.end()
    return found


def parse_score(text: str, score_max: float) -> float:
    """The number in the ``<score>N</score>`` of ``text``, in [0, ``score_max``], divided by
    ``score_max``. Raises `JudgeAnswerError` when there is no such tag, one holds no number,
    the number is out of range, or two tags hold different numbers: a judge quoting the score
    the response claims for itself beside its own has given no one score (the first tag won,
    so the quoted claim was paid)."""
    texts = _score_texts(text)
    if not texts:
        raise JudgeAnswerError(f"no <score>N</score> in the judge's answer {text[:200]!r}")
    values = set()
    for found in texts:
        try:
            values.add(float(found))
        except ValueError as e:
            raise JudgeAnswerError(f"the judge's score {found!r:.40} is not a number") from e
    if len(values) > 1:
        shown = ", ".join(f"{v:g}" for v in sorted(values)[:4])
        raise JudgeAnswerError(f"the judge's answer holds different scores ({shown}): quoted?")
    (value,) = values
    if not 0.0 <= value <= score_max:  # NaN fails this too
        raise JudgeAnswerError(f"the judge's score {value:g} is outside [0, {score_max:g}]")
    return value / score_max


def response_block(text: str, max_chars: int) -> str:
    """``text`` as the judge reads it: without invisible characters, cut to its first and last
    ``max_chars / 2`` characters if longer, each character of `LESS_THAN` written ``&lt;``,
    between ``<response>`` and ``</response>``."""
    text = without_invisible(text)
    if len(text) > max_chars:
        head, tail = max_chars // 2, len(text) - (max_chars - max_chars // 2)
        text = f"{text[:head]}\n[... {len(text) - max_chars} characters cut ...]\n{text[tail:]}"
    return f"<response>\n{_LESS_THAN.sub('&lt;', text)}\n</response>"


def judge_prompt(section: JudgeSection, answer: Answer) -> str:
    """``section.template`` filled in with the answer's prompt, response (`response_block`),
    ground truth and the score's scale."""
    truth = "" if answer.ground_truth is None else str(answer.ground_truth)
    return section.template.format(
        prompt=answer.prompt,
        response=response_block(answer.text, section.max_response_chars),
        ground_truth=truth,
        score_max=section.score_max,
    )


class Judge:
    """Scores answers with ``backend`` (see the module docstring); one per run, called from
    one event loop. ``stop_token_ids``: where a judge's answer ends (its tokenizer's end of
    turn). ``weight_version``: the version of the weights ``backend`` judges with now."""

    def __init__(
        self,
        section: JudgeSection,
        backend: RolloutBackend,
        tokenizer: Tokenizer,
        stop_token_ids: tuple[int, ...],
        weight_version: Callable[[], int],
    ) -> None:
        self.section = section
        self.backend = backend
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.sampling = SamplingParams(
            max_tokens=section.max_tokens,
            temperature=section.temperature,
            stop_token_ids=stop_token_ids,
            logprobs=False,
        )
        chat = tokenizer.render_chat(
            [{"role": "user", "content": _CONTENT}], add_generation_prompt=True
        )
        if chat.count(_CONTENT) != 1:
            raise ValueError(
                f"{tokenizer.chat_template_origin} does not write a user message's content "
                "once as given: the judge cannot keep the answer it rates apart from its turns"
            )
        before, after = chat.split(_CONTENT)
        self._around = (tokenizer.encode(before), tokenizer.encode(after))
        self._slots = asyncio.Semaphore(section.max_concurrency)
        self._cache: collections.OrderedDict[tuple[int, bytes], float] = collections.OrderedDict()
        self._asking: dict[tuple[int, bytes], asyncio.Future[float]] = {}
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

    def _prompt(self, answer: Answer) -> tuple[list[int], bytes]:
        """The judge's prompt ids of ``answer`` (the message as plain text inside the chat
        template's turn) and their digest."""
        before, after = self._around
        ids = before + self.tokenizer.encode_text(judge_prompt(self.section, answer)) + after
        return ids, hashlib.sha256(repr(ids).encode()).digest()

    async def __call__(self, answer: Answer) -> float:
        """The judge's reward of ``answer`` in [0, 1], or ``fallback`` if judging it failed."""
        s = self.section
        try:  # the heavy part (text scans, tokenizing) off the event loop
            prompt_ids, digest = await asyncio.to_thread(self._prompt, answer)
        except Exception:  # a template that does not fit the answer (a stray brace)
            self.failures += 1
            return s.fallback
        if not s.cache:
            return (await self._score(prompt_ids))[0]
        key = (self.weight_version(), digest)
        if key in self._cache:
            self.cache_hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._judged(key, prompt_ids))
        else:  # the same answer, being judged now: wait for that request
            self.cache_hits += 1
        # one waiter cancelled does not cancel the request the others wait for
        return await asyncio.shield(asking)

    async def _judged(self, key: tuple[int, bytes], prompt_ids: list[int]) -> float:
        """`_score`, cached under ``key`` unless it failed or the weights changed meanwhile."""
        try:
            score, judged = await self._score(prompt_ids)
        finally:
            del self._asking[key]
        if judged and self.weight_version() == key[0]:  # a failure is asked again next time
            self._cache[key] = score
            if len(self._cache) > self.section.cache_size:
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
        return parse_score(text, s.score_max)
