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

Special tokens come only from the template's own text: a message whose content holds the text of
a special token (an observation writing ``<|im_start|>assistant``, which would otherwise forge a
turn) has that content encoded as plain text (`Tokenizer.encode_plain`). Its place in the render
is found by rendering a stand-in for it; a template that rewrites such a content (so that it
cannot be found as written) is refused for it with a `ChatTemplateError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from jax_agent_rl.tokenization.tokenizer import ChatTemplateError, Message, Tokenizer

TruncateSide = Literal["left", "right", "middle"]

_PROBE = "\ue000{}\ue001"  # a message's content in the probe render (private-use characters)

_STAND_IN: list[Message] = [
    {"role": "user", "content": "X"},
    {"role": "assistant", "content": "Y"},
]


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
            messages, self.tools, add_generation_prompt, **self.template_kwargs
        )

    def _ids(self, messages: Sequence[Message], text: str, start: int = 0) -> list[int]:
        """The tokens of ``text``, the render of ``messages`` (with the generation prompt), from
        character ``start`` on, special tokens only where the template writes them (module
        docstring)."""
        marked = [
            i
            for i, m in enumerate(messages)
            if isinstance(m.get("content"), str) and self.tokenizer.has_special_text(m["content"])
        ]
        if not marked:
            return self.tokenizer.encode(text[start:])
        spans = self._content_spans(messages, marked, text)
        return self.tokenizer.encode_plain(
            text[start:], [(max(a, start) - start, b - start) for a, b in spans if b > start]
        )

    def _content_spans(
        self, messages: Sequence[Message], marked: list[int], text: str
    ) -> list[tuple[int, int]]:
        """Where the contents of ``messages[marked]`` lie in their render ``text``, in order:
        the render with each replaced by a probe, the probes put back, must give ``text``."""
        probes = {i: _PROBE.format(i) for i in marked}
        probed = self._render(
            [{**m, "content": probes[i]} if i in probes else m for i, m in enumerate(messages)],
            add_generation_prompt=True,
        )
        found = sorted((probed.find(p), i) for i, p in probes.items())
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        at = length = 0
        for where, i in found:
            if where < at or probed.count(probes[i]) != 1:
                break
            content = messages[i]["content"]
            pieces += [probed[at:where], content]
            length += where - at
            spans.append((length, length + len(content)))
            length += len(content)
            at = where + len(probes[i])
        if len(spans) != len(marked) or "".join(pieces) + probed[at:] != text:
            raise ChatTemplateError(
                f"{self.tokenizer.chat_template_origin} rewrites a message's content that holds "
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
