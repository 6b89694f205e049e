"""A step's episodes: rolled out through the agent loop and scored (`run_episodes`).

1. each prompt is rolled out ``group.n`` times through the agent loop on the backend, or as a
   tree (``group.strategy=tree``), all episodes concurrently (the backend batches them);
2. each trajectory is scored (`scored_text`: its final answer, or for verl data its whole
   response, as verl scores it); the filters mark what updates leave out;
3. DAPO's dynamic sampling keeps only groups with a reward signal (`has_signal`): the
   loop (`jax_agent_rl.train.producer`) draws fresh prompts in place of the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import traceback
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.filters import apply_filters
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.agent.tree import run_tree, tree_budget
from jax_agent_rl.config import JarlConfig, TreeSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import (
    Answer,
    AnswerFaultError,
    RewardError,
    Scorer,
    checked_reward,
    reads_whole_response,
)
from jax_agent_rl.rl import core
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.build import Rollout, Run
from jax_agent_rl.train.episodes import split_groups
from jax_agent_rl.usercode.processes import raised_in
from jax_agent_rl.usercode.threads import error_text


def final_answer_text(traj: Trajectory) -> str:
    """The last assistant message."""
    return next((m["content"] for m in reversed(traj.messages) if m["role"] == "assistant"), "")


def scored_text(sample: Sample, traj: Trajectory, tokenizer: Tokenizer) -> str:
    """What the reward reads, verl's rule for verl data: for a row of a source verl's
    ``default_compute_score`` knows, the whole response as verl's reward managers decode it
    (every token after the prompt, tool calls and tool responses included, special tokens
    skipped): a ``#### 15`` in an earlier turn counts when it lies where verl's rule looks; for
    other rows the last assistant message."""
    if reads_whole_response(sample.data_source):  # a rule the verl wing registered
        return tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    return final_answer_text(traj)


def prompt_text(sample: Sample) -> str:
    """The sample's last user message (a judge's ``{prompt}``)."""
    return next((m["content"] for m in reversed(sample.messages) if m["role"] == "user"), "")


async def outcome_reward(
    sample: Sample, traj: Trajectory, score: Scorer, tokenizer: Tokenizer
) -> float:
    """The episode's outcome: the environment's reward when it owns the episode's reward
    (``traj.env_reward``, SkyRL's), else ``score`` of its `scored_text` (by the sample's
    ``data_source``, ``ground_truth`` and ``extra``). As in verl, the reward function also
    gets the turn rewards as ``extra_info["tool_rewards"]`` (here one entry per answered turn,
    the sum of its calls; verl has one per call). Raises `RewardError` when ``score`` gives no
    finite number in range. An episode whose environment or harness the policy's text made fail
    (``caused_error``) scores 0, or its environment's reward so far when that is lower: a wrong
    answer, never more than going on would have given."""
    if traj.stop_reason == "caused_error":
        return min(0.0, traj.env_reward) if traj.env_reward is not None else 0.0
    if traj.env_reward is not None:
        return traj.env_reward
    extra = {**sample.extra, "tool_rewards": list(traj.turn_rewards)}
    answer = Answer(
        sample.data_source,
        prompt_text(sample),
        scored_text(sample, traj, tokenizer),
        sample.ground_truth,
        extra,
    )
    return checked_reward(await score(answer), f"the reward of {sample.data_source!r}")


def turn_reward_fault(traj: Trajectory, tool_reward_weight: float) -> str | None:
    """Why the turn rewards make ``traj`` a wrong answer: they count (``tool_reward_weight``
    not 0, no environment owns the reward) and a call's reward failed its check
    (``traj.turn_reward_error``), else None."""
    if traj.env_reward is not None or tool_reward_weight == 0:
        return None
    return traj.turn_reward_error


def with_turn_rewards(outcome: float, traj: Trajectory, tool_reward_weight: float) -> float:
    """The reward the learner trains on: ``outcome`` (`outcome_reward`), plus, unless the
    environment owns the reward, ``tool_reward_weight`` times the sum of the turn rewards
    (``traj.turn_rewards``: tool calls', a verl interaction's scores); at weight 0 they do not
    enter it at all. When they count and a call's reward failed its check (`turn_reward_fault`:
    a NaN the tool computed from the policy's arguments), the episode is a wrong answer: its
    outcome counts 0, the failed call's reward 0, and the others only where they lower it
    (at most 0): before, it ended ``reward_error``, untrained, and a policy that wrote calls
    whose reward fails escaped a wrong answer's penalty."""
    if traj.env_reward is not None or tool_reward_weight == 0:
        return outcome
    turns = tool_reward_weight * sum(traj.turn_rewards)
    if turn_reward_fault(traj, tool_reward_weight) is not None:
        return min(0.0, turns)
    return outcome + turns


