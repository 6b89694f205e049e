"""Tokenizers made on this machine: a byte-level BPE trained on a corpus, saved as an HF folder.

Tests and the demo use these instead of downloading one; the folder loads in both `Tokenizer`
and transformers' ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def chat_template(name: str) -> str:
    """A chat template shipped with the package (``templates/<name>.jinja``)."""
    files = resources.files("jax_agent_rl.tokenization") / "templates"
    file = files / f"{name}.jinja"
    if not file.is_file():
        names = sorted(p.name.removesuffix(".jinja") for p in files.iterdir())
        raise KeyError(f"no chat template {name!r}; shipped: {names}")
    return file.read_text()


def train_bpe(
    corpus: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = CHATML_SPECIAL_TOKENS,
    added_tokens: Sequence[str] = TOOL_TOKENS,
    *,
    digit_groups: int | None = None,
    merge_across_words: bool = False,
) -> HFTokenizer:
    """A byte-level BPE (GPT-2 / Qwen style: any text encodes, decode(encode(x)) == x).

    ``digit_groups`` splits every run of digits into groups of at most that many digits
    before BPE (1: each digit apart, as Qwen does; 3: Llama 3's rule), so numbers always
    split the same way; with 3 and a corpus holding 0..999, each group is one token.
    ``merge_across_words`` lets merges span spaces and punctuation, so text repeated verbatim
    in a corpus (a system prompt, JSON scaffolding of tool calls) becomes a few long tokens.
    """
    tok = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not merge_across_words)
    if digit_groups is None:
        tok.pre_tokenizer = byte_level
    else:
        digits = pre_tokenizers.Split(Regex(rf"\d{{1,{digit_groups}}}"), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(list(added_tokens))
    return tok


def save_tokenizer(
    path: str | Path,
    backend: HFTokenizer,
    chat_template: str | None,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
) -> Path:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (template inline) to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": pad_token,
        "bos_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
