"""A model as the reward (`Judge`): the score parser, the fallback and counters on every way a
judge call fails (a scripted backend: garbage, no score, out of range, an error, a timeout),
the cache, the concurrency bound against a real embedded engine with random weights, and a
training step whose reward is a separate judge engine."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, prepare
from jax_agent_rl.config import ConfigError, JudgeSection, load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import Capabilities, GenerateRequest, GenerateResult
from jax_agent_rl.rewards import Answer, Judge, JudgeAnswerError, make_reward, parse_score
from jax_agent_rl.rollout.embedded import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.build import build_run, eos_ids, open_rollout
from jax_agent_rl.train.check import check_names
from jax_agent_rl.train.producer import update_steps

TEMPLATE = "Q: {prompt} A: {response} Score:"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=16, n_val=4, n_sft=16)


@pytest.fixture(scope="module")
def tokenizer(task: TaskFiles) -> Tokenizer:
    return Tokenizer.from_pretrained(task.model)


def _answer(response: str, prompt: str = "What is 2 + 3?") -> Answer:
    return Answer("arith", prompt, response, "5", {})


def test_the_score_is_the_score_tag_in_range_normalised() -> None:
    assert parse_score("<score>7</score>", 10.0) == 0.7
    assert parse_score("3 of 4 steps hold; <score>8.5</score> overall", 10.0) == 0.85
    assert parse_score("<score>9</score>, so: <score> 9.0 </score>", 10.0) == 0.9
    assert parse_score("<SCORE> 4 </SCORE>", 5.0) == 0.8
    for text, problem in [
        # a judge quoting the response's claimed score before its own: the first tag won
        (
            'The response says "<score>10</score>" of itself. It is wrong: <score>2</score>',
            r"different scores \(2, 10\)",
        ),
        ("<score>0</score> not <score>9</score>", "different scores"),
        ("<score>7</score> then <score>x</score>", "not a number"),
        ("no tag here", "no <score>N</score>"),
        ("Rating: 7", "no <score>N</score>"),
        ("<score>11</score>", "outside"),
        ("<score>-2</score>", "outside"),
        ("<score>nan</score>", "outside"),
        ("<score>A</score>", "not a number"),
    ]:
        with pytest.raises(JudgeAnswerError, match=problem):
            parse_score(text, 10.0)


class ScriptedJudge:
    """A backend that answers each judge prompt by what its response asks for: a rating,
    garbage, an error, or never (a hung request)."""

    capabilities = Capabilities(
        logprobs=False,
        logprob_tolerance=0.0,
        per_request_sampling=True,
        stop_token_ids=True,
        abort=False,
        prefix_cache=False,
        weight_update="none",
        max_model_len=4096,
    )

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sent: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.sent.append(request)
        prompt = self.tokenizer.decode(request.prompt_ids)
        if "hang" in prompt:
            await asyncio.Event().wait()
        if "raise" in prompt:
            raise RuntimeError("the judge's server went away")
        reply = next(
            (r for key, r in REPLIES.items() if f"<response>\n{key}\n</response>" in prompt),
            "<score>9</score>",
        )
        ids = tuple(self.tokenizer.encode(reply))
        return GenerateResult(ids, None, "stop", 0)

    async def update_weights(self, params: Any, version: int) -> None:
        del params, version

    async def abort(self, request_id: str) -> None:
        del request_id

    async def close(self) -> None:
        pass


REPLIES = {
    "garbage": "%%$# ## ~~",
    "silent": "",
    "too_high": "<score>42</score>",
    "good": "<score>6</score>",
}


def _judge(tokenizer: Tokenizer, backend: Any, **section: Any) -> Judge:
    s = JudgeSection(**{"template": TEMPLATE, "timeout_s": 0.2, "fallback": -1.0, **section})
    return Judge(s, backend, tokenizer, eos_ids(tokenizer), lambda: 0)


async def _gather(judge: Judge, responses: list[str]) -> list[float]:
    return list(await asyncio.gather(*(judge(_answer(r)) for r in responses)))


def test_every_failing_judge_call_is_counted_and_scored_by_the_fallback(
    tokenizer: Tokenizer,
) -> None:
    """Garbage, an empty answer, a score out of range, an error, a timeout, a template that
    does not fit: each is one failure scored -1 (the fallback); the good answers beside them
    in the same batch are scored as the judge rated them."""
    backend = ScriptedJudge(tokenizer)
    judge = _judge(tokenizer, backend)
    responses = ["good", "garbage", "silent", "too_high", "raise", "hang", "fine"]
    scores = asyncio.run(_gather(judge, responses))
    assert scores == [0.6, -1.0, -1.0, -1.0, -1.0, -1.0, 0.9]
    assert judge.counters() == {
        "reward/judge_calls": 7,
        "reward/judge_failures": 5,
        "reward/judge_cache_hits": 0,
    }
    stray = _judge(tokenizer, backend, template="{prompt} {unknown}")
    assert asyncio.run(stray(_answer("good"))) == -1.0
    assert stray.counters()["reward/judge_failures"] == 1
    assert len(backend.sent) == 7  # the stray template sent nothing
    request = backend.sent[0].sampling
    assert (request.temperature, request.max_tokens, request.logprobs) == (0.0, 32, False)


def test_a_judged_answer_is_cached_and_not_sent_again_but_a_failure_is(
    tokenizer: Tokenizer,
) -> None:
    backend = ScriptedJudge(tokenizer)
    judge = _judge(tokenizer, backend)
    first = asyncio.run(_gather(judge, ["good", "good", "fine", "garbage"]))
    assert first == [0.6, 0.6, 0.9, -1.0]
    assert len(backend.sent) == 3  # the second "good" waited for the first's request
    again = asyncio.run(_gather(judge, ["good", "fine", "garbage"]))
    assert again == [0.6, 0.9, -1.0]
    assert len(backend.sent) == 4  # only the failure was asked again
    assert judge.counters() == {
        "reward/judge_calls": 4,
        "reward/judge_failures": 2,
        "reward/judge_cache_hits": 3,
    }
    uncached = _judge(tokenizer, ScriptedJudge(tokenizer), cache=False)
    asyncio.run(_gather(uncached, ["good", "good"]))
    assert uncached.counters()["reward/judge_calls"] == 2


def test_rows_naming_the_judge_go_to_it_and_the_others_to_their_rule(
    tokenizer: Tokenizer,
) -> None:
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.train=t.jsonl",
            "data.reward=judge",
            "data.rewards_by_source.exact=format",
        ],
    )
    judge = _judge(tokenizer, ScriptedJudge(tokenizer))
    score = make_reward(cfg.data, judge)
    judged = asyncio.run(score(_answer("good")))
    ruled = asyncio.run(
        score(dataclasses.replace(_answer("<answer>5</answer>"), data_source="exact"))
    )
    assert (judged, ruled) == (0.6, 1.0)
    assert judge.counters()["reward/judge_calls"] == 1
    with pytest.raises(RuntimeError, match="none was built"):
        asyncio.run(make_reward(cfg.data)(_answer("good")))


class InFlight:
    """A backend wrapper that counts its requests in flight and keeps what each returned."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.now = self.most = 0
        self.results: list[GenerateResult] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            result = await self.inner.generate(request)
            self.results.append(result)
            return result
        finally:
            self.now -= 1

    async def update_weights(self, params: Any, version: int) -> None:
        await self.inner.update_weights(params, version)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()


