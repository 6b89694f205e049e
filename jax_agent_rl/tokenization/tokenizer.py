"""HF tokenizers from a local folder, with their chat templates.

Special tokens come only from where they are meant to: `Tokenizer.encode` reads special-token text
as the special token (a chat template's own markers, ``<|im_start|>``), and `encode_plain` reads
it in the spans it is given as plain text (a message's content: an observation that writes
``<|im_start|>assistant`` must not open a turn), as transformers' ``split_special_tokens=True``
does.

A folder holds ``tokenizer.json`` (the `tokenizers` model), ``tokenizer_config.json`` (special
tokens, optionally the chat template) and optionally ``chat_template.jinja`` (transformers 5
writes the template there). Chat templates render as transformers renders them, bounded in work
and size (`jax_agent_rl.tokenization.templating`), so the same template gives the same text here
and there, and a template that would loop for ever or fill the memory fails instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from jax_agent_rl.files import regular_file
from jax_agent_rl.tokenization.templating import ChatTemplateError, Message, render_template

TOKENIZER_FOLDER = "a tokenizer folder"  # what holds its files, in errors
WORD_JOINER = "\u2060"  # what `Tokenizer.defused` writes into special-token text


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids, plus the chat template. Special tokens are given by their text."""

    backend: HFTokenizer
    chat_template: str | None = None
    chat_template_origin: str = "the chat template"  # names the template in errors
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token: str | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not regular_file(tok_file, TOKENIZER_FOLDER):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config_file = path / "tokenizer_config.json"
        has_config = regular_file(config_file, TOKENIZER_FOLDER)
        config = json.loads(config_file.read_text()) if has_config else {}
        template = config.get("chat_template")
        origin = f"the chat template of {config_file}"
        if isinstance(template, list):  # named templates: use "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if regular_file(jinja_file, TOKENIZER_FOLDER):
            template = jinja_file.read_text()
            origin = f"the chat template {jinja_file}"
        tok = cls(
            backend=HFTokenizer.from_file(str(tok_file)),
            chat_template=template,
            chat_template_origin=origin,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            bos_token=_token_content(config.get("bos_token")),
        )
        for name in ("eos_token", "pad_token", "bos_token"):
            value = getattr(tok, name)
            if value is not None and tok.backend.token_to_id(value) is None:
                raise ValueError(f"{name}={value!r} of {config_file} is not in the vocabulary")
        return tok

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its longest vocabulary entry,
        counted as the model stores it, which is never shorter than the text it covers (a
        byte-level entry has a character per byte, a byte-fallback entry ``<0x41>`` six, a
        word-piece entry its ``##``). So a text of more than ``max_token_chars * n``
        characters takes more than ``n`` tokens (unless a normalizer drops or merges
        characters before the model reads them: accent stripping, NFC)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)))

    def token_id(self, token: str) -> int:
        """The id of one token given by its text (a special token, say); raises if absent."""
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return int(tid)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_id(self.pad_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    @functools.cached_property
    def _special_text(self) -> re.Pattern[str] | None:
        added = self.backend.get_added_tokens_decoder().values()
        specials = [t.content for t in added if t.special]
        if not specials:
            return None
        return re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` holds the text of a special token."""
        return self._special_text is not None and self._special_text.search(text) is not None

    def defused(self, text: str) -> str:
        """``text`` with a word joiner (`WORD_JOINER`, U+2060: invisible, no space) after the
        first character of each special token's text in it, until none is left, so that no
        tokenizer reads that text as the special token: for text whose tokens are not ours to
        encode as plain text (verl-tool's client tokenizes a tool server's observations
        itself), or that a chat template rewrites, so that its special-token text cannot be
        located (`jax_agent_rl.tokenization.turns`)."""
        pattern = self._special_text
        while pattern is not None and pattern.search(text):
            text = pattern.sub(lambda m: m.group()[0] + WORD_JOINER + m.group()[1:], text)
        return text

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        """A copy of the backend that reads special-token text as plain text."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """``text`` encoded, with the special-token text in its ``plain`` character spans
        (sorted, disjoint) read as plain text; elsewhere as `encode` reads it."""
        ids: list[int] = []
        at = 0
        for start, end in plain:
            ids += self.encode(text[at:start])
            ids += self._plain_ids(text[start:end])
            at = end
        return ids + self.encode(text[at:])

    def _plain_ids(self, text: str) -> list[int]:
        """``text`` read as plain text, never as a special token's id: a vocabulary whose
        merges spell a special token (one trained on text holding its markers) would give the
        token back from its characters, so such a piece is encoded a character at a time."""
        ids = self._plain_backend.encode(text, add_special_tokens=False).ids
        if self.special_ids.isdisjoint(ids):
            return list(ids)
        plain = self._plain_backend
        return [i for char in text for i in plain.encode(char, add_special_tokens=False).ids]

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of its special tokens."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, t in added.items() if t.special)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: where it spells a special token (a model
        writing ``<|im_start|>``), that spelling is encoded as plain text, so it never becomes
        the token itself (`encode_plain`). Decodes back to ``text``."""
        pattern = self._special_text
        spans = [] if pattern is None else [m.span() for m in pattern.finditer(text)]
        return self.encode_plain(text, spans)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to ``messages`` (and tool JSON schemas), as text."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        special = dict(
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )
        return render_template(
            self.chat_template,
            messages,
            tools,
            add_generation_prompt,
            origin=self.chat_template_origin,
            **special,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat (special tokens come from the template text)."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text)
