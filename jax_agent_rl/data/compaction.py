"""The compaction example's task: three-call chains ``a * b + c + d`` whose episodes outgrow the
context unless the agent compacts it (docs/agents.md, "Does compaction learn?").

An episode calls the calculator three times (the product, then two sums on the running total)
and answers. Written out, it is longer than the example's ``engine.max_model_len``; with
``agent.context.compact`` set, the loop asks for a summary after the second call and the episode
goes on from the question and that summary (`jax_agent_rl.agent.loop.compact`). The last call
needs the running total, so only a summary that carries it can lead to the answer.

`conversations` writes an *imperfect* demonstrator: its summary keeps the running total ("The
total so far is t.") only part of the time; otherwise it says what it did without the number,
and after such a summary it guesses the answer from memory (right ``mental_accuracy`` of the
time, as the arithmetic task's sums from memory: `jax_agent_rl.data.arithmetic`). Supervised
fine-tuning on these gives a model that writes the vague summary as often; reinforcement
learning on outcomes, through the summary turn (a trained sample of the episode), has to find
that a summary which keeps the total pays.
"""

from __future__ import annotations

import dataclasses
import random

from jax_agent_rl.data.arithmetic import (
    SOURCE_PREFIX,
    SYSTEM_PROMPT,
    answer_text,
    evaluate,
    slip,
    tool_call_text,
)
from jax_agent_rl.data.sample import Sample

# the example's agent.context.compact_prompt and summary_prefix (short: each token of the
# request and of the summary is context the summary turn must fit in)
SUMMARY_ASK = "Summarise your work."
SUMMARY_PREFIX = "Summary: "
VAGUE_SUMMARY = "I used the calculator twice."

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class CompactionTask:
    """The problems and the demonstrator's habits."""

    vague_summary: float = 0.5  # the demonstrator's summary drops the running total this often
    mental_accuracy: float = 0.3  # its guesses after such a summary are right this often

    def samples(self, n: int, seed: int, split: str) -> list[Sample]:
        """``n`` prompts in the dataset layout (splits of different names never share a
        seed stream); every number lies in 0..999 (below 550)."""
        rng = random.Random(f"compaction/{split}/{seed}")
        out = []
        for i in range(n):
            a, b, c, d = (
                rng.randint(3, 9),
                rng.randint(11, 39),
                rng.randint(10, 99),
                rng.randint(10, 99),
            )
            product, total = a * b, a * b + c
            out.append(
                Sample(
                    uid=f"{split}-{i}",
                    messages=[
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"What is {a} * {b} + {c} + {d}?"},
                    ],
                    ground_truth=str(total + d),
                    data_source=f"{SOURCE_PREFIX}long_chain",
                    extra={
                        "kind": "long_chain",
                        "steps": [f"{a} * {b}", f"{product} + {c}", f"{total} + {d}"],
                    },
                )
            )
        return out

    def conversations(self, sample: Sample, rng: random.Random) -> list[list[Message]]:
        """The demonstrator's episode of ``sample`` as the samples the loop trains: the
        conversation up to its summary (the first two calls, the request, the summary), then the
        conversation from the question and that summary on."""
        steps = sample.extra["steps"]
        results = [evaluate(e) for e in steps]
        question = [dict(m) for m in sample.messages]
        first = list(question)
        for expression, result in zip(steps[:2], results[:2], strict=True):
            first.append({"role": "assistant", "content": tool_call_text(expression)})
            first.append({"role": "tool", "content": str(result), "name": "calculator"})
        answer = results[2]
        if rng.random() < self.vague_summary:
            summary = VAGUE_SUMMARY
            guess = answer if rng.random() < self.mental_accuracy else slip(answer, rng)
            rest = [{"role": "assistant", "content": answer_text(guess)}]
        else:
            summary = f"The total so far is {results[1]}."
            rest = [
                {"role": "assistant", "content": tool_call_text(steps[2])},
                {"role": "tool", "content": str(answer), "name": "calculator"},
                {"role": "assistant", "content": answer_text(answer)},
            ]
        first += [
            {"role": "user", "content": SUMMARY_ASK},
            {"role": "assistant", "content": summary},
        ]
        second = [*question, {"role": "user", "content": SUMMARY_PREFIX + summary}, *rest]
        return [first, second]
