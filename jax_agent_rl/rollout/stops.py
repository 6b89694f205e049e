"""Stop strings: a model turn ends where its text first holds one of them (SkyRL's
``sampling_params.stop``; vLLM's ``stop`` with ``include_stop_str_in_output``).

A stop string is text, not a token: ``</search>`` is several tokens, and the model may write
it split any way, or as part of a longer token. The cut is token-exact: what is kept is the
shortest prefix of the sampled tokens whose text holds a stop string, so its last token is the
one that completes it (that token's text may run on past the stop string's end, as vLLM's
token ids do), and every later token is dropped with its logprob. `stop_string_end` finds it;
the agent loop cuts every backend's result with it (`jax_agent_rl.agent.loop`), and the
backends given the run's tokenizer end a request early with it: the embedded engine at the
decode call that completes one, the JetStream client at the response that does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

# the most tokens one character takes (a byte-level vocabulary: 4 bytes of UTF-8)
_TOKENS_PER_CHAR = 4


def stop_string_end(
    decode: Decode, tokens: Sequence[int], stops: Sequence[str], new: int
) -> int | None:
    """How many of ``tokens`` to keep: the shortest prefix whose text holds one of ``stops``,
    found among the prefixes that end in the last ``new`` tokens (the earlier ones were looked
    at before and held none); None when none does.

    Only a window is decoded: a stop string that ends in the new tokens starts at most
    ``4 x len(stop)`` tokens before them. The prefixes' texts grow with them (a character
    split over byte tokens decodes whole once its last byte is in), so a binary search over
    them finds the shortest.
    """
    if not stops or new <= 0:
        return None
    n = len(tokens)
    start = max(0, n - new - _TOKENS_PER_CHAR * max(len(s) for s in stops))

    def holds(k: int) -> bool:
        text = decode(tokens[start:k])
        return any(s in text for s in stops)

    lo, hi = n - new + 1, n
    if not holds(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
