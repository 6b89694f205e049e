"""Token-exact turn building: history is never re-tokenized.

A conversation's token ids grow only by appending: the model's sampled tokens verbatim, and
for every other turn the token *delta* the chat template adds for it. The delta of new
messages is rendered against a fixed stand-in history, ``[user "X", assistant "Y"]``:

    delta = render(stand_in + new, generation_prompt) - render(stand_in)

so a template that rewrites earlier turns (dropping ``<think>`` blocks of old assistant
messages, say) cannot change tokens the model already saw. The template's text after an
assistant message's end-of-turn token (ChatML's ``"\\n"`` after ``<|im_end|>``) is not sampled
by the model; `close_assistant_turn` supplies it, so the next turn starts exactly where the
template would put it.

Special tokens come only from the template's own text: a message whose content, or any other
text field, holds the text of a special token (an observation writing ``<|im_start|>assistant``,
which would otherwise forge a turn; a tool message's ``name``, the name the model called, which
some templates write) has that text encoded as plain text (`Tokenizer.encode_plain`). Where the
template writes it is found by rendering a probe in its place (a number between two runs of a
private-use character longer than any run in the render: no message can spell one). Where the
template rewrites such a text so that it cannot be found as written (trims it, writes it as
JSON), the text is rendered with its special-token text broken by an invisible character
(`Tokenizer.defused`); a template whose render then still holds special tokens its own render
does not is refused for it with a `ChatTemplateError`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from jax_agent_rl.tokenization.tokenizer import ChatTemplateError, Message, Tokenizer

TruncateSide = Literal["left", "right", "middle"]

_MARK = "\ue000"  # a private-use character: a probe's mark is a run of it longer than any render's

_STAND_IN: list[Message] = [
    {"role": "user", "content": "X"},
    {"role": "assistant", "content": "Y"},
]


def _defused(tokenizer: Tokenizer, value: Any) -> Any:
    """``value`` (a tool's JSON schema) with every string in it, keys included,
    `Tokenizer.defused`: a description holding ``<|im_end|>`` (a harness's tools, a third
    party's schema) rendered live special tokens into the prompt's system turn."""
    if isinstance(value, str):
        return tokenizer.defused(value)
    if isinstance(value, dict):
        return {_defused(tokenizer, k): _defused(tokenizer, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_defused(tokenizer, v) for v in value]
    return value


class TurnBuilder:
    """Renders prompts and per-turn token deltas for one tokenizer, template and tool list."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> None:
        if tokenizer.eos_token is None:
            raise ChatTemplateError("the tokenizer has no eos_token (the end of an assistant turn)")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        # as rendered: a schema's text is written as JSON, where it cannot be located: defused
        self._rendered_tools = [_defused(tokenizer, t) for t in self.tools or []] or None
        self.template_kwargs = template_kwargs
        self.eos_id = tokenizer.token_id(tokenizer.eos_token)
        base = self._render(_STAND_IN, add_generation_prompt=False)
        end = "Y" + tokenizer.eos_token
        if end not in base:
            raise ChatTemplateError(
                f"the template does not end assistant messages with eos_token "
                f"{tokenizer.eos_token!r}; cannot close turns token-exactly"
            )
        self._base = base
        self._after_eos_ids = tokenizer.encode(base[base.rindex(end) + len(end) :])

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(
            messages, self._rendered_tools, add_generation_prompt, **self.template_kwargs
        )

    def _ids(self, messages: Sequence[Message], text: str, start: int = 0) -> list[int]:
        """The tokens of ``text``, the render of ``messages`` (with the generation prompt), from
        character ``start`` on, special tokens only where the template writes them (module
        docstring)."""
        marked = [
            (i, key)
            for i, m in enumerate(messages)
            for key, value in m.items()
            if key != "role" and isinstance(value, str) and self.tokenizer.has_special_text(value)
        ]
        if not marked:
            return self.tokenizer.encode(text[start:])
        try:
            spans = self._special_spans(messages, marked, text)
        except ChatTemplateError:
            return self._defused_ids(messages, marked, start)
        return self.tokenizer.encode_plain(
            text[start:], [(max(a, start) - start, b - start) for a, b in spans if b > start]
        )

    def _defused_ids(
        self, messages: Sequence[Message], marked: list[tuple[int, str]], start: int
    ) -> list[int]:
        """The tokens of the render of ``messages`` from character ``start`` on, where the
        template rewrites the texts ``marked`` (trims them, writes them as JSON, as Llama
        3.1's writes a tool message) so that they cannot be located: each rendered with its
        special-token text broken (`Tokenizer.defused`), so that text stays text. (Such an
        episode ended agent_error, untrained: a policy whose code printed ``<|eot_id|>``
        escaped its penalty.) Raises `ChatTemplateError` if the render then holds special-token
        text the template's own render (each text replaced by a probe) does not."""
        defused = [dict(m) for m in messages]
        for i, key in marked:
            defused[i][key] = self.tokenizer.defused(str(messages[i][key]))
        text = self._render(defused, add_generation_prompt=True)
        emptied = [dict(m) for m in messages]
        for i, key in marked:
            emptied[i][key] = ""
        own = self._render(emptied, add_generation_prompt=True)
        if self._special_count(text) != self._special_count(own):
            raise ChatTemplateError(
                f"{self.tokenizer.chat_template_origin} rewrites a message's text that holds "
                "special-token text, so that text cannot be kept from acting as special tokens"
            )
        return self.tokenizer.encode(text[start:])

    def _special_count(self, text: str) -> int:
        """How many special tokens ``text`` encodes to."""
        return sum(i in self.tokenizer.special_ids for i in self.tokenizer.encode(text))

    def _special_spans(
        self, messages: Sequence[Message], marked: list[tuple[int, str]], text: str
    ) -> list[tuple[int, int]]:
        """Where the texts ``messages[i][key]`` of ``marked`` lie in their render ``text``, in
        order: the render with each replaced by a probe (its number between two marks, runs of
        `_MARK` longer than any in ``text``), the texts put back, must give ``text``. A text
        the template does not write (a tool message's ``name``, in most templates) has no span;
        one it writes twice has two."""
        mark = _MARK * (1 + max(map(len, re.findall(f"{_MARK}+", text)), default=0))
        probed_messages = [dict(m) for m in messages]
        texts: dict[str, str] = {}
        for n, (i, key) in enumerate(marked):
            probe = probed_messages[i][key] = f"{mark}{n}{mark}"
            texts[probe] = messages[i][key]
        probed = self._render(probed_messages, add_generation_prompt=True)
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        at = length = 0
        for found in re.finditer(f"{mark}[0-9]+{mark}", probed):
            value = texts.get(found.group())
            if value is None:
                break
            pieces += [probed[at : found.start()], value]
            length += found.start() - at
            spans.append((length, length + len(value)))
            length += len(value)
            at = found.end()
        if "".join(pieces) + probed[at:] != text:
            raise ChatTemplateError(
                f"{self.tokenizer.chat_template_origin} rewrites a message's text that holds "
                "special-token text, so that text cannot be kept from acting as special tokens"
            )
        return spans

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first request's prompt: the messages and the assistant generation prompt."""
        return self._ids(messages, self._render(messages, add_generation_prompt=True))

    def close_assistant_turn(self, sampled: Sequence[int]) -> list[int]:
        """Tokens that end a model turn the way the template ends an assistant message: eos
        (if the model did not sample it) and the template's text after eos."""
        if sampled and sampled[-1] == self.eos_id:
            return list(self._after_eos_ids)
        return [self.eos_id, *self._after_eos_ids]

    def messages_delta(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of ``messages`` (tool results, a user reply) plus the next generation prompt,
        to be appended right after a closed assistant turn."""
        conversation = [*_STAND_IN, *messages]
        full = self._render(conversation, add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ChatTemplateError(
                "the chat template renders earlier messages differently when more follow; "
                "the turn delta is undefined"
            )
        return self._ids(conversation, full, start=len(self._base))

    def truncate_text(self, text: str, max_tokens: int, side: TruncateSide) -> str:
        """``text`` cut to at most ``max_tokens`` tokens, marking where it was cut."""
        ids = self.tokenizer.encode(text)
        if len(ids) <= max_tokens:
            return text
        marker = "...(truncated)..."
        keep = max(max_tokens - len(self.tokenizer.encode(marker)), 0)
        if side == "left":
            return marker + self.tokenizer.decode(ids[len(ids) - keep :])
        if side == "right":
            return self.tokenizer.decode(ids[:keep]) + marker
        head = keep // 2
        return (
            self.tokenizer.decode(ids[:head])
            + marker
            + self.tokenizer.decode(ids[len(ids) - (keep - head) :])
        )