async def trajectory_reward(
    sample: Sample, traj: Trajectory, score: Scorer, tool_reward_weight: float, tokenizer: Tokenizer
) -> float:
    """`with_turn_rewards` of the `outcome_reward`."""
    outcome = await outcome_reward(sample, traj, score, tokenizer)
    return with_turn_rewards(outcome, traj, tool_reward_weight)


def distinct_samples(samples: Sequence[Sample], drawn: set[str]) -> list[Sample]:
    """``samples`` with each one whose uid is in ``drawn`` (the uids drawn before for the same
    step, counted on here) renamed ``<uid>~<k>``, the first such name not drawn (``#`` marks
    a trajectory's per-turn samples): a batch that runs past an epoch's end can draw a sample
    twice (`PromptSampler`), and the episodes of both, named by the sample's uid and the
    step's tag, shared their uids, and with them their tool state (one's calls changed the
    other's sandbox, and the first to end released the other's), their requests' seeds (the
    same tokens twice) and their group."""
    out = []
    for s in samples:
        uid, k = s.uid, 0
        while uid in drawn:
            k += 1
            uid = f"{s.uid}~{k}"
        drawn.add(uid)
        out.append(s if uid == s.uid else dataclasses.replace(s, uid=uid))
    return out


def episode_seed(seed: int, tag: str) -> int:
    """The sampling seed of the rollout ``tag`` names (a step's attempt, an evaluation)."""
    return zlib.crc32(f"{seed}/{tag}".encode())


async def rollout_episodes(
    samples: Sequence[Sample],
    n: int,
    ctx: AgentContext,
    tag: str,
    *,
    seed: int,
    score: Scorer,
    tool_reward_weight: float,
    success_reward: float,
    tool_failure_reruns: int = 0,
    filters: Sequence[str] = (),
    tree: TreeSection | None = None,
    episode_done: Callable[[Trajectory], None] | None = None,
) -> list[Episode]:
    """One group of episodes per sample, run concurrently, sampled with
    ``episode_seed(seed, tag)``, and scored, in sample order: ``n`` chain episodes, or with
    ``tree`` the leaves of a tree rollout (`jax_agent_rl.agent.tree`) within a budget of
    ``n`` chain episodes' unless the section sets one. A sample given twice is played twice,
    the second time under another uid (`distinct_samples`). A chain episode whose tool service
    failed is run again from its prompt, up to ``tool_failure_reruns`` times
    (`Episode.reruns`); then the ``filters`` (`jax_agent_rl.agent.filters`) mark what
    updates leave out. ``episode_done`` is called with each chain episode as it ends, before
    it is scored (a progress bar). Whether they all failed is for the caller to check
    (`episodes.all_failed_error`), over every process's episodes."""
    ctx = dataclasses.replace(ctx, seed=episode_seed(seed, tag))
    samples = distinct_samples(samples, set())
    reruns: dict[str, int] = {}

    async def episode(e: Sample) -> list[Trajectory]:
        traj = await run_sample(e, ctx)
        for rerun in range(1, tool_failure_reruns + 1):
            if traj.stop_reason != "tool_error":
                break
            traj = await run_sample(e, ctx)  # its failed attempt's tool state was released
            reruns[traj.uid] = rerun
        if episode_done is not None:
            episode_done(traj)
        return [traj]

    async def grown(s: Sample) -> list[Trajectory]:
        assert tree is not None
        if s.agent_name != "tool_agent" or ctx.envs.plays(s):
            raise ValueError(
                f"group.strategy=tree branches tool_agent episodes without an environment; "
                f"sample {s.uid!r} names agent_name {s.agent_name!r}"
                + (f", env_class {s.env_class!r}" if s.env_class else "")
            )
        c = ctx.config
        budget = tree_budget(tree, n, c.max_response_tokens, c.max_turns)
        return await run_tree(s, ctx, tree, budget)

    if tree is None:
        episodes = [
            dataclasses.replace(s, uid=f"{s.uid}/{tag}/{i}", group_id=s.uid)
            for s in samples
            for i in range(n)
        ]
        runs = [episode(e) for e in episodes]
    else:
        episodes = [dataclasses.replace(s, uid=f"{s.uid}/{tag}", group_id=s.uid) for s in samples]
        runs = [grown(e) for e in episodes]
    groups = list(await asyncio.gather(*runs))
    scored = await score_episodes(
        groups, episodes, score, tool_reward_weight, ctx.tokenizer, success_reward=success_reward
    )
    out = [dataclasses.replace(e, reruns=reruns.get(e.uid, 0)) for g in scored for e in g]
    if filters:
        out = [e for group in split_groups(out) for e in apply_filters(group, filters)]
    return out


