"""Tools that never return on some input (a service that never answers, a pathological
expression), which a policy finds and calls again and again: each call ends at its timeout as
an error result. A synchronous one's threads left running inside the function (a thread
cannot be stopped) hold the tools' own bounded pool, never the event loop's default executor,
which the learner's steps and the judge wait on; an async one that ignores its cancellation
is abandoned.

Every wait is on an event, bounded; no test reads the clock.

The search tool scored a query with rank_bm25's ``get_scores``, a loop over every document for
every query word: the policy's query of thousands of words over a large corpus (10,000
documents: 3.9 s for 1,000 words, so minutes for a turn's worth over a larger one) held a
thread of the pool every episode's synchronous tools share long after its call timed out,
and a few episodes searching so made their siblings' calls time out waiting for one. It now
reads each distinct query word's postings once: at most one pass over the corpus (100,000
words: 0.6 s), scores unchanged.

Synchronous tools share one pool of 32 threads (`TOOL_THREADS`), and a call past its timeout
keeps its thread until it returns. One episode's calls that hang a tool for good (a query that
runs for ever: sqlite has no timeout), 4 turns of 8, held all 32, and from then on every
sibling's call of every synchronous tool timed out waiting for a thread (a sibling's lower
reward is the episode's advantage). A trajectory's calls now hold at most 4 threads
(`TOOL_THREADS_PER_TRAJECTORY`), those abandoned included."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from jax_agent_rl.tools.base import (
    TOOL_THREADS_PER_TOOL,
    TOOL_THREADS_PER_TRAJECTORY,
    tool,
)
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.search import SearchTool, tokenize

BOUND_S = 30.0  # how long the test waits for work on the default executor (it fails past it)
RELEASE = threading.Event()


@tool
def lookup(query: str) -> str:
    """Look a query up in a service that never answers.

    Args:
        query: what to look up.
    """
    del query
    RELEASE.wait(2 * BOUND_S)  # (the test releases it at its end)
    return "found"


def test_stuck_tool_calls_leave_the_default_executor_to_the_rest_of_the_run() -> None:
    """40 stuck calls (more than any default executor's 32 threads) time out as error results;
    then work sent to the default executor still runs (before: it waited for ever)."""

    async def go() -> tuple[list[str], str]:
        tools = LocalTools(ToolRegistry([lookup]), timeout_s=0.01)
        calls = [tools.call(f"t{i}", "lookup", {"query": "x"}) for i in range(40)]
        results = [r.text for r in await asyncio.gather(*calls)]
        ran = await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), BOUND_S)
        return results, ran

    try:
        results, ran = asyncio.run(go())
        assert results == ["error: lookup timed out after 0.01s"] * 40
        assert ran == "ran"
    finally:
        RELEASE.set()  # the stuck threads return, and end


class Retrying:
    """An async tool whose retry loop catches whatever stops it, its cancellation too, until
    the test releases it (or 2 x BOUND_S pass)."""

    def __init__(self) -> None:
        self.released, self.ended = asyncio.Event(), asyncio.Event()
        self.cancelled = 0

    async def fetch(self, url: str) -> str:
        """Fetch a page, retrying whatever fails.

        Args:
            url: the page.
        """
        del url
        for _ in range(2):
            try:
                await asyncio.wait_for(self.released.wait(), 2 * BOUND_S)
                break
            except BaseException:  # the cancellation too: the retry loop under test
                self.cancelled += 1
        self.ended.set()
        return "page"


def test_an_async_tool_that_ignores_its_cancellation_is_abandoned_at_the_timeout() -> None:
    """Its call is an error result at the tool timeout (before: the call ran on, however
    long, and its late result was taken as the tool's answer)."""
    retrying = Retrying()
    fetch = tool(retrying.fetch, name="fetch")

    async def go() -> str:
        tools = LocalTools(ToolRegistry([fetch]), timeout_s=0.01)
        try:
            return (await tools.call("t", "fetch", {"url": "x"})).text
        finally:
            retrying.released.set()  # the abandoned call ends
            await retrying.ended.wait()

    assert asyncio.run(go()) == "error: fetch timed out after 0.01s"
    assert retrying.cancelled == 1


def test_a_search_of_a_large_corpus_ends_at_the_timeout_and_holds_no_event_loop() -> None:
    """BM25 scored a query word by word over every document (rank_bm25 loops in Python), so a
    query of thousands of words over a large corpus ran for minutes: scored on the event loop,
    the call's timeout never fired and every other episode stood still. Here the scoring is
    held until the test releases it: the call ends at its timeout as an error result, and
    the event loop is free meanwhile."""
    search = SearchTool([{"title": "Paris", "text": "Paris is the capital of France."}])
    scores, release, scored = search.scores, threading.Event(), threading.Event()

    def held_scores(words: list[str]) -> dict[int, float]:
        release.wait(BOUND_S)  # (the test releases it at its end)
        scored.set()
        return scores(words)

    search.scores = held_scores  # type: ignore[method-assign]

    async def go() -> str:
        tools = LocalTools(ToolRegistry([search]), timeout_s=0.01)
        result = await tools.call("t0", "search", {"query": "capital"})
        return result.text

    try:
        assert asyncio.run(go()) == "error: search timed out after 0.01s"
        assert not scored.is_set()  # the result came while the scoring was still held
    finally:
        release.set()


SLOW = {"entered": 0, "all_in": threading.Event(), "go": threading.Event()}
SLOW_LOCK = threading.Lock()


@tool
def slow(n: int) -> str:
    """A tool whose cost grows with its input: here, until the test lets it go.

    Args:
        n: the input.
    """
    with SLOW_LOCK:
        SLOW["entered"] += 1
        if SLOW["entered"] == TOOL_THREADS_PER_TOOL:
            SLOW["all_in"].set()
    SLOW["go"].wait(BOUND_S)
    return str(n)


@tool
def quick(n: int) -> str:
    """A cheap tool.

    Args:
        n: the input.
    """
    return str(n)


def test_one_slow_tool_leaves_threads_for_the_others() -> None:
    """32 calls of one slow synchronous tool held all 32 shared tool threads, and every other
    tool's call waited for one (then timed out). One tool's calls now hold at most
    TOOL_THREADS_PER_TOOL; a call of another tool runs while they are held."""
    tools = LocalTools(ToolRegistry([slow, quick]))

    async def go() -> tuple[str, int]:
        held = [asyncio.ensure_future(tools.call(f"t{i}", "slow", {"n": i})) for i in range(32)]
        assert await asyncio.to_thread(SLOW["all_in"].wait, BOUND_S)
        answer = await asyncio.wait_for(tools.call("q", "quick", {"n": 7}), BOUND_S)
        entered = SLOW["entered"]  # (the other 8 wait for a thread of the slow tool's)
        SLOW["go"].set()
        await asyncio.gather(*held)
        return answer.text, entered

    text, entered = asyncio.run(go())
    assert text == "7" and entered == TOOL_THREADS_PER_TOOL


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


_QUERY: dict[str, Any] = {"gate": threading.Event(), "entered": 0, "lock": threading.Lock()}


_ALL_ENTERED = threading.Event()  # the hostile episode's calls holding threads all entered


@tool
def query(sql: str) -> str:
    """Runs a query on the task's database.

    Args:
        sql: the query.
    """
    if "RECURSIVE" in sql:  # the policy's query that runs for ever (until the test's end)
        with _QUERY["lock"]:
            _QUERY["entered"] += 1
            if _QUERY["entered"] == TOOL_THREADS_PER_TRAJECTORY:
                _ALL_ENTERED.set()
        _QUERY["gate"].wait(2 * BOUND_S)
    return "1 row"


def test_one_episodes_stuck_tool_calls_leave_its_siblings_threads() -> None:
    hostile = LocalTools(ToolRegistry([query]), timeout_s=0.01)  # (its calls time out at once)
    honest = LocalTools(ToolRegistry([query]), timeout_s=BOUND_S)

    async def go() -> tuple[list[str], str]:
        turn = asyncio.Semaphore(4)  # (agent.max_parallel_tool_calls)

        async def stuck() -> str:
            async with turn:
                return (await hostile.call("evil/s1a0/0", "query", {"sql": "WITH RECURSIVE"})).text

        texts = [t for _ in range(4) for t in await asyncio.gather(*(stuck() for _ in range(8)))]
        sibling = await honest.call("fine/s1a0/1", "query", {"sql": "SELECT 1"})
        return texts, sibling.text

    try:
        texts, sibling = asyncio.run(go())
        assert _ALL_ENTERED.wait(BOUND_S)
        assert texts == ["error: query timed out after 0.01s"] * 32
        assert sibling == "1 row"  # (before: it timed out waiting for a thread)
        assert _QUERY["entered"] == TOOL_THREADS_PER_TRAJECTORY  # (before: 32)
    finally:
        _QUERY["gate"].set()
