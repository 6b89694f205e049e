"""Full-sequence forward throughput: the JAX decoder against transformers on the same checkpoint.

The forward over whole sequences is what the learner and logprob recomputation run. Both
sides load the SAME locally written Qwen2-style checkpoint (~40M parameters, hidden 512,
8 layers, vocab 32000), run batch x seq tokens, fp32 and bf16 (transformers with bf16 weights).
The same run measures the machine's matmul peak per dtype, so each figure comes with its
model-FLOPs utilisation. Ends with one JSON line.

    .venv/bin/python bench/forward.py [--batch 8] [--seq 512] [--repeats 3] [--smoke]

``--smoke``: the smallest run that goes through every part (the tiny model, 1 x 16 tokens,
one repeat, 256^3 matmuls): it checks the bench works, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jax_agent_rl.models import Packed, forward, lm_logits, load_hf
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (compilation for JAX)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_peak(dtype: jnp.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a jitted n x n x n matmul in ``dtype`` (fp32 accumulation)."""
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    seconds = _best_seconds(lambda: mm(a, a).block_until_ready(), repeats)
    return 2 * n**3 / seconds


def measure(
    ckpt: Path, dtype: str, tokens: np.ndarray, repeats: int, matmul_n: int = 2048
) -> dict[str, float]:
    """tokens/s and MFU of both implementations in one dtype, plus that dtype's matmul peak."""
    cfg, w = load_hf(ckpt, dtype=dtype, sharder=one_device_sharder())  # type: ignore[arg-type]
    flops = 2 * cfg.num_params * tokens.size  # matmul FLOPs, attention excluded
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    segments = jnp.ones(tokens.shape, jnp.int32)
    run = jax.jit(
        lambda w, t: lm_logits(
            w, forward(w, cfg, Packed(t, positions, segments), sharder=one_device_sharder()).hidden
        )
    )
    toks = jnp.asarray(tokens)
    jax_s = _best_seconds(lambda: run(w, toks).block_until_ready(), repeats)

    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch_dtype).eval()
    ids = torch.tensor(tokens)

    def torch_forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    torch_s = _best_seconds(torch_forward, repeats)
    peak = matmul_peak(cfg.jnp_dtype, matmul_n)
    return {
        f"jax_{dtype}_tok_s": tokens.size / jax_s,
        f"torch_{dtype}_tok_s": tokens.size / torch_s,
        f"jax_{dtype}_mfu": flops / jax_s / peak,
        f"torch_{dtype}_mfu": flops / torch_s / peak,
        f"matmul_peak_{dtype}_tflops": peak / 1e12,
        f"ratio_{dtype}": torch_s / jax_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    model, matmul_n = SMALL_QWEN2, 2048
    if args.smoke:
        args.batch, args.seq, args.repeats, model, matmul_n = 1, 16, 1, TINY_QWEN2, 256
    transformers.utils.logging.disable_progress_bar()

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_hf_checkpoint(Path(tmp) / "model", model)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, model["vocab_size"], (args.batch, args.seq))
        for dtype in ("float32", "bfloat16"):
            results.update(measure(ckpt, dtype, tokens, args.repeats, matmul_n))
    best_jax = max(results["jax_float32_tok_s"], results["jax_bfloat16_tok_s"])
    best_torch = max(results["torch_float32_tok_s"], results["torch_bfloat16_tok_s"])
    out: dict[str, object] = {"bench": "forward", "batch": args.batch, "seq": args.seq}
    out.update({k: round(v, 4) for k, v in results.items()})
    out["ratio_best"] = round(best_jax / best_torch, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
