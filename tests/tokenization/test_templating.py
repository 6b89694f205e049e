"""The bounded template environment renders real chat templates exactly as transformers does,
long conversations included: its bounds count work, they change no output."""

from pathlib import Path

import pytest
import transformers

from jax_agent_rl.tokenization import chat_template, save_tokenizer, train_bpe
from jax_agent_rl.tokenization.templating import render_template
from tests.agent.templates import LLAMA3_STYLE, QWEN3_STYLE
from tests.tokenization.test_tokenizer import CONVERSATION, CORPUS, TOOLS

TEMPLATES = {
    "chatml_tools": chat_template("chatml_tools"),
    "qwen3": QWEN3_STYLE,
    "llama3": LLAMA3_STYLE,
}

# A long agent run: 200 turns, one tool output of a million characters.
LONG = [
    CONVERSATION[0],
    *[
        m
        for i in range(100)
        for m in (
            {"role": "user", "content": f"step {i}: <think>\nplan\n</think>\n\nnext?"},
            {"role": "assistant", "content": f"<think>\nstep {i}\n</think>\n\ndone {i}"},
        )
    ],
    {"role": "tool", "content": "0123456789" * 100_000},
    {"role": "user", "content": "and now?"},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> transformers.PreTrainedTokenizerBase:
    path = save_tokenizer(tmp_path_factory.mktemp("tok"), train_bpe(CORPUS, 600), None)
    return transformers.AutoTokenizer.from_pretrained(Path(path))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("messages", [CONVERSATION[:2], CONVERSATION, LONG], ids=len)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_as_transformers(
    reference: transformers.PreTrainedTokenizerBase,
    name: str,
    messages: list,
    tools: list | None,
    add_generation_prompt: bool,
) -> None:
    template = TEMPLATES[name]
    ours = render_template(
        template,
        messages,
        tools,
        add_generation_prompt,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    theirs = reference.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert ours == theirs
