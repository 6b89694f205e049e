"""Trajectory filters (``agent.filters``) on hand-built trajectories: what each leaves out, that
the first filter to exclude a trajectory names it, that an excluded trajectory is not trained
on, and that steps count them and traces show them. (How the agent loop labels its turns, on
the real engine: tests/agent/test_loop.py.)"""

import re

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.filters import (
    FILTERS,
    REPEAT_MIN_SPAN,
    apply_filters,
    has_void_turn,
    model_segments,
    repeats,
)
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import load_config
from jax_agent_rl.train.check import check_names
from jax_agent_rl.train.episodes import episode_metrics, episode_totals


def _traj(
    kinds: list[str],
    last_text: str = "",
    stop: str = "eos",
    turns: list[list[int]] | None = None,
) -> Trajectory:
    t = Trajectory(uid="u", group_id="g", prompt_ids=[1], stop_reason=stop)  # type: ignore[arg-type]
    t.turn_kinds = list(kinds)  # type: ignore[arg-type]
    t.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": last_text}]
    for ids in turns or [[5, 6]]:
        t.append(ids, model=True, logprobs=[0.0] * len(ids), version=0)
        t.append([9], model=False)  # a tool observation between turns
    return t


def _ep(
    kinds: list[str],
    last_text: str = "",
    stop: str = "eos",
    reward: float = 0.0,
    turns: list[list[int]] | None = None,
) -> Episode:
    return Episode(_traj(kinds, last_text, stop, turns), reward=reward)


def test_void_turn_is_a_turn_with_neither_a_call_nor_an_answer() -> None:
    assert not has_void_turn(_traj(["call", "text"], "so <answer>42</answer>"))
    assert not has_void_turn(_traj(["text"], r"it is \boxed{7}"))
    assert has_void_turn(_traj(["call", "text"], "I think I am done."))  # premature end of turn
    assert has_void_turn(_traj(["malformed", "text"], "<answer>0</answer>"))  # fragmented call
    assert not has_void_turn(_traj(["call", "call"], ""))  # still calling
    assert not has_void_turn(_traj(["call", "cut"], "no answer yet"))  # a budget: overlong's
    assert not has_void_turn(_traj(["aborted"], ""))


def test_repetition_needs_a_loop_over_the_span() -> None:
    assert repeats([7] * REPEAT_MIN_SPAN)
    assert not repeats([7] * (REPEAT_MIN_SPAN - 1))
    phrase = list(range(10, 18))  # an 8-gram, 4 times back to back: 32 tokens
    assert repeats([1, 2, *phrase * 4, 3])
    assert not repeats([*phrase * 3, *phrase[:7]])  # 31 tokens
    long = list(range(100, 116))  # a 16-gram needs 3 repeats (48 tokens)
    assert repeats(long * 3) and not repeats(long * 2 + long[:15])
    assert not repeats(list(range(200)))


def test_a_loop_across_a_tool_observation_is_not_the_models() -> None:
    """Each model turn is looked at alone: 20 + 20 looping tokens on either side of a tool
    result are two short loops, not one of 40."""
    split = _traj(["call", "text"], turns=[[7] * 20, [7] * 20])
    assert model_segments(split) == [[7] * 20, [7] * 20]
    assert FILTERS["repetition"].excludes([Episode(split)]) == [False]
    assert FILTERS["repetition"].excludes([_ep(["text"], turns=[[7] * 40])]) == [True]


def test_overlong_and_tool_error() -> None:
    group = [
        _ep(["cut"], stop="max_tokens_per_turn"),
        _ep(["call"], stop="max_response_tokens"),
        _ep(["call"], stop="max_model_len"),
        _ep(["call"], stop="tool_error"),
        _ep(["text"], "<answer>1</answer>"),
    ]
    assert FILTERS["overlong"].excludes(group) == [True, True, True, False, False]
    assert FILTERS["tool_error"].excludes(group) == [False, False, False, True, False]


def test_equal_reward_looks_at_the_members_left() -> None:
    same = [_ep(["text"], reward=1.0), _ep(["text"], reward=1.0)]
    assert FILTERS["equal_reward"].excludes(same) == [True, True]
    mixed = [_ep(["text"], reward=1.0), _ep(["text"], reward=0.0)]
    assert FILTERS["equal_reward"].excludes(mixed) == [False, False]
    # the one with another reward was left out by an earlier filter: no signal is left
    mixed[1].traj.stop_reason = "max_model_len"
    mixed = apply_filters(mixed, ["overlong", "equal_reward"])
    assert [t.filtered_by for t in mixed] == ["equal_reward", "overlong"]


def test_the_first_filter_names_it_and_it_is_not_trained_on() -> None:
    looping_and_long = _ep(["cut"], stop="max_response_tokens", turns=[[4] * 40])
    fine = _ep(["call", "text"], "<answer>3</answer>", reward=1.0)
    void = _ep(["call", "text"], "hmm")
    group = apply_filters([looping_and_long, fine, void], ["repetition", "overlong", "void_turn"])
    assert [t.filtered_by for t in group] == ["repetition", None, "void_turn"]
    assert [t.trainable for t in group] == [False, True, False]
    totals = episode_totals(group)
    assert totals["filter/repetition"] == totals["filter/void_turn"] == 1
    assert totals["filter/overlong"] == 0  # counted once, under the first filter
    assert totals["untrainable"] == 2
    assert episode_metrics(group)["filter/void_turn"] == pytest.approx(1 / 3)


def test_unknown_filters_are_named() -> None:
    cfg = load_config(None, ["model.path=m", "data.train=t", "agent.filters=[void_turn,loops]"])
    (problem,) = check_names(cfg)  # names are checked against the registry before a run
    assert re.search("unknown filter 'loops'", problem)
    cfg = load_config(None, ["model.path=m", "data.train=t", "agent.filters=[void_turn]"])
    assert cfg.agent.filters == ["void_turn"]
