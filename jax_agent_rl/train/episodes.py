"""Statistics of a set of episodes, as totals that add up over processes.

A step's or an evaluation's episodes are spread over the run's processes. Each process sums
its own (`episode_totals`, `source_totals`: counts and sums, maxima under ``*/max`` keys), the
processes exchange only these few numbers (`add_totals`), and the means are taken once
(`metrics_of_totals`, `success_of_sources`). One process: the same functions over all of them.
A step's episodes come in groups (one prompt's), consecutive (`split_groups`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.filters import FILTERS
from jax_agent_rl.agent.trajectory import STOP_REASONS
from jax_agent_rl.console.visible import visible
from jax_agent_rl.data.sample import Sample

Totals = dict[str, float]


def episode_totals(episodes: Sequence[Episode]) -> Totals:
    """Sums over the episodes of what `metrics_of_totals` reports."""
    stops: Counter[str] = Counter(e.stop_reason for e in episodes)
    trajs = [e.traj for e in episodes]
    lengths = [len(t.response_ids) for t in trajs]
    out: Totals = {
        "episodes": len(trajs),
        "reward": sum(e.reward for e in episodes),
        "success": sum(e.success for e in episodes),
        "turns": sum(t.num_turns for t in trajs),
        "tool_calls": sum(t.tool_calls for t in trajs),
        "malformed_calls": sum(t.malformed_calls for t in trajs),
        "refused_calls": sum(t.refused_calls for t in trajs),
        "tool_errors": sum(t.tool_errors for t in trajs),
        "cut_observations": sum(t.cut_observations for t in trajs),
        "response_len": sum(lengths),
        "response_len/max": max(lengths, default=0),
        "model_tokens": sum(t.num_model_tokens for t in trajs),
        # what was sampled and called (a tree's branches share their prefix's)
        "own_model_tokens": sum(t.own_model_tokens for t in trajs),
        "own_tool_calls": sum(t.own_tool_calls for t in trajs),
        "untrainable": sum(not e.trainable for e in episodes),
        "answer_faults": sum(e.answer_fault is not None for e in episodes),
        "reruns": sum(e.reruns for e in episodes),
        "tools_s": sum(t.timings.get("tools_s", 0.0) for t in trajs),
    }
    out.update({f"stop/{r}": stops.get(r, 0) for r in STOP_REASONS})
    filtered: Counter[str | None] = Counter(e.filtered_by for e in episodes)
    out.update({f"filter/{f}": filtered.get(f, 0) for f in FILTERS})
    return out


def add_totals(parts: Iterable[Mapping[str, float]]) -> Totals:
    """The totals of several sets of episodes: sums, and maxima for ``*/max`` keys."""
    out: Totals = {}
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, v), v) if k.endswith("/max") else out.get(k, 0) + v
    return out


def metrics_of_totals(t: Mapping[str, float], prefix: str = "") -> dict[str, float]:
    """Outcome and behaviour statistics: per-episode means, rates per tool call."""
    n, calls = max(t["episodes"], 1), max(t["tool_calls"], 1)
    out = {
        "reward": t["reward"] / n,
        "success": t["success"] / n,
        "turns": t["turns"] / n,
        "tool_calls": t["tool_calls"] / n,
        "malformed_call_rate": t["malformed_calls"] / calls,
        "refused_call_rate": t["refused_calls"] / calls,  # past agent.max_tool_calls_per_turn
        "tool_error_rate": t["tool_errors"] / calls,
        "cut_observations": t["cut_observations"] / n,  # past agent.max_observation_chars
        "response_len/mean": t["response_len"] / n,
        "response_len/max": float(t["response_len/max"]),
        "model_tokens/mean": t["model_tokens"] / n,
        "untrainable": t["untrainable"] / n,
        # answers the reward failed on (and not on the row's own): scored 0, trained on
        "rewards/answer_faults": t["answer_faults"] / n,
        "rollout/trajectories_rerun": float(t["reruns"]),  # a count, not a rate
        # counts: episodes (a tree's leaves), model tokens sampled and tool calls made
        "rollout/episodes": t["episodes"],
        "rollout/model_tokens": t["own_model_tokens"],
        "rollout/tool_calls": t["own_tool_calls"],
    }
    out.update({f"stop/{r}": t[f"stop/{r}"] / n for r in STOP_REASONS})
    out.update({f"filter/{f}": t[f"filter/{f}"] / n for f in FILTERS})  # shares left out
    return {prefix + k: float(v) for k, v in out.items()}


def episode_metrics(trajs: Sequence[Episode], prefix: str = "") -> dict[str, float]:
    """`metrics_of_totals` of one set of episodes."""
    return metrics_of_totals(episode_totals(trajs), prefix)


# how an episode ends when something broke (its outcome says nothing of the policy), and the
# budgets that cut it short: a step ending mostly in either is said so (`stop_warning`)
ERRORS = ("agent_error", "env_error", "harness_error", "tool_error", "reward_error")
LIMITS = ("max_model_len", "max_response_tokens", "max_tokens_per_turn", "max_turns", "budget")


class RolloutFailedError(RuntimeError):
    """Every episode of a rollout failed (`all_failed_error`): its first line is the stop
    reason's warning, its second the first error's own first line (what failed, where, on
    which row); the rest that error's traceback."""


