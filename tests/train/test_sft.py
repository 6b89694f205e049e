"""Supervised warm starts from demonstration files (`train.sft`): multi-turn conversations whose
assistant turns are answered by tools, by users (an environment's or an interaction's reply)
or both become the token sequence a rollout would record, the assistant turns the only tokens
trained."""

import json
from pathlib import Path

import pytest

from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.train.sft import load_demonstrations

CONVERSATION = [
    {"role": "system", "content": "Guess the number between 1 and 10."},
    {"role": "user", "content": "Your first guess?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Higher."},  # an environment's reply
    {"role": "assistant", "content": "8"},
    {"role": "tool", "content": "hint: even", "name": "hint"},
    {"role": "user", "content": "Lower."},  # a tool's answer and a user's, one turn
    {"role": "assistant", "content": "6"},
]


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> TurnBuilder:
    texts = [m["content"] for m in CONVERSATION] * 8
    backend = train_bpe(texts, 400, CHATML_SPECIAL_TOKENS)
    folder = save_tokenizer(tmp_path_factory.mktemp("tok"), backend, chat_template("chatml_tools"))
    return TurnBuilder(Tokenizer.from_pretrained(Path(folder)), None)


def test_a_multi_turn_demonstration_is_the_rendered_conversation(
    builder: TurnBuilder, tmp_path: Path
) -> None:
    """User and tool messages after the first assistant turn (refused before: "unexpected
    'user' message after the first assistant turn"): the trajectory's tokens are the chat
    template's rendering of the whole conversation, token for token, and its trained tokens
    (mask 1) are exactly each assistant turn's text and end-of-turn token."""
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    [traj] = load_demonstrations(path, builder)
    tok = builder.tokenizer
    rendered = tok.encode(tok.render_chat(CONVERSATION))
    tokens = traj.prompt_ids + traj.response_ids
    assert tokens == rendered[: len(tokens)]
    assert tok.decode(rendered[len(tokens) :]).strip() == ""  # the template's closing newline
    trained = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    eos = builder.eos_id
    turns = [[*tok.encode(m["content"]), eos] for m in CONVERSATION if m["role"] == "assistant"]
    assert trained == [t for turn in turns for t in turn]
    assert (traj.num_turns, traj.tool_calls) == (3, 1)
    assert [m["role"] for m in traj.messages] == [m["role"] for m in CONVERSATION]


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        (
            [*CONVERSATION[:3], {"role": "system", "content": "new rules"}],
            "unexpected 'system' message after the first assistant turn (an assistant turn is "
            "answered by tool or user messages)",
        ),
        (CONVERSATION[:2], "a demonstration needs at least one assistant message"),
    ],
)
def test_what_cannot_answer_a_turn_is_named(
    builder: TurnBuilder, tmp_path: Path, messages: list, problem: str
) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError) as refused:
        load_demonstrations(path, builder)
    assert str(refused.value) == f"{path}: line 1: not a demonstration ({problem})"
