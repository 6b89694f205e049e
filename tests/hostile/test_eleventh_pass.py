"""Eleventh pass: attacks on what a policy or a user controls, kept as regression tests.

- A lone surrogate is found by one helper (`visible.lone_surrogate`) wherever text comes in (a
  data row, an SFT demonstration, an environment's messages, a tool's text, a call's
  arguments, an endpoint request), each refusal naming the character and where it is.
- A batch of prompts that runs past an epoch's end can draw a row twice (`PromptSampler`: 7
  of 100 batches of 4 over 10 rows). The episodes of both were named by the row's uid and the
  step's tag alone, so they shared their uids, and with them their tool state: one episode's
  calls changed the other's (a sandbox's files, a counter), and the first to end released the
  other's state mid-episode, silently; a verl interaction, shared by every episode under its
  uid, started the second over the first and ended both at the first's end; they also shared
  their requests' seeds (the same tokens twice) and their group. The second draw now plays
  under a uid of its own (``<uid>~1``), in the synchronous loop, the asynchronous one and
  `rollout_episodes`.
- An override whose YAML tag OmegaConf's reader constructs but cannot hold as a value
  (``model.path=!!timestamp 2001-12-14``, ``!!set {a}``, inside a list or a mapping too) ended
  ``jarl train`` (and ``jarl config``) in a 36-line OmegaConf traceback, exit status 1; the
  tenth pass caught only what the YAML reader itself refuses. It is a `ConfigError` line
  naming the key.
- A reward that is a `Fraction` of more digits than Python writes out (a user's exact-ratio
  reward of a policy's 5,000-digit answer, an environment's): writing it into the error
  raised AttributeError ("'Fraction' object has no attribute 'bit_length'"), so the reward
  function's or the environment's error named jarl's own helper, and an environment's step
  ended its episode ``agent_error`` rather than ``env_error``. It is the `RewardError` (an
  `EnvError` for a step) naming the value's size.
- An answer that keeps a reasoning-gym scorer running past ``data.reward_timeout_s`` (a
  product of a dozen sines for simple_integration's sympy) ended its episode with
  ``reward_error``: not trained on, so in its group it was no worse than the right answer,
  while a wrong one got a negative advantage. Hanging the scorer was the policy's way out of a
  wrong answer (and every such step took the whole timeout). It now scores 0 once the row's
  own answer is scored in time; a row whose own answer hangs the scorer too is still the
  `RewardError`.
- An OpenAI-endpoint harness that returned while calls it started with ``run_tool`` were still
  running (an agent framework's own timeout, abandoning them): a call that waited for the
  trajectory's tool slot (``agent.max_parallel_tool_calls``) entered the tools after the
  episode had released its state, made it afresh, and nothing released it again (in process,
  it lived until the run's end). Such a call now releases what it made.
- The console's warning for a step whose episodes mostly failed quotes one episode's error,
  and the error that stops a run whose episodes all failed quotes the first: an error that
  quotes the policy's text (sqlite's ``near "...": syntax error`` for a skyrl-gym text2sql
  step, a reward function's message) wrote its escape sequences to the terminal raw (rich
  drops BEL only): clear the screen, set the clipboard (OSC 52 ended by ESC \\), forge a link.
  Both are now `visible`, as traces are.
- The search tool scored a query with rank_bm25's ``get_scores``, a loop over every document
  for every query word: the policy's query of thousands of words over a large corpus (10,000
  documents: 3.9 s for 1,000 words, so minutes for a turn's worth over a larger one) held a
  thread of the pool every episode's synchronous tools share long after its call timed out,
  and a few episodes searching so made their siblings' calls time out waiting for one (a
  sibling's lower reward is the searcher's advantage). It now reads each distinct query
  word's postings once: at most one pass over the corpus (100,000 words: 0.6 s), scores
  unchanged.
- A data row whose ``data_source`` holds ``#`` (``gsm8k#test``) names its episodes with it,
  and the traces mapped a batch's rows back to their trajectories by the uid before its first
  ``#`` (the marker of a trajectory's per-turn samples): such a traced episode got no learner
  signals (ratio, advantage, entropy in ``jarl view``), silently. The marker is the last ``#``.
- ``jarl eval --help`` said a success is "a reward above 0": a user reading it took a judge's
  1/10 for a solved task. It says what counts: ``data.success_reward`` (or the environment).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from jax_agent_rl.agent import openai_endpoint
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import AGENT_LOOPS, register_agent_loop, run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli import main
from jax_agent_rl.config import ConfigError, load_config, preview_config
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.datasets import PromptSampler
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, EnvStep, checked_step
from jax_agent_rl.rewards import (
    Answer,
    AnswerFaultError,
    RewardError,
    checked_reward,
    make_reward,
)
from jax_agent_rl.rl.batch import per_turn_samples, step_batch
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import Tool, ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.search import SearchTool, tokenize
from jax_agent_rl.train.episodes import (
    all_failed_error,
    episode_totals,
    first_error,
    metrics_of_totals,
    stop_warning,
)
from jax_agent_rl.train.step import distinct_samples, rollout_episodes
from jax_agent_rl.train.traces import trace_index
from jax_agent_rl.visible import lone_surrogate


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("2+2 is 4 \ud83d", "at character 9 ('\\ud83d')"),
        ("\udc80", "at character 0 ('\\udc80')"),
        (["fine", {"name": "f", "arguments": {"x\udfff": 1}}], "at character 1 ('\\udfff')"),
        (("a", ["b", ["c\ud800"]]), "at character 1 ('\\ud800')"),
        ("a pair, read as JSON writes it: " + json.loads('"\\ud83d\\ude00"'), None),
        ("\U0001f600 and \ue000 (private use, not a surrogate)", None),
        ({"n": 1, "x": [1.5, None, True]}, None),
        (b"\xed\xa0\x80", None),  # (bytes are no text it checks)
    ],
)
def test_one_helper_finds_a_lone_surrogate_in_text_and_json_values(
    value: object, where: str | None
) -> None:
    assert lone_surrogate(value) == where


def test_a_lone_surrogate_nested_past_the_recursion_limit_is_found() -> None:
    deep: list[object] = ["x\ud83d"]
    for _ in range(100_000):  # (past the recursion limit: walked without recursion)
        deep = [deep]
    assert lone_surrogate(deep) == "at character 1 ('\\ud83d')"


class Counter(Tool):
    """A stateful tool: each call counts the calls of its trajectory's state."""

    def __init__(self) -> None:
        self.name = "counter"
        self.schema = {
            "type": "function",
            "function": {
                "name": "counter",
                "description": "Counts this trajectory's calls.",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> list[int]:
        del trajectory_id, create_kwargs
        return [0]

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        state[0] += 1
        return ToolResult(str(state[0]))


def _counting_loop(episodes: int) -> Any:
    """A user loop: a call of the counter, then (once ``episodes`` episodes have made theirs)
    another; its answer is the two counts."""
    first_calls: list[str] = []
    all_called = asyncio.Event()

    async def counting(sample: Sample, ctx: AgentContext) -> Trajectory:
        first = await ctx.tools.call(sample.uid, "counter", {})
        first_calls.append(sample.uid)
        if len(first_calls) == episodes:
            all_called.set()
        await all_called.wait()
        second = await ctx.tools.call(sample.uid, "counter", {})
        await ctx.tools.release(sample.uid)
        traj = Trajectory(uid=sample.uid, group_id=sample.group_id, prompt_ids=[1])
        traj.messages = [{"role": "assistant", "content": f"{first.text},{second.text}"}]
        traj.end("eos")
        return traj

    return counting


async def _unscored(answer: Answer) -> float:
    del answer
    return 0.0


def test_a_row_drawn_twice_for_a_step_plays_apart(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    rows = [Sample(f"r-{i}", [{"role": "user", "content": "2+2?"}], "4") for i in range(10)]
    sampler = PromptSampler(rows, seed=0)
    batches = [[s.uid for s in sampler.next_batch(4)] for _ in range(100)]
    twice = [b for b in batches if len(set(b)) < len(b)]
    assert len(twice) == 7  # (batches past an epoch's end drew a row again)
    row = dataclasses.replace(rows[1], agent_name="counting")
    register_agent_loop("counting", _counting_loop(episodes=4))
    try:
        tools = LocalTools(ToolRegistry([Counter()]))
        ctx = AgentContext(
            backend, tokenizer, tools, make_parser("hermes"), AgentConfig(), TurnBuilder(tokenizer)
        )
        trajs = asyncio.run(
            rollout_episodes(
                [row, row],
                2,
                ctx,
                "s3a0",
                seed=0,
                score=_unscored,
                tool_reward_weight=0.0,
                success_reward=1.0,
            )
        )
    finally:
        del AGENT_LOOPS["counting"]
    assert [(t.uid, t.group_id) for t in trajs] == [
        ("r-1/s3a0/0", "r-1"),
        ("r-1/s3a0/1", "r-1"),
        ("r-1~1/s3a0/0", "r-1~1"),
        ("r-1~1/s3a0/1", "r-1~1"),
    ]
    assert [e.traj.messages[-1]["content"] for e in trajs] == ["1,2"] * 4  # (each its own state)
    assert tools.open_trajectories == 0
    drawn: set[str] = set()  # (a step's refill, and a name a row may itself have)
    again = distinct_samples([rows[1], Sample("r-1~1", [], "4")], drawn)
    assert [s.uid for s in distinct_samples([rows[1]], drawn)] == ["r-1~2"]
    assert [s.uid for s in again] == ["r-1", "r-1~1"] and drawn == {"r-1", "r-1~1", "r-1~2"}


def test_jarl_eval_says_what_a_success_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "a success is an outcome reward of at least data.success_reward" in said
    assert "above 0" not in said


@pytest.mark.parametrize(
    ("override", "kind"),
    [
        ("model.path=!!timestamp 2001-12-14", "date"),
        ("model.path=!!set {a, b}", "set"),
        ("agent.stop=[!!timestamp 2001-12-14 10:00:00]", "datetime"),
        ("data.rewards_by_source={a: !!set {x}}", "set"),
    ],
)
def test_an_override_of_a_value_omegaconf_cannot_hold_is_a_config_error(
    override: str, kind: str
) -> None:
    key = override.partition("=")[0]
    match = rf"^override {key}: Value '{kind}' is not a supported primitive type: give a string"
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=m", "data.train=t.jsonl", override])
    with pytest.raises(ConfigError, match=match):
        preview_config(None, [override])


@pytest.mark.parametrize(
    ("reward", "shown"),
    [
        (Fraction(10**5000, 3), "a Fraction of 16610-bit terms"),
        (Fraction(-(10**5000), 7), "a Fraction of 16610-bit terms"),
        (10**5000, "an int of 16610 bits"),
    ],
    ids=["fraction", "negative-fraction", "int"],
)
def test_a_reward_too_long_to_write_out_is_a_reward_error(reward: object, shown: str) -> None:
    with pytest.raises(RewardError, match=f"^mine gave reward {shown}: not a finite number$"):
        checked_reward(reward, "mine")
    step = EnvStep([{"role": "user", "content": "again"}], reward=reward, done=False)
    with pytest.raises(EnvError, match=f"^env.step gave reward {shown}: not a finite number$"):
        checked_step(step, "env")
    assert checked_reward(Fraction(10**5000 + 1, 10**5000), "mine") == 1.0  # (it converts)


# an answer simple_integration's scorer reads (`answer_code.harmless`) and sympy hangs on
HANGING = "*".join(f"sin({k}*X)" for k in range(1, 13))


def test_an_answer_that_hangs_a_reasoning_gym_scorer_scores_zero() -> None:
    row = reasoning_gym.samples("reasoning_gym:simple_integration?size=1&seed=0", "x")[0]
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", "data.reward_timeout_s=2", "data.reward_workers=1"],
    )

    def answer(text: str, entry: dict[str, Any]) -> Answer:
        extra = {**row.extra, "reasoning_gym": entry}
        return Answer(row.data_source, "", f"<answer>{text}</answer>", row.ground_truth, extra)

    entry = row.extra["reasoning_gym"]
    broken = {**entry, "answer": HANGING}  # (a task whose own answer hangs its scorer)
    with make_reward(cfg.data) as score:
        with pytest.raises(AnswerFaultError, match="the answer's fault, scored 0"):
            asyncio.run(score(answer(HANGING, entry)))  # (a wrong answer: `score_episodes`)
        assert asyncio.run(score(answer(row.ground_truth, entry))) == 1.0
        late = (
            r"^the reasoning-gym task's scorer \(data\.reward unset\) took longer than "
            r"data\.reward_timeout_s=2s \(its worker process was stopped\)$"
        )
        with pytest.raises(RewardError, match=late):
            asyncio.run(score(answer(HANGING, broken)))


HERE = "tests.hostile.test_eleventh_pass"
BOUND_S = 30.0  # how long a wait on another thread's event may take (the test fails past it)
_HELD: dict[str, Any] = {}  # the gated tool's events: entered (a thread's), gate (the test's loop)
_CANCELLED: list[str] = []  # the gated calls cancelled
_LEFT: list[asyncio.Future[str]] = []  # the calls the abandoning harness left (in its loop)


class Gated(Tool):
    """A stateful tool whose calls wait for ``_HELD["gate"]`` (``_HELD["entered"]``: one has)."""

    def __init__(self) -> None:
        self.name = "gated"
        self.schema = {
            "type": "function",
            "function": {
                "name": "gated",
                "description": "Waits for the test.",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def create(self, trajectory_id: str, **create_kwargs: Any) -> str:
        del create_kwargs
        return trajectory_id

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del arguments
        _HELD["entered"].set()
        try:
            await _HELD["gate"].wait()
        except asyncio.CancelledError:
            _CANCELLED.append(state)
            raise
        return ToolResult(f"ran for {state}")


async def abandoning(task: HarnessTask) -> None:
    """A harness that starts two of the run's tool calls, and returns once one is running."""
    for i in range(2):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "gated", "arguments": "{}"}}
        _LEFT.append(asyncio.ensure_future(task.run_tool(call)))
    # (the other waits for the trajectory's one tool slot)
    assert await asyncio.to_thread(_HELD["entered"].wait, BOUND_S)


def test_a_tool_call_a_harness_left_running_releases_the_state_it_made(
    tokenizer: Tokenizer, backend: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls the harness left are cancelled as its event loop closes (its tasks are), and
    the state the running one made is released with the episode's. (The backend here never
    samples a turn: the harness's calls are taken as the model's, which `run_tool` otherwise
    checks, `tests/hostile/test_openai_endpoint.py`.)"""
    made = lambda _session, call: ParsedCall(call["function"]["name"], {})  # noqa: E731
    monkeypatch.setattr(openai_endpoint.Session, "_made", made)
    tools = LocalTools(ToolRegistry([Gated()]))
    config = AgentConfig(harness=f"{HERE}:abandoning", max_parallel_tool_calls=1)

    async def go() -> tuple[Trajectory, int]:
        _HELD.update(entered=threading.Event(), gate=asyncio.Event())
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample(
            "h-0", [{"role": "user", "content": "2+2?"}], "4", agent_name="openai_agent"
        )
        traj = await run_sample(sample, ctx)
        _HELD["gate"].set()  # (nothing waits on it any more)
        return traj, tools.open_trajectories

    _CANCELLED.clear()
    try:
        traj, still_open = asyncio.run(go())
    finally:
        _LEFT.clear()
    assert traj.stop_reason == "harness_error"  # (it never called the endpoint)
    assert _CANCELLED == ["h-0"]  # the running call; the waiting one never ran
    assert still_open == 0


def test_a_failed_episodes_error_reaches_the_console_visible() -> None:
    sql = 'SELECT "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x1b\\"'  # clear the screen, set the clipboard
    error = f"env error: text2sql.step raised OperationalError: near {sql}: syntax error"
    trajs = [Trajectory(uid=f"r-{i}/s1a0/0", group_id=f"r-{i}", prompt_ids=[1]) for i in range(2)]
    for traj in trajs:
        traj.end("env_error", error)
    episodes = [Episode(t) for t in trajs]
    totals = episode_totals(episodes)
    warning = stop_warning(metrics_of_totals(totals), episodes)
    stopped = all_failed_error(totals, first_error(episodes))
    assert warning is not None and stopped is not None
    for line in (warning, str(stopped)):
        assert "\x1b" not in line
        assert 'near SELECT "\u241b[2J\u241b]52;c;cm0gLXJmIH4=\u241b\\": syntax error' in line


class _Reads(dict[str, list[tuple[int, int]]]):
    """Postings that count the words looked up."""

    looked_up: list[str]

    def get(self, word: str, default: object = None) -> object:  # type: ignore[override]
        self.looked_up.append(word)
        return super().get(word, default)


def test_a_search_reads_each_query_word_once_however_long_the_query() -> None:
    docs = [
        {"title": "Paris", "text": "Paris is the capital and largest city of France."},
        {"title": "Lyon", "text": "Lyon is a city in France, on the Rhone."},
        {"title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"title": "Rhone", "text": "The Rhone flows through Lyon to the sea, the sea."},
    ]
    search = SearchTool(docs, k=4)
    for query in ("capital of France", "the sea the sea lyon", "rhone city capital berlin", "x"):
        words = tokenize(query)
        want = search.index.get_scores(words)  # (rank_bm25's own scores)
        got = search.scores(words)
        assert sorted(got) == [
            i for i, d in enumerate(docs) if set(words) & set(tokenize(f"{d['title']} {d['text']}"))
        ]
        assert all(got[i] == pytest.approx(want[i], rel=1e-12) for i in got)
    flood = " ".join(["capital"] * 50_000 + ["of", "France", "nowhere"] * 10_000)
    want = search.index.get_scores(tokenize(flood))  # (a loop over the 4 documents per word)
    ranked = sorted([0, 1, 2], key=lambda i: -want[i])  # (those holding a query word)
    reads = _Reads(search._postings)
    reads.looked_up = []
    search._postings = reads
    assert search.top(flood) == [docs[i] for i in ranked]
    assert sorted(reads.looked_up) == ["capital", "france", "nowhere", "of"]


def test_a_traced_episode_whose_uid_holds_a_hash_is_found_in_the_batch() -> None:
    trajs = []
    for k in range(2):
        t = Trajectory(uid=f"gsm8k#test-{k}/s1a0/0", group_id=f"gsm8k#test-{k}", prompt_ids=[1, 2])
        t.append([10 + k, 11], model=True, logprobs=[-0.1, -0.2])
        t.append([5, 6], model=False)
        t.append([20 + k], model=True, logprobs=[-0.3])
        trajs.append(t)
    seqs = [t.train_sequence(0.0) for t in trajs]
    for rows in (seqs, [s for t in seqs for s in per_turn_samples(t)]):
        batch, _, _ = step_batch(
            rows, np.zeros(len(rows)), [r.group_id for r in rows], np.ones(len(rows)),
            mini_batches=1, row_tokens=32, bucket=8, rows_per_micro=2,
        )  # fmt: skip
        index = trace_index(batch, rows, trajs)
        targets = batch.targets.reshape(-1)
        for s, t in enumerate(trajs):
            for j, (token, m) in enumerate(zip(t.response_ids, t.loss_mask, strict=True)):
                if m or rows is seqs:  # (per-turn rows hold only the sampled tokens)
                    assert index[s, j] >= 0 and targets[index[s, j]] == token