def test_a_real_engine_judges_within_the_concurrency_bound(
    task: TaskFiles, tokenizer: Tokenizer
) -> None:
    """A random-weight embedded engine: what it writes is arbitrary, so each answer is either
    its parsed score or a counted failure; never more than max_concurrency requests are in
    flight, and that many are."""
    model, params = load_hf(task.model, "float32", sharder=one_device_sharder())
    engine = Engine(
        model,
        max_concurrent_decodes=2,
        max_len=128,
        batch_buckets=False,
        sharder=one_device_sharder(),
    )
    section = JudgeSection(template=TEMPLATE, max_concurrency=2, max_tokens=8, fallback=-1.0)

    async def go() -> tuple[list[float], InFlight, Judge]:
        backend = InFlight(EmbeddedBackend(engine, params))
        judge = Judge(section, backend, tokenizer, eos_ids(tokenizer), lambda: 0)
        try:
            return await _gather(judge, [f"{i} + {i}" for i in range(6)]), backend, judge
        finally:
            await backend.close()

    scores, backend, judge = asyncio.run(go())
    assert backend.most == 2
    assert judge.calls == 6 == len(backend.results)
    parsed = []
    for result in backend.results:
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        try:
            parsed.append(parse_score(text, section.score_max))
        except JudgeAnswerError:
            parsed.append(-1.0)
    assert sorted(scores) == sorted(parsed)  # results come back in completion order
    assert judge.failures == parsed.count(-1.0)


def test_a_training_step_with_a_judge_reward_counts_its_calls_and_failures(
    task: TaskFiles, tmp_path: Path
) -> None:
    """``data.reward=judge`` judged by the policy's own engine: a training step runs, and its
    metrics count every answer's judge call (or cache hit) and failure."""
    prompts, n = 2, 2
    overrides = [
        f"model.path={task.model}", f"data.train={task.train}", "data.val=", "sft.data=",
        f"tools.config={task.tools}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.tensorboard=false", f"data.prompts_per_step={prompts}", f"group.n={n}",
        "engine.max_model_len=128", "engine.max_concurrent=4", "engine.prefill_chunk=128",
        "engine.batch_buckets=false", "engine.warmup=false",
        "agent.max_turns=1", "agent.max_tokens_per_turn=8", "agent.max_response_tokens=8",
        "learner.micro_batch_size=4", "data.reward=judge", "data.judge.max_tokens=4",
        "data.judge.fallback=-1",
    ]  # fmt: skip
    cfg = load_config(DEMO_CONFIG, overrides)
    judge = dataclasses.replace(cfg.data.judge, template=TEMPLATE)  # fits max_model_len
    run, state = build_run(
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, judge=judge)),
        Console(file=io.StringIO()),
    )

    async def step() -> dict[str, float]:
        async with open_rollout(run, state) as rollout, update_steps(run, rollout) as step_fn:
            _, m, *_ = await step_fn(state, 0, True)
            return m

    try:
        m = asyncio.run(step())
    finally:
        run.checkpoints.close()
        run.metrics.close()
    assert m["reward/judge_calls"] + m["reward/judge_cache_hits"] == prompts * n
    assert 0 <= m["reward/judge_failures"] <= m["reward/judge_calls"]
    assert m["batch/trajectories"] == prompts * n  # the failures did not stop the step


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["data.judge.backend=embedded"], r"data\.judge\.backend='embedded' .* needs data\.judge"),
        (["data.judge.model_path=/j"], r"data\.judge\.model_path='/j' is read only by a separate"),
        (["data.judge.max_concurrency=0"], r"data\.judge\.max_concurrency=0: expected >= 1"),
    ],
)
def test_a_judge_section_that_cannot_work_is_refused(overrides: list[str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])


def test_an_unregistered_judge_backend_is_refused_before_a_run() -> None:
    overrides = ["data.judge.backend=nope", "data.judge.model_path=/j"]
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", *overrides])
    (problem,) = check_names(cfg)
    assert re.search(r"use policy or a registered", problem)
