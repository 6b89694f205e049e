"""Makes the memorised models that the agent-loop tests drive, into tests/agent/memorised/:
for each chat style (chatml, llama3, qwen3), a tiny model trained with Adam until it reproduces
the style's scripted tool-calling conversations greedily (tests/agent/test_loop.py), its
weights (<style>.npz) and a fingerprint of the sequences it was trained on (<style>.json).

The suite loads these rather than training them in every run (about 4 CPU-minutes). Rerun this
when a chat template, the tokenizer trainer or the scripts change: the tests then fail naming
the style to remake.

    .venv/bin/python scripts/memorised_models.py [chatml|llama3|qwen3 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package holds the scripts and the training

from tests.agent.test_loop import MEMORISED, STYLES, memorise  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("styles", nargs="*", help=f"of {', '.join(STYLES)} (default: all)")
    styles = parser.parse_args().styles or list(STYLES)
    for bad in set(styles) - set(STYLES):
        parser.error(f"unknown style {bad!r}: one of {', '.join(STYLES)}")
    for style in styles:
        with tempfile.TemporaryDirectory() as tmp:
            memorise(style, Path(tmp))
        print(f"{style}: {MEMORISED / style}.npz")


if __name__ == "__main__":
    main()
