"""Tokenizers and chat templates from local HF folders, locally trained tokenizers, and the
tool-call parsers that read model text."""

from jax_agent_rl.tokenization.local import (
    CHATML_SPECIAL_TOKENS,
    TOOL_TOKENS,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tokenizer import ChatTemplateError, Message, Tokenizer
from jax_agent_rl.tokenization.tool_calls import (
    PARSERS,
    ParsedCall,
    ToolCallParser,
    make_parser,
    register_parser,
)

__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "PARSERS",
    "TOOL_TOKENS",
    "ChatTemplateError",
    "Message",
    "ParsedCall",
    "Tokenizer",
    "ToolCallParser",
    "chat_template",
    "make_parser",
    "register_parser",
    "save_tokenizer",
    "train_bpe",
]
