"""Retrieval over a local corpus with BM25 (rank_bm25), as a tool.

The corpus is a JSONL file of ``{"id": ..., "title": ..., "text": ...}`` documents (or a list
given directly). Queries and documents are lower-cased and split into word tokens; the top
``k`` documents come back as numbered passages, each cut to ``max_chars``. Scoring runs in a
thread of `TOOL_THREADS`, never on the event loop, and reads each distinct query word's
postings (the documents holding it) once: at most one pass over the corpus, however long the
query. (rank_bm25's ``get_scores`` loops over every document for every query word, so the
policy's query of thousands of words over a large corpus held a thread of the pool, which
every episode's synchronous tools share, for minutes after its call timed out: a few episodes
searching so took the pool from their siblings, whose calls timed out in turn.) The scores
are rank_bm25's (its idf, ``k1``, ``b``), a repeated word counted as often as it is repeated.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rank_bm25 import BM25Okapi

from jax_agent_rl.tools.base import TOOL_THREADS, Tool, ToolResult, function_schema

_WORD = re.compile(r"\w+", re.UNICODE)


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class SearchTool(Tool):
    """``search(query)``: the best-matching passages of a local corpus."""

    def __init__(
        self,
        corpus: str | Sequence[dict[str, Any]],
        k: int = 3,
        max_chars: int = 400,
    ) -> None:
        if isinstance(corpus, str):
            if Path(corpus).exists() and not Path(corpus).is_file():  # its read never ends
                raise ValueError(
                    f"the search corpus {corpus} is not a regular file: name a JSONL file"
                )
            lines = Path(corpus).read_text().splitlines()
            docs = [json.loads(line) for line in lines if line.strip()]
        else:
            docs = list(corpus)
        if not docs:
            raise ValueError("the search corpus is empty")
        missing = [i for i, d in enumerate(docs) if "text" not in d]
        if missing:
            raise ValueError(f"corpus documents {missing[:5]} have no 'text' field")
        self.docs, self.k, self.max_chars = docs, k, max_chars
        tokens = [tokenize(f"{d.get('title', '')} {d['text']}") for d in docs]
        self.index = BM25Okapi(tokens)
        self._postings: dict[str, list[tuple[int, int]]] = {}  # word -> (document, count)
        for i, counts in enumerate(self.index.doc_freqs):
            for word, count in counts.items():
                self._postings.setdefault(word, []).append((i, count))

        def search(query: str) -> str:
            """Search the knowledge base and return the most relevant passages.

            Args:
                query: What to look for, in a few keywords.
            """
            return query

        self.schema = function_schema(search)
        self.name = "search"

    def scores(self, words: list[str]) -> dict[int, float]:
        """The BM25 score of each document sharing a word with ``words`` (rank_bm25's
        ``get_scores``, which gives the others 0), from the postings of each distinct word."""
        ix = self.index
        out: dict[int, float] = collections.defaultdict(float)
        for word, repeats in collections.Counter(words).items():
            idf = ix.idf.get(word) or 0.0
            for i, f in self._postings.get(word, ()):
                norm = ix.k1 * (1 - ix.b + ix.b * ix.doc_len[i] / ix.avgdl)
                out[i] += repeats * idf * (f * (ix.k1 + 1) / (f + norm))
        return out

    def top(self, query: str) -> list[dict[str, Any]]:
        """The ``k`` best documents sharing at least one word with the query (BM25 scores can
        be negative for words frequent in a small corpus, so a score threshold would not do)."""
        scores = self.scores(tokenize(query))
        order = sorted(scores, key=lambda i: (-scores[i], i))
        return [self.docs[i] for i in order[: self.k]]

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del state
        hits = await TOOL_THREADS.run(self.top, arguments["query"])
        if not hits:
            return ToolResult("no results")
        lines = []
        for n, d in enumerate(hits, start=1):
            title = f"{d['title']}: " if d.get("title") else ""
            lines.append(f"[{n}] {title}{d['text'][: self.max_chars]}")
        return ToolResult("\n".join(lines))