def all_failed_error(t: Mapping[str, float], first_error: str | None) -> RolloutFailedError | None:
    """One episode's error ends that episode only (`ERRORS`); when every episode of a rollout
    ended so, the backend, the tools, the environments, the reward or the loop is broken, not
    the policy: the error to raise (its `stop_warning` line, then the first error, `visible`:
    it may quote the policy's text) rather than train on nothing, step after step."""
    # (and the episodes whose environment or harness failed on the policy's text, trained on:
    # every episode so is a broken environment or harness, far likelier than such a policy)
    failed = sum(t[f"stop/{r}"] for r in (*ERRORS, "caused_error"))
    if t["episodes"] and failed == t["episodes"]:
        line = stop_warning(metrics_of_totals(t), ()) or ""
        return RolloutFailedError(
            f"all {int(t['episodes'])} trajectories of the rollout failed ({line}); the first "
            f"error:\n{visible(str(first_error))}"
        )
    return None


def stop_warning(m: Mapping[str, float], trajs: Sequence[Episode]) -> str | None:
    """The warning for a step (or an evaluation) whose episodes mostly ended in an error or a
    budget (`ERRORS`, `LIMITS`; ``m``: their metrics, ``stop/<reason>`` shares): the commonest
    such stop reason, its share, and for an error one episode's of ``trajs`` (its last line,
    which names what failed; a reward's error its first, naming data.reward, the function
    and the row; `visible`: an environment's or a reward's error may quote the
    policy's text, escape sequences included, and this line goes to the console); None when
    most ended otherwise."""
    shares = {r: m[f"stop/{r}"] for r in (*ERRORS, *LIMITS)}
    if sum(shares.values()) <= 0.5:
        return answer_fault_warning(m, trajs)
    worst = max(shares, key=lambda r: shares[r])
    line = f"WARNING: {shares[worst]:.0%} of episodes ended {worst}"
    example = first_error(trajs, worst) if worst in ERRORS else None
    if example:
        lines = [x.strip() for x in example.splitlines() if x.strip()]
        # a reward's error leads with what raised, where and on which row (train/rollout_score.py)
        shown = lines[0] if worst == "reward_error" else lines[-1]
        line += f" (e.g. {visible(shown[:300])})"
    return line


def answer_fault_warning(m: Mapping[str, float], trajs: Sequence[Episode]) -> str | None:
    """The warning for a step whose episodes' text mostly made the reward fail
    (``rewards/answer_faults``, `rewards.AnswerFaultError`) or the environment or the harness
    (``stop/caused_error``), scored 0 as wrong answers: a reward, environment or harness that
    fails on every text of some form the policy writes is worth a look. None when most did
    not."""
    share = m["rewards/answer_faults"] + m["stop/caused_error"]
    if share <= 0.5:
        return None
    caused = (t.error for t in trajs if t.stop_reason == "caused_error" and t.error)
    example = next((t.answer_fault for t in trajs if t.answer_fault), None) or next(caused, None)
    if example:
        example = [x.strip() for x in example.splitlines() if x.strip()][-1]
    line = f"WARNING: the policy's text made {share:.0%} of episodes fail (scored 0, trained on)"
    return line + (f" (e.g. {visible(example[:300])})" if example else "")


def first_error(trajs: Sequence[Episode], stop: str | None = None) -> str | None:
    """The error of the first episode that ended in one (of stop reason ``stop`` if given)."""
    reasons = ERRORS if stop is None else (stop,)
    return next((t.error for t in trajs if t.stop_reason in reasons and t.error), None)


def raise_if_all_failed(trajs: Sequence[Episode]) -> None:
    """`all_failed_error` of one set of episodes, raised."""
    error = all_failed_error(episode_totals(trajs), first_error(trajs))
    if error is not None:
        raise error


def source_totals(episodes: Sequence[Episode], samples: Sequence[Sample]) -> Totals:
    """Per ``data_source``: episodes and successes, overall and among the episodes that called
    a tool."""
    out: Counter[str] = Counter()
    for episode, sample in zip(episodes, samples, strict=True):
        source = sample.data_source or "unknown"
        win = int(episode.success)
        out[f"episodes|{source}"] += 1
        out[f"success|{source}"] += win
        if episode.traj.tool_calls:
            out[f"episodes_with_tool|{source}"] += 1
            out[f"success_with_tool|{source}"] += win
    return dict(out)


def success_of_sources(t: Mapping[str, float]) -> dict[str, float]:
    """Success per ``data_source`` (``success/<source>``) and, within it, on the episodes that
    called a tool (``success_with_tool/<source>``): where a mixed dataset gains or loses."""
    out = {}
    sources = sorted(k.split("|", 1)[1] for k in t if k.startswith("episodes|"))
    for source in sources:
        out[f"success/{source}"] = t[f"success|{source}"] / t[f"episodes|{source}"]
        used = t.get(f"episodes_with_tool|{source}", 0)
        if used:
            out[f"success_with_tool/{source}"] = t[f"success_with_tool|{source}"] / used
    return out


def success_by_source(episodes: Sequence[Episode], samples: Sequence[Sample]) -> dict[str, float]:
    """`success_of_sources` of one set of episodes."""
    return success_of_sources(source_totals(episodes, samples))


def split_groups(episodes: Sequence[Episode]) -> list[list[Episode]]:
    """Consecutive episodes of one group (``group_id``) together, in order."""
    groups: list[list[Episode]] = []
    for t in episodes:
        if groups and groups[-1][0].group_id == t.group_id:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups
