"""`make demo` until the training demo lands: a checkpoint made here, loaded by the JAX decoder,
checked against transformers, decoded through the KV cache, and exported back.

Every step is real: transformers writes a random-init Qwen2 checkpoint (with a tokenizer trained
here), `load_hf` imports it, the logits are compared with transformers' own forward, greedy
decoding through the KV cache is compared with ``model.generate``, and `save_hf` writes a
checkpoint that transformers loads tensor-for-tensor.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from jax_agent_rl.models import (
    KVCache,
    ModelConfig,
    Weights,
    forward,
    forward_cached,
    init_cache,
    lm_logits,
    load_hf,
    save_hf,
)
from jax_agent_rl.models.hf_local import write_hf_checkpoint
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe

_CORPUS = [
    "What is 17 + 25? Let me use the calculator. The answer is 42.",
    "Compute 6 * 7 and then add 3. First 6 * 7 = 42, then 42 + 3 = 45.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "The tool returned 128. So the final answer is <answer>128</answer>.",
    "You are a helpful assistant. Use tools when arithmetic is needed.",
]


def write_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A random-init Qwen2 (GQA, q/k/v bias, tied embeddings) and a local tokenizer, via HF."""
    tok = train_bpe(_CORPUS * 20, vocab_size=512)
    save_tokenizer(folder, tok, chat_template("chatml_tools"))
    config = dict(
        model_type="qwen2",
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return write_hf_checkpoint(folder, config, seed=seed)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _greedy_step(
    w: Weights, cfg: ModelConfig, tokens: jax.Array, num_new: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    h, cache = forward_cached(w, cfg, tokens, num_new, cache)
    last = jnp.take_along_axis(h, (num_new - 1)[:, None, None], axis=1)
    return jnp.argmax(lm_logits(w, last)[:, 0], axis=-1), cache


def greedy_decode(w: Weights, cfg: ModelConfig, prompt: list[int], n: int) -> list[int]:
    cache = init_cache(cfg, batch=1, max_len=len(prompt) + n)
    token, cache = _greedy_step(w, cfg, jnp.array([prompt]), jnp.array([len(prompt)]), cache)
    out = [int(token[0])]
    for _ in range(n - 1):
        token, cache = _greedy_step(w, cfg, token[:, None], jnp.array([1]), cache)
        out.append(int(token[0]))
    return out


def run(run_dir: Path, console: Console) -> dict[str, float]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    ckpt = run_dir / "checkpoint"
    with console.status("writing a random-init Qwen2 checkpoint with transformers"):
        write_checkpoint(ckpt)
    tok = Tokenizer.from_pretrained(ckpt)
    cfg, w = load_hf(ckpt)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    prompt = tok.encode_chat(messages, add_generation_prompt=True)
    ids = np.array([prompt])
    positions = np.arange(len(prompt))[None]

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    h = forward(w, cfg, jnp.asarray(ids), jnp.asarray(positions), jnp.ones(ids.shape, jnp.int32))
    logits = np.asarray(lm_logits(w, h))
    max_diff = float(np.abs(logits - ref).max())

    n_new = 24
    t0 = time.perf_counter()
    ours = greedy_decode(w, cfg, prompt, n_new)
    decode_s = time.perf_counter() - t0
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor(ids), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new
        )
    theirs = gen[0, len(prompt) :].tolist()

    export = run_dir / "exported"
    save_hf(export, cfg, w)
    back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    src = hf.state_dict()
    identical = all(torch.equal(src[k], back[k]) for k in src) and src.keys() == back.keys()

    table = Table(title="JAX decoder vs transformers on a locally written Qwen2 checkpoint")
    table.add_column("check")
    table.add_column("result")
    table.add_row("parameters", f"{cfg.num_params:,}")
    table.add_row("prompt tokens", str(len(prompt)))
    table.add_row("max |logit diff| (fp32)", f"{max_diff:.2e}  (bound 1e-4)")
    table.add_row("greedy tokens equal", f"{ours == theirs}  ({n_new} tokens)")
    table.add_row("export -> transformers load", "identical tensors" if identical else "MISMATCH")
    table.add_row("KV-cache decode (incl. compile)", f"{decode_s:.2f} s")
    console.print(table)
    console.print(f"[bold]sampled continuation:[/bold] {tok.decode(ours)!r}")
    console.print(f"run folder: {run_dir}  (checkpoint/, exported/)")
    ok = max_diff <= 1e-4 and ours == theirs and identical
    if not ok:
        raise SystemExit("demo: the JAX decoder disagrees with transformers (see the table)")
    return {"max_logit_diff": max_diff, "greedy_equal": float(ours == theirs)}
