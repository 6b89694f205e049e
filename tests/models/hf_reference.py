"""What the parity tests compare against: a batch of rows padded both ways, and transformers'
own logits for it (fp32, eager attention: the reference implementation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers


def padded_batch(vocab: int, T: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three rows: full, right-padded, left-padded; returns tokens, mask, positions."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (3, T))
    mask = np.ones((3, T), np.int64)
    mask[1, 13:] = 0
    mask[2, :6] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return tokens, mask, positions


def hf_forward(
    path: Path, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray, **kwargs: Any
) -> Any:
    """transformers' fp32 forward of the checkpoint ``path`` on the batch (``kwargs``: the
    model call's own, e.g. ``output_router_logits``): its output."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            **kwargs,
        )


def hf_logits(
    path: Path, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    return hf_forward(path, tokens, mask, positions).logits.numpy()
