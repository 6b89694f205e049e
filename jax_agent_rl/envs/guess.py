"""A number-guessing game: a task that needs an environment (a reply after every move), not a
tool. The built-in environment ``guess_number`` (``configs/guess_number_cpu.yaml``).

The model is asked for a secret integer in ``[low, high]``; after each guess (the last integer
of its turn, inside ``<answer>`` tags if it wrote them) the environment answers ``higher`` or
``lower`` as the user, or ends the episode when the guess is right. A turn without a number is
answered "Say one number.". The episode's reward is the environment's (``owns_reward``): 1 for
the secret found, whichever turn found it, so GRPO prefers groups' quicker searches only through
``agent.max_turns`` (a search that runs out of turns earns 0). Rows::

    python -m jax_agent_rl.envs.guess OUT.jsonl --n 200 --seed 0 [--low 1 --high 16]
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from typing import Literal

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvStep
from jax_agent_rl.tokenization import Message
from jax_agent_rl.tokenization.tags import tagged

ENV_CLASS = "guess_number"
_INTEGER = re.compile(r"-?\d+")


def read_guess(text: str) -> int | None:
    """The guess in a model turn: the last integer inside its last ``<answer>`` tags if it has
    any, else the last integer of the turn (None: no number)."""
    answers = tagged(text)
    numbers = _INTEGER.findall(answers[-1] if answers else text)
    try:
        return int(numbers[-1]) if numbers else None
    except ValueError:  # past the 4,300 digits int() reads: no number of a game
        return None


class GuessNumber:
    """One game: its secret is the row's ground truth."""

    turns: Literal["all", "text"] = "all"
    owns_reward = True

    def __init__(self, sample: Sample) -> None:
        self.secret = int(sample.ground_truth)

    async def reset(self, sample: Sample) -> list[Message]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[Message]) -> EnvStep:
        del messages
        guess = read_guess(text)
        if guess == self.secret:
            return EnvStep([], reward=1.0, done=True)
        reply = (
            "Say one number." if guess is None else ("higher" if guess < self.secret else "lower")
        )
        return EnvStep([{"role": "user", "content": reply}], reward=0.0, done=False)

    async def close(self) -> None:
        pass


def samples(n: int, seed: int, low: int = 1, high: int = 16) -> list[Sample]:
    """``n`` games with secrets drawn uniformly from ``[low, high]``."""
    if not low <= high:
        raise ValueError(f"low={low} > high={high}")
    rng = random.Random(f"guess/{seed}")
    prompt = (
        f"I am thinking of a number from {low} to {high}. Guess it: answer with "
        "<answer>N</answer>, and I will say higher or lower."
    )
    return [
        Sample(
            uid=f"{ENV_CLASS}-{i}",
            messages=[{"role": "user", "content": prompt}],
            ground_truth=str(rng.randint(low, high)),
            data_source=ENV_CLASS,
            env_class=ENV_CLASS,
            extra={"index": i},
        )
        for i in range(n)
    ]


def main(argv: Sequence[str] | None = None) -> None:
    from jax_agent_rl.data.datasets import write_jsonl

    parser = argparse.ArgumentParser(description="Write number-guessing rows (verl's layout).")
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--n", type=int, default=200, help="rows")
    parser.add_argument("--seed", type=int, default=0, help="a different seed: other secrets")
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=16)
    args = parser.parse_args(argv)
    path = write_jsonl(args.out, samples(args.n, args.seed, args.low, args.high))
    print(f"{args.n} games in {path}")


if __name__ == "__main__":
    main()
