"""Tokenizers and chat templates from local HF folders, and locally trained tokenizers."""

from jax_agent_rl.tokenization.local import (
    CHATML_SPECIAL_TOKENS,
    TOOL_TOKENS,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tokenizer import ChatTemplateError, Message, Tokenizer

__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "ChatTemplateError",
    "Message",
    "Tokenizer",
    "chat_template",
    "save_tokenizer",
    "train_bpe",
]
