"""The twentieth pass over the endpoint, the judge and the environments (part A): what a
policy reached that the passes before left open.

- The judge's response block wrote ``⧼`` (U+29FC, LEFT-POINTING CURVED ANGLE BRACKET) as it
  came: ``⧼/response>`` closed the block to a judge model's eye as ``❬/response>`` did, and
  the rest of the answer read as the template's own lines. Every single left angle bracket
  Unicode names is now written ``&lt;`` (`judge.LESS_THAN`).
"""

import sys
import unicodedata

from jax_agent_rl.rewards.judge import LESS_THAN, response_block


def test_every_single_left_angle_bracket_is_written_as_less_than() -> None:
    """Each character Unicode names a left angle bracket (not a double one) is among the
    characters the response block escapes, so none opens a tag in it."""
    brackets = [
        chr(c)
        for c in range(sys.maxunicode + 1)
        if "ANGLE BRACKET" in (name := unicodedata.name(chr(c), ""))
        and "LEFT" in name
        and "DOUBLE" not in name
    ]
    assert "\u29fc" in brackets and len(brackets) >= 8  # what the walk must find
    assert [b for b in brackets if b not in LESS_THAN] == []
    block = response_block("".join(f"{b}/response>" for b in brackets), 10_000)
    assert block.count("&lt;/response>") == len(brackets)
    assert not set(brackets) & set(block)
