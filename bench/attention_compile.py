"""TPU compile time of the RL update's model: value_and_grad of a token-mean logprob loss of
`forward` (remat) for Qwen2.5-1.5B's shape, compiled for a TPU topology on this CPU host.

The model is Qwen2.5-1.5B's architecture (28 layers, hidden 1536, 12 heads, 2 kv heads, head
dim 128, MLP 8960, vocab 151936, q/k/v bias, tied embeddings) with abstract bfloat16 weights
sharded over a mesh of the topology's devices (``fsdp`` = their count); no checkpoint is read.
The batch is ``--rows`` rows of ``--tokens`` tokens per device, sequences packed in rows
(segment ids), ``--window`` bounding the sequences' lengths (0: the row's). The loss is the
mean over tokens of each target's logprob (`head_logprobs`, the learner's chunked head).
Nothing runs: the program is lowered and compiled for the chip, and the figures read from
it. Ends with one JSON line: lower and compile seconds (wall; and the compile's CPU seconds,
steadier on a shared host), `memory_analysis` bytes per chip.

    JAX_PLATFORMS=cpu .venv/bin/python bench/attention_compile.py [--topology v5e:2x2]
        [--tokens 8192] [--rows 1] [--window 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from jax_agent_rl.engine.sampling import head_logprobs
from jax_agent_rl.models import ModelConfig, Sharder, abstract_params, forward, make_mesh

QWEN25_1_5B = ModelConfig(
    family="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=131072,
    dtype="bfloat16",
)


def _cpu_seconds() -> float:
    """CPU seconds this process has used (user + system, all threads): on a shared host a
    steadier measure of the compiler's work than wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per row")
    parser.add_argument("--rows", type=int, default=1, help="rows per device")
    parser.add_argument("--window", type=int, default=0, help="longest sequence (0: the row)")
    args = parser.parse_args()

    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = make_mesh(fsdp=len(devices), devices=devices)
    sharder = Sharder(mesh)
    cfg = QWEN25_1_5B
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding),
        abstract_params(cfg, sharder),
    )
    B, T = args.rows * len(devices), args.tokens
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    batch = [jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows) for _ in range(4)]
    window = args.window or None

    def loss(w, tokens, positions, segment_ids, targets):  # type: ignore[no-untyped-def]
        h = forward(w, cfg, tokens, positions, segment_ids, sharder, remat=True, window=window)
        head = w.embed if w.lm_head is None else w.lm_head.T
        logp, _ = head_logprobs(h.reshape(B * T, -1), head, targets.reshape(B * T), 1.0)
        return -jnp.mean(logp)

    t0 = time.perf_counter()
    # the gradients sharded like the weights, as an optimizer update reads them
    shardings = (NamedSharding(mesh, PartitionSpec()), jax.tree.map(lambda x: x.sharding, params))
    step = jax.jit(jax.value_and_grad(loss), out_shardings=shardings)
    lowered = step.lower(params, *batch)
    t1, cpu1 = time.perf_counter(), _cpu_seconds()
    compiled = lowered.compile()
    t2, cpu2 = time.perf_counter(), _cpu_seconds()
    mem = compiled.memory_analysis()
    figures = {
        "topology": args.topology,
        "tokens_per_row": T,
        "rows_per_device": args.rows,
        "window": args.window,
        "lower_s": round(t1 - t0, 1),
        "compile_s": round(t2 - t1, 1),
        "compile_cpu_s": round(cpu2 - cpu1, 1),
        "hlo_chars": len(compiled.as_text()),
        **{
            name: getattr(mem, f"{name}_size_in_bytes")
            for name in ("argument", "output", "temp", "alias", "generated_code")
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
