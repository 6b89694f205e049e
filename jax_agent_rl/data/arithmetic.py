"""A synthetic multi-step arithmetic task that a small model can only solve with a calculator.

Three kinds of problems, drawn with fixed shares (`ArithmeticTask.mix`); every number in a
problem, its intermediate results and its answer lies in 0..999 (in fact below 450):

- ``add``: ``a + b`` with two-digit operands (one calculator call);
- ``mul``: ``a * b`` with ``a`` in 3..9 and ``b`` in 11..39 (one call);
- ``chain``: ``a * b + c`` (two chained calls: the product, then the sum).

The answer goes in ``<answer>...</answer>``. The task's tokenizer writes each number below 1000
as one token (Llama 3's digit grouping, see `train_bpe`), so a model that calls the tool only
has to copy tokens, and every number it copies is common enough in the demonstrations for a
small transformer to learn to copy it in a few hundred steps. Adding or multiplying "in its
head" from a few thousand examples is beyond it. The task has no subtraction on purpose: the
~0.8M-parameter demo model copies an operand reliably but not which of two operators a
question used (with ``a * b - c`` in the mix it wrote ``+`` for the second call every time),
and a demo that fails on that says nothing about tool use.

`demonstration` writes the turns an *imperfect* demonstrator takes: it always uses the tool for
products and chains, but answers most sums from memory (right only ``mental_accuracy`` of the
time). Supervised fine-tuning on these gives a model that skips the tool on sums, and so fails
most of them; reinforcement learning on outcomes has to discover that calling the tool pays.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Literal

from jax_agent_rl.data.sample import Sample

# the rows' data sources: arithmetic/<kind>, scored by the ``math`` reward by design (their
# answers are numbers in <answer> tags): a run on them is not told its reward fell back
SOURCE_PREFIX = "arithmetic/"

Kind = Literal["add", "mul", "chain"]
KINDS: tuple[Kind, ...] = ("add", "mul", "chain")

SYSTEM_PROMPT = "Solve the problem. Use the calculator. Answer as <answer>number</answer>."


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: Kind
    question: str
    steps: tuple[str, ...]  # the calculator expressions, in order (later ones use results)
    answer: int


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Problem mix and the demonstrator's habits."""

    mix: tuple[float, float, float] = (0.4, 0.4, 0.2)  # add, mul, chain
    tool_use_on_add: float = 0.4  # the demonstrator calls the tool on this share of sums
    mental_accuracy: float = 0.3  # its answers from memory are right this often

    def problem(self, rng: random.Random) -> Problem:
        kind = rng.choices(KINDS, weights=self.mix)[0]
        if kind == "add":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            return Problem(kind, f"What is {a} + {b}?", (f"{a} + {b}",), a + b)
        a, b = rng.randint(3, 9), rng.randint(11, 39)
        product = a * b
        if kind == "mul":
            return Problem(kind, f"What is {a} * {b}?", (f"{a} * {b}",), product)
        c = rng.randint(10, 99)
        return Problem(
            kind, f"What is {a} * {b} + {c}?", (f"{a} * {b}", f"{product} + {c}"), product + c
        )

    def samples(self, n: int, seed: int, split: str) -> list[Sample]:
        """``n`` prompts in the dataset layout; splits with different names never share a
        seed stream (held-out problems are drawn independently)."""
        rng = random.Random(f"{split}/{seed}")
        out = []
        for i in range(n):
            p = self.problem(rng)
            out.append(
                Sample(
                    uid=f"{split}-{i}",
                    messages=[
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": p.question},
                    ],
                    ground_truth=str(p.answer),
                    data_source=f"{SOURCE_PREFIX}{p.kind}",
                    extra={"kind": p.kind, "steps": list(p.steps)},
                )
            )
        return out

    def demonstration(
        self, sample: Sample, rng: random.Random
    ) -> list[tuple[str, list[tuple[str, str]]]]:
        """The demonstrator's turns for ``sample``: (assistant text, [(tool, output)])."""
        kind = sample.extra["kind"]
        answer = int(sample.ground_truth)
        if kind == "add" and rng.random() >= self.tool_use_on_add:
            guess = answer if rng.random() < self.mental_accuracy else slip(answer, rng)
            return [(answer_text(guess), [])]
        turns: list[tuple[str, list[tuple[str, str]]]] = []
        results = [evaluate(e) for e in sample.extra["steps"]]
        for expression, result in zip(sample.extra["steps"], results, strict=True):
            turns.append((tool_call_text(expression), [("calculator", str(result))]))
        turns.append((answer_text(answer), []))
        return turns

    def conversations(self, sample: Sample, rng: random.Random) -> list[list[dict[str, str]]]:
        """The demonstrator's episode of ``sample`` as the conversation SFT trains on (one:
        its context only grows)."""
        messages = [dict(m) for m in sample.messages]
        for text, outputs in self.demonstration(sample, rng):
            messages.append({"role": "assistant", "content": text})
            messages += [{"role": "tool", "content": o, "name": name} for name, o in outputs]
        return [messages]


def tool_call_text(expression: str) -> str:
    """A Hermes-style calculator call, exactly as the chat template would write it."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


def answer_text(value: int) -> str:
    return f"<answer>{value}</answer>"


def evaluate(expression: str) -> int:
    a, op, b = expression.split()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def slip(value: int, rng: random.Random) -> int:
    """A plausible mistake: a digit off, or a dropped carry (never negative, never right)."""
    delta = rng.choice([-100, -10, -1, 1, 10, 100]) * rng.randint(1, 3)
    return value + delta if value + delta >= 0 else value - delta


NUMBERS = [str(i) for i in range(1000)]  # every number of the task, for the tokenizer corpus