async def score_episodes(
    groups: Sequence[Sequence[Trajectory]],
    episodes: Sequence[Sample],
    score: Scorer,
    tool_reward_weight: float,
    tokenizer: Tokenizer,
    *,
    success_reward: float,
) -> list[list[Episode]]:
    """The `Episode` of each trajectory, in its group: its `trajectory_reward` (``groups[i]``
    played ``episodes[i]``), all scored concurrently: a model judge gets the step's requests
    together, and whether it succeeded: as its environment said, else its outcome
    (`outcome_reward`, without the turn rewards: many small tool rewards are no solved task)
    >= ``success_reward``. A reward function that raises on one ends that episode with
    ``reward_error`` (`reward_failed`); so does a reward that is not a finite number in range
    (`rewards.checked_reward`) or one that took longer than ``data.reward_timeout_s``, its
    error naming the row: reward 0, not trained on, never a NaN in its group. A reward that
    failed on the answer and not on the row's own (`rewards.AnswerFaultError`) scores the
    answer 0, trained on as a wrong answer, its ``answer_fault`` saying why; so does a tool
    call's reward that failed its check where turn rewards count (`with_turn_rewards`). The
    trajectories
    are not edited: what the reward adds is the episode's."""

    async def scored(sample: Sample, traj: Trajectory) -> Episode:
        fault = None
        try:
            try:
                outcome = await outcome_reward(sample, traj, score, tokenizer)
            except AnswerFaultError as e:
                outcome, fault = 0.0, f"{e} {_row(sample)}"
            reward = with_turn_rewards(outcome, traj, tool_reward_weight)
            reward = checked_reward(reward, f"the episode {traj.uid!r}")
            turns_fault = turn_reward_fault(traj, tool_reward_weight)
            if turns_fault is not None:
                fault = fault or f"{turns_fault} {_row(sample)}"
        except RewardError as e:  # out of range, or late
            message = f"reward error: {e} {_row(sample)}"
            return Episode(
                traj, answer_fault=fault, reward_error=message, reward_stop="reward_error"
            )
        except Exception as e:  # the function raised
            return reward_failed(sample, Episode(traj, answer_fault=fault), e)
        success = fault is None and traj.stop_reason != "caused_error"
        success = success and (
            traj.env_success if traj.env_success is not None else outcome >= success_reward
        )
        return Episode(traj, reward, success, fault)

    pairs = [(e, t) for group, e in zip(groups, episodes, strict=True) for t in group]
    flat = iter(await asyncio.gather(*(scored(e, t) for e, t in pairs)))
    return [[next(flat) for _ in group] for group in groups]


def _row(sample: Sample) -> str:
    """Which row an episode played, in errors."""
    return (
        f"on row {sample.group_id!r} (episode {sample.uid!r}, data_source {sample.data_source!r})"
    )


def reward_failed(sample: Sample, episode: Episode, error: Exception) -> Episode:
    """``episode`` ended with ``reward_error`` (reward 0, not trained on): its error names the
    reward setting, the function that raised (its innermost frame) and the row. An episode
    that had already failed keeps its stop reason, the reward's error added to its own."""
    where = raised_in(error)  # (in the worker process, for a function run in one)
    message = (
        f"reward error: the reward function (data.reward, or data.rewards_by_source."
        f"{sample.data_source}) raised {error_text(error)} in {where.name} "
        f"({where.filename}:{where.lineno}) {_row(sample)}\n"
        + "".join(traceback.format_exception(error))
    )
    if episode.trainable:
        return dataclasses.replace(
            episode, reward=0.0, reward_error=message, reward_stop="reward_error"
        )
    return dataclasses.replace(episode, reward=0.0, reward_error="\n" + message)


async def run_episodes(
    run: Run, rollout: Rollout, samples: Sequence[Sample], n: int, tag: str
) -> list[Episode]:
    """`rollout_episodes` for training: sampled (``rollout.ctx``), with the run's seed, the
    rollout's reward, the tool-reward weight, filters and rollout strategy (held-out
    evaluations run chains: `evaluation.evaluate_samples`)."""
    cfg = run.cfg
    tree = cfg.group.tree if cfg.group.strategy == "tree" else None
    return await rollout_episodes(
        samples,
        n,
        rollout.ctx,
        tag,
        seed=cfg.trainer.seed,
        score=rollout.score,
        tool_reward_weight=cfg.data.tool_reward_weight,
        success_reward=cfg.data.success_reward,
        tool_failure_reruns=cfg.group.tool_failure_reruns,
        filters=training_filters(cfg),
        tree=tree,
    )


def training_filters(cfg: JarlConfig) -> list[str]:
    """``agent.filters``, with ``equal_reward`` last under dynamic sampling (which drops the
    groups it excludes and refills the step)."""
    names = list(cfg.agent.filters)
    if cfg.group.dynamic_sampling and "equal_reward" not in names:
        names.append("equal_reward")
    return names


def has_signal(group: Sequence[Episode]) -> bool:
    """DAPO's dynamic sampling: whether the rewards of a group's trainable members are not all
    equal (a group without a signal teaches nothing: the loop samples a fresh prompt in its
    place, `producer.take_groups`)."""
    rewards = np.array([e.reward for e in group if e.trainable], np.float32)
    gids = np.zeros(len(rewards), np.int32)
    return bool(np.asarray(core.groups_with_signal(rewards, gids)).any())
