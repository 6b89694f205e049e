"""Tokenizers trained here, rendered and encoded exactly as transformers does."""

from pathlib import Path

import pytest
import transformers

from jax_agent_rl.tokenization import (
    ChatTemplateError,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)

CORPUS = [
    "What is 12 + 30? The calculator says 42, so the answer is <answer>42</answer>.\n",
    "def square(x):\n    return x * x\n\nprint(square(7))  # 49\n",
    "Zürich, naïve café — unicode must survive byte-level BPE. 日本語も。\n",
] * 30

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Answer in <answer></answer> tags."},
    {"role": "user", "content": "What is (3 + 4) * 6?"},
    {
        "role": "assistant",
        "content": "First the sum.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}},
            },
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "7 * 6"}},
            },
        ],
    },
    {"role": "tool", "content": "7"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<answer>42</answer>"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    return save_tokenizer(path, train_bpe(CORPUS, vocab_size=600), chat_template("chatml_tools"))


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("cut", [2, 3, 5, 6])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_matches_transformers(
    folder: Path, tools: list | None, cut: int, add_generation_prompt: bool
) -> None:
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATION[:cut]
    text = ours.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
    ref_text = theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == ref_text
    ref_ids = theirs.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ours.encode_chat(messages, tools, add_generation_prompt) == list(ref_ids)


def test_special_tokens_are_single_ids(folder: Path) -> None:
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<tool_call>")
    assert ids[0] == tok.token_id("<|im_start|>")
    assert tok.token_id("<|im_end|>") in ids
    assert ids[-1] == tok.token_id("<tool_call>")
    assert tok.eos_token_id == tok.token_id("<|im_end|>")
    assert tok.pad_token_id == tok.token_id("<|endoftext|>")


@pytest.mark.parametrize("text", [*CORPUS[:3], "", " leading space", "tabs\tand\nnewlines\n\n"])
def test_decode_inverts_encode(folder: Path, text: str) -> None:
    tok = Tokenizer.from_pretrained(folder)
    assert tok.decode(tok.encode(text)) == text


def test_template_errors_are_clear(folder: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(folder)
    with pytest.raises(ChatTemplateError, match="system message may only come first"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    bare = Tokenizer.from_pretrained(save_tokenizer(tmp_path / "bare", tok.backend, None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.render_chat(CONVERSATION)
    with pytest.raises(KeyError, match="no chat template 'nope'"):
        chat_template("nope")
    with pytest.raises(KeyError, match="not in the vocabulary"):
        tok.token_id("<|not-a-token|>")


def test_chat_template_jinja_file_takes_precedence(folder: Path, tmp_path: Path) -> None:
    """transformers 5 saves the template to chat_template.jinja beside the config."""
    tok = Tokenizer.from_pretrained(folder)
    path = save_tokenizer(tmp_path / "t", tok.backend, "ignored")
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    assert Tokenizer.from_pretrained(path).render_chat([{"role": "user", "content": "x"}]) == "[x]"
