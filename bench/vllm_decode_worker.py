"""vLLM's side of bench/decode.py; runs under .venv-vllm (vLLM's own stack, its own process).

    .venv-vllm/bin/python bench/vllm_decode_worker.py CKPT DTYPE BATCHES PROMPT NEW

Prints one JSON line: {"dtype": ..., "tok_s": {batch: tokens per second}}. Same workload as the
JAX side: random prompts, temperature 1, EOS ignored, sampled-token logprobs returned.
"""

import json
import sys
import time


def main() -> None:
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ckpt, dtype, batches, prompt_len, new = sys.argv[1:6]
    batch_sizes = [int(b) for b in batches.split(",")]
    llm = LLM(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        max_model_len=int(prompt_len) + int(new),
        max_num_seqs=max(batch_sizes),
        seed=0,
    )
    params = SamplingParams(
        max_tokens=int(new), temperature=1.0, ignore_eos=True, logprobs=0, detokenize=False
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(0)
    tok_s = {}
    for b in batch_sizes:
        prompts = [
            TokensPrompt(prompt_token_ids=[int(t) for t in rng.integers(0, vocab, int(prompt_len))])
            for _ in range(b)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tok_s[b] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    print(json.dumps({"dtype": dtype, "tok_s": tok_s}), flush=True)


if __name__ == "__main__":
    main()
