"""Retrieval over a local corpus with BM25 (rank_bm25), as a tool.

The corpus is a JSONL file of ``{"id": ..., "title": ..., "text": ...}`` documents (or a list
given directly). Queries and documents are lower-cased and split into word tokens; the top
``k`` documents come back as numbered passages, each cut to ``max_chars``. Scoring (a Python
loop over every document per query word) runs in a thread of `TOOL_THREADS`, never on the event
loop: a long query over a large corpus runs for minutes, and on the loop it held every other
episode and its call's timeout could not fire.
"""

from __future__ import annotations

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
        self._vocab = [set(t) for t in tokens]

        def search(query: str) -> str:
            """Search the knowledge base and return the most relevant passages.

            Args:
                query: What to look for, in a few keywords.
            """
            return query

        self.schema = function_schema(search)
        self.name = "search"

    def top(self, query: str) -> list[dict[str, Any]]:
        """The ``k`` best documents sharing at least one word with the query (BM25 scores can
        be negative for words frequent in a small corpus, so a score threshold would not do)."""
        words = tokenize(query)
        scores = self.index.get_scores(words)
        matching = [i for i in range(len(self.docs)) if self._vocab[i].intersection(words)]
        order = sorted(matching, key=lambda i: -scores[i])
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
