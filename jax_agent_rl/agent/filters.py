"""Trajectory filters (``agent.filters``): which sampled episodes an update leaves out.

A filter looks at one group (the episodes of one prompt) and names the members it excludes.
`apply_filters` runs the configured filters in order on a group, and returns each excluded
episode marked with the first filter that excluded it (`Episode.filtered_by`): it is then not
trainable, so the update drops it (GRPO's group statistics are taken over the members left),
each step counts it (``filter/<name>``) and its trace shows why.

- ``void_turn`` (SimpleTIR): a model turn that yields neither a complete tool call nor a final
  answer: every call it wrote was malformed (fragmented code), or it ended the episode with
  an end of turn and no answer (``<answer>...</answer>`` or ``\\boxed{...}``).
- ``overlong``: cut short by a length budget (a turn's tokens, the response's, the model's).
- ``tool_error``: its tool service failed (such episodes are never trained on; the filter
  makes them counted and labelled like the others).
- ``repetition``: the model's tokens loop: one n-gram (n <= `REPEAT_MAX_N`) repeated back to
  back over `REPEAT_MIN_SPAN` tokens or more (and at least 3 times).
- ``equal_reward`` (DAPO): every member of the group has the same reward, so GRPO gives it
  no advantage; ``group.dynamic_sampling`` turns it on and refills the step with fresh
  prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.rewards.math import extract_answer

REPEAT_MAX_N = 16  # longest n-gram a loop is looked for with
REPEAT_MIN_SPAN = 32  # tokens a loop must cover
OVERLONG = ("max_tokens_per_turn", "max_response_tokens", "max_model_len")


@dataclasses.dataclass(frozen=True)
class TrajectoryFilter:
    """``excludes(group)`` flags the members of one group to leave out."""

    name: str
    excludes: Callable[[Sequence[Episode]], list[bool]]


def _each(test: Callable[[Episode], bool]) -> Callable[[Sequence[Episode]], list[bool]]:
    return lambda group: [test(e) for e in group]


def has_void_turn(traj: Trajectory) -> bool:
    """A turn with only malformed calls, or a last turn that ended without a call or answer."""
    if "malformed" in traj.turn_kinds:
        return True
    if traj.turn_kinds[-1:] != ["text"]:
        return False
    said = [m for m in traj.messages if m.get("role") == "assistant"]
    return not said or extract_answer(str(said[-1].get("content", ""))) is None


def repeats(tokens: Sequence[int]) -> bool:
    """Whether some n-gram (n <= `REPEAT_MAX_N`) repeats back to back over at least
    max(`REPEAT_MIN_SPAN`, 3n) tokens of ``tokens``."""
    for n in range(1, REPEAT_MAX_N + 1):
        need = max(REPEAT_MIN_SPAN, 3 * n) - n  # positions equal to the one n before
        run = 0
        for i in range(n, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - n] else 0
            if run >= need:
                return True
    return False


def model_segments(traj: Trajectory) -> list[list[int]]:
    """The runs of model-sampled tokens of ``traj`` (its turns, without what came between)."""
    segments: list[list[int]] = []
    previous = 0
    for token, mask in zip(traj.response_ids, traj.loss_mask, strict=True):
        if mask and not previous:
            segments.append([])
        if mask:
            segments[-1].append(token)
        previous = mask
    return segments


def _equal_rewards(group: Sequence[Episode]) -> list[bool]:
    rewards = {e.reward for e in group if e.trainable}
    return [len(rewards) <= 1] * len(group)


FILTERS: dict[str, TrajectoryFilter] = {
    f.name: f
    for f in (
        TrajectoryFilter("void_turn", _each(lambda e: has_void_turn(e.traj))),
        TrajectoryFilter("overlong", _each(lambda e: e.stop_reason in OVERLONG)),
        TrajectoryFilter("tool_error", _each(lambda e: e.stop_reason == "tool_error")),
        TrajectoryFilter("repetition", _each(lambda e: any(map(repeats, model_segments(e.traj))))),
        TrajectoryFilter("equal_reward", _equal_rewards),
    )
}


def check_filters(names: Sequence[str]) -> list[str]:
    """One line per unknown filter name."""
    return [
        f"agent.filters: unknown filter {n!r}; known: {sorted(FILTERS)}"
        for n in names
        if n not in FILTERS
    ]


def apply_filters(group: Sequence[Episode], names: Sequence[str]) -> list[Episode]:
    """``group`` with each member excluded by one of the filters ``names`` (in order) marked
    with the first that excluded it (a member marked already keeps its mark). ``equal_reward``
    looks at the members no earlier filter excluded: list it last."""
    out = list(group)
    for name in names:
        flags = FILTERS[name].excludes(out)
        out = [
            dataclasses.replace(e, filtered_by=name) if excluded and e.filtered_by is None else e
            for e, excluded in zip(out, flags, strict=True)
        ]
    return out
