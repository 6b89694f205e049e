"""One RL step over a built run (`rl_step`), and the functions it is made of.

1. draw ``data.prompts_per_step`` prompts, roll each out ``rollout.n`` times through the agent
   loop on the backend, or as a tree (``agent.strategy=tree``), all episodes concurrently
   (the backend batches them);
2. score each trajectory (`scored_text`: its final answer, or for verl data its whole response,
   as verl scores it); DAPO's overlong penalty shapes the reward and its
   dynamic sampling drops groups whose rewards are all equal, drawing more prompts to refill;
3. `learn`: pack the trainable trajectories (not those cut short by a dead tool service, an
   abort or an unexpected error) into a batch, upload it once with the rewards and groups,
   and let the learner do the rest on the device (`Learner.train_step`): old-policy logprobs
   (and reference / critic values if used), advantages (GRPO's group-normalised outcome or
   GAE), then ``algorithm.ppo_epochs`` passes of ``algorithm.mini_batches`` optimizer steps;
   only the metrics come back;
4. push the new weights to the backend as version ``step + 1``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jax_agent_rl import distributed
from jax_agent_rl.agent.filters import apply_filters
from jax_agent_rl.agent.loop import AgentContext, run_sample
from jax_agent_rl.agent.trajectory import Sample, Trajectory
from jax_agent_rl.agent.tree import run_tree, tree_budget
from jax_agent_rl.config import JarlConfig, TreeSection
from jax_agent_rl.rewards import Answer, Scorer, verl_rules
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import per_turn_samples, step_batch
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.build import Rollout, Run
from jax_agent_rl.train.episodes import (
    Totals,
    add_totals,
    all_failed_error,
    episode_totals,
    first_error,
    metrics_of_totals,
)
from jax_agent_rl.train.metrics import INCLUDES_COMPILE
from jax_agent_rl.train.traces import record_signals, trace_index, trace_picks


def final_answer_text(traj: Trajectory) -> str:
    """The last assistant message."""
    return next((m["content"] for m in reversed(traj.messages) if m["role"] == "assistant"), "")


def scored_text(sample: Sample, traj: Trajectory, tokenizer: Tokenizer) -> str:
    """What the reward reads, verl's rule for verl data: for a row of a source verl's
    ``default_compute_score`` knows, the whole response as verl's reward managers decode it
    (every token after the prompt, tool calls and tool responses included, special tokens
    skipped): a ``#### 15`` in an earlier turn counts when it lies where verl's rule looks; for
    other rows the last assistant message."""
    if verl_rules.knows_source(sample.data_source):
        return tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    return final_answer_text(traj)


def prompt_text(sample: Sample) -> str:
    """The sample's last user message (a judge's ``{prompt}``)."""
    return next((m["content"] for m in reversed(sample.messages) if m["role"] == "user"), "")


async def trajectory_reward(
    sample: Sample, traj: Trajectory, score: Scorer, tool_reward_weight: float, tokenizer: Tokenizer
) -> float:
    """The reward the learner trains on: the environment's when it owns the episode's reward
    (``traj.env_reward``, SkyRL's), else ``score`` of its `scored_text` (by the sample's
    ``data_source``, ``ground_truth`` and ``extra``) plus ``tool_reward_weight`` times the sum
    of the turn rewards (``traj.turn_rewards``: tool calls', a verl interaction's scores). As
    in verl, the reward function also gets them as ``extra_info["tool_rewards"]`` (here one
    entry per answered turn, the sum of its calls; verl has one per call)."""
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
    outcome = await score(answer)
    return outcome + tool_reward_weight * sum(traj.turn_rewards)


def reward_groups(rewards_n: np.ndarray, group_ids_n: Sequence[str]) -> dict[str, float]:
    """``batch/groups`` (groups trained) and ``batch/groups_all_equal``: those whose rewards
    are all equal, so that their GRPO advantages are zero and they teach the policy nothing."""
    gids_n = np.asarray(group_ids_n, str)
    signal_n = core.groups_with_signal(np.asarray(rewards_n, np.float32), gids_n)
    groups = len(set(gids_n.tolist()))
    return {
        "batch/groups": groups,
        "batch/groups_all_equal": groups - len(set(gids_n[signal_n].tolist())),
    }


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
    tool_failure_reruns: int = 0,
    filters: Sequence[str] = (),
    tree: TreeSection | None = None,
    episode_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """One group of episodes per sample, run concurrently, sampled with
    ``episode_seed(seed, tag)``, and scored, in sample order: ``n`` chain episodes, or with
    ``tree`` the leaves of a tree rollout (`jax_agent_rl.agent.tree`) within a budget of
    ``n`` chain episodes' unless the section sets one. A chain episode whose tool service
    failed is run again from its prompt, up to ``tool_failure_reruns`` times
    (`Trajectory.reruns`); then the ``filters`` (`jax_agent_rl.agent.filters`) mark what
    updates leave out. ``episode_done`` is called with each chain episode as it ends, before
    it is scored (a progress bar). Whether they all failed is for the caller to check
    (`episodes.all_failed_error`), over every process's episodes."""
    ctx = dataclasses.replace(ctx, seed=episode_seed(seed, tag))

    async def episode(e: Sample) -> list[Trajectory]:
        traj = await run_sample(e, ctx)
        for rerun in range(1, tool_failure_reruns + 1):
            if traj.stop_reason != "tool_error":
                break
            traj = await run_sample(e, ctx)  # its failed attempt's tool state was released
            traj.reruns = rerun
        if episode_done is not None:
            episode_done(traj)
        return [traj]

    async def grown(s: Sample) -> list[Trajectory]:
        assert tree is not None
        if s.agent_name != "tool_agent" or ctx.envs.plays(s):
            raise ValueError(
                f"agent.strategy=tree branches tool_agent episodes without an environment; "
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
    await score_episodes(groups, episodes, score, tool_reward_weight, ctx.tokenizer)
    trajs = [t for g in groups for t in g]
    for group in split_groups(trajs) if filters else ():
        apply_filters(group, filters)
    return trajs


async def score_episodes(
    groups: Sequence[Sequence[Trajectory]],
    episodes: Sequence[Sample],
    score: Scorer,
    tool_reward_weight: float,
    tokenizer: Tokenizer,
) -> None:
    """Sets each trajectory's `trajectory_reward` (``groups[i]`` played ``episodes[i]``), all
    scored concurrently: a model judge gets the step's requests together."""
    pairs = [(e, t) for group, e in zip(groups, episodes, strict=True) for t in group]
    rewards = await asyncio.gather(
        *(trajectory_reward(e, t, score, tool_reward_weight, tokenizer) for e, t in pairs)
    )
    for (_, traj), reward in zip(pairs, rewards, strict=True):
        traj.reward = reward


def split_groups(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Consecutive trajectories of one group (``group_id``) together, in order."""
    groups: list[list[Trajectory]] = []
    for t in trajs:
        if groups and groups[-1][0].group_id == t.group_id:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


async def run_episodes(
    run: Run, rollout: Rollout, samples: Sequence[Sample], n: int, tag: str
) -> list[Trajectory]:
    """`rollout_episodes` for training: sampled (``rollout.ctx``), with the run's seed, the
    rollout's reward, the tool-reward weight, filters and rollout strategy (held-out
    evaluations run chains: `evaluation.evaluate_samples`)."""
    cfg = run.cfg
    tree = cfg.agent.tree if cfg.agent.strategy == "tree" else None
    return await rollout_episodes(
        samples,
        n,
        rollout.ctx,
        tag,
        seed=cfg.trainer.seed,
        score=rollout.score,
        tool_reward_weight=cfg.data.tool_reward_weight,
        tool_failure_reruns=cfg.rollout.tool_failure_reruns,
        filters=training_filters(cfg),
        tree=tree,
    )


def training_filters(cfg: JarlConfig) -> list[str]:
    """``agent.filters``, with ``equal_reward`` last under dynamic sampling (which drops the
    groups it excludes and refills the step)."""
    names = list(cfg.agent.filters)
    if cfg.rollout.dynamic_sampling and "equal_reward" not in names:
        names.append("equal_reward")
    return names


def shaped_rewards(trajs: Sequence[Trajectory], cfg: JarlConfig) -> np.ndarray:
    """The trajectories' rewards, with DAPO's overlong penalty when ``overlong_buffer`` is set."""
    rewards = np.array([t.reward for t in trajs], np.float32)
    d = cfg.data
    if d.overlong_buffer:
        lengths = np.array([len(t.response_ids) for t in trajs])
        rewards = rewards + np.asarray(
            core.overlong_penalty(
                lengths, cfg.agent.max_response_tokens, d.overlong_buffer, d.overlong_penalty
            )
        )
    return rewards


def groups_with_signal(groups: Sequence[Sequence[Trajectory]]) -> list[int]:
    """Indices of groups whose trainable members' rewards are not all equal (DAPO)."""
    members = [(i, t.reward) for i, g in enumerate(groups) for t in g if t.trainable]
    if not members:
        return []
    gids, rewards = (np.array(x) for x in zip(*members, strict=True))
    signal = core.groups_with_signal(rewards.astype(np.float32), gids)
    return sorted(set(gids[signal].tolist()))


async def collect(
    run: Run, rollout: Rollout, step: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """This process's groups for one step (its share of ``data.prompts_per_step``), and every
    episode it sampled. With dynamic sampling, only groups with a reward signal are kept,
    and more prompts are drawn (at most ``rollout.max_refills`` times) until there are enough.

    Every process draws the same prompts from the same sampler and rolls out its own slice,
    so the sampler's state is one for the run (whatever the process count) and a group never
    spans processes; a refill draws as many prompts per process as the neediest one lacks."""
    cfg = run.cfg
    processes, me = jax.process_count(), jax.process_index()
    want, n = cfg.data.prompts_per_step // processes, cfg.rollout.n
    kept: list[list[Trajectory]] = []
    seen: list[Trajectory] = []
    for attempt in range(cfg.rollout.max_refills + 1 if cfg.rollout.dynamic_sampling else 1):
        k = distributed.agree_max([want - len(kept)])[0] if attempt else want
        if k == 0:
            break
        samples = run.sampler.next_batch(k * processes)[me * k : (me + 1) * k]
        tag = f"s{step}a{attempt}" + (f"p{me}" if processes > 1 else "")
        trajs = await run_episodes(run, rollout, samples, n, tag)
        seen += trajs
        groups = split_groups(trajs)
        if cfg.rollout.dynamic_sampling:
            groups = [groups[i] for i in groups_with_signal(groups)]
        kept += groups[: want - len(kept)]
    return [t for g in kept for t in g], seen


def staleness(traj: Trajectory, version: int) -> int:
    """How many weight versions behind ``version`` the oldest sampled token of ``traj`` is
    (0 for a trajectory with none)."""
    oldest = traj.oldest_version
    return 0 if oldest is None else version - oldest


def training_rows(
    trajs: Sequence[Trajectory], rewards: np.ndarray, turn_mode: str
) -> tuple[list[Trajectory], np.ndarray, list[str], np.ndarray]:
    """The learner's rows for ``trajs`` (scored ``rewards``): one per trajectory, or with
    ``turn_mode=per_turn`` one per model turn (`per_turn_samples`). Returns the rows, their
    rewards and groups (their episode's), and the share of its episode each row is (``1 /
    turns``, so that GRPO's group statistics count every episode once)."""
    if turn_mode == "trajectory":
        return list(trajs), rewards, [t.group_id for t in trajs], np.ones(len(trajs), np.float32)
    rows: list[Trajectory] = []
    row_rewards: list[float] = []
    weights: list[float] = []
    for traj, reward in zip(trajs, rewards, strict=True):
        turns = per_turn_samples(traj)
        rows += turns
        row_rewards += [float(reward)] * len(turns)
        weights += [1.0 / len(turns)] * len(turns)
    return (
        rows,
        np.asarray(row_rewards, np.float32),
        [t.group_id for t in rows],
        np.asarray(weights, np.float32),
    )


def learn(
    run: Run,
    kept: Sequence[Trajectory],
    seen: Sequence[Trajectory],
    rollout_s: float = 0.0,
    rollout_logprobs: bool = True,
    version: int | None = None,
    traced: Sequence[Trajectory] = (),
) -> tuple[dict[str, float], Totals]:
    """The learner's half of a step: this process's ``kept`` groups (whole groups of
    ``rollout.n``) trained on with every other process's, in one update
    (`Learner.train_step`). ``seen`` (every episode this process sampled) and ``rollout_s``
    (how long this process's rollout took) go into the metrics, which are those of every
    process (their `episode_totals` added up); returns them and those totals.
    ``rollout_logprobs``: whether the trajectories carry the sampler's logprobs (a backend
    without them has the learner's stand in, `Learner.train_step`). ``version``: the weight
    version of the policy being updated; with it, how far behind it each trained trajectory
    was sampled (`staleness`) goes into the metrics: ``staleness/<k>`` (the share k versions
    behind), ``staleness/max`` and the logprob gap per staleness. ``traced``: the trajectories
    whose traces are written (one process only); those trained on get their per-token
    learner logprobs and advantages (`traces.record_signals`), pulled out of the update itself.

    Each process's rows are padded to the same row count and length as every other's. Raises
    when every episode of every process failed (`episodes.all_failed_error`)."""
    cfg, learner = run.cfg, run.learner
    processes, me = jax.process_count(), jax.process_index()
    trainable = [t for t in kept if t.trainable]
    rewards = shaped_rewards(trainable, cfg)
    group_ids = [t.group_id for t in trainable]
    rows_of, row_rewards, row_groups, row_weights = training_rows(
        trainable, rewards, cfg.algorithm.turn_mode
    )
    mine = {
        **episode_totals(seen),
        **reward_groups(rewards, group_ids),  # additive: a group never spans processes
        "groups_kept": len(split_groups(kept)),
        "batch/trajectories": len(trainable),
        "batch/samples": len(rows_of),
        "train_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in rows_of),
        "rollout_s/max": rollout_s,
    }
    behind = [] if version is None else [staleness(t, version) for t in rows_of]
    mine.update({f"staleness_count/{k}": c for k, c in Counter(behind).items()})
    mine["staleness/max"] = max(behind, default=0)
    shares = distributed.gather_objects((mine, first_error(seen)))
    totals = add_totals(share for share, _ in shares)
    error = all_failed_error(totals, next((e for _, e in shares if e), None))
    if error is not None:
        raise error
    m = metrics_of_totals(totals)
    m["groups_kept"] = totals["groups_kept"]
    m["batch/samples"] = totals["batch/samples"]  # per-turn samples: one per model turn
    m["episodes_sampled"] = totals["episodes"]  # with dynamic sampling, refills included
    if version is not None:
        trained = max(totals["batch/trajectories"], 1)
        for key, count in totals.items():
            if key.startswith("staleness_count/"):
                m[f"staleness/{key.split('/')[1]}"] = count / trained
        m["staleness/max"] = totals["staleness/max"]
    # each mini-batch's sequences packed into rows (or one per row), every process the same
    # shapes (power-of-two slots: the step compiles again only for a step larger than any)
    L, K = cfg.learner, cfg.algorithm.mini_batches
    batch, sequences, real = step_batch(
        rows_of,
        row_rewards,
        row_groups,
        row_weights,
        mini_batches=K,
        row_tokens=L.row_tokens if L.packing else None,
        bucket=L.seq_bucket,
        rows_per_micro=learner.micro_batch_size // processes,
        min_sequences=cfg.data.prompts_per_step * cfg.rollout.n // processes,
        agree=distributed.agree_max,
        part=me,
    )
    m["batch/rows"] = real * K * learner.micro_batch_size
    m["batch/real_token_frac"] = totals["train_tokens"] / (m["batch/rows"] * batch.shape[1])
    t0 = time.perf_counter()
    if totals["batch/samples"]:  # one upload; old / reference logprobs, advantages, updates
        staleness_s = None if version is None else np.zeros(len(sequences.rewards), np.int32)
        if staleness_s is not None:
            staleness_s[: len(behind)] = behind
        index = trace_index(batch, rows_of, traced) if processes == 1 and traced else None
        out, values = learner.traced_step(
            batch, sequences, real, index, rollout_logprobs, staleness_s
        )
        m.update(out)
        if index is not None:
            record_signals(traced, index, values)
    jax.block_until_ready(learner.params)
    t_train = time.perf_counter() - t0
    m.update(
        {
            "time/train_s": t_train,
            "time/train_tokens_per_s": totals["train_tokens"] / max(t_train, 1e-9),
            **{k: totals[k] for k in ("batch/trajectories", "batch/groups")},
            "batch/groups_all_equal": totals["batch/groups_all_equal"],
        }
    )
    return m, totals


async def rl_step(
    run: Run, rollout: Rollout, step: int, compiles: bool
) -> tuple[dict[str, float], list[Trajectory]]:
    """One RL step (see the module docstring): `collect`, `learn`, push the weights. Returns
    its metrics (of every process; the rollout time is the slowest process's) and the
    trajectories this process sampled. ``compiles``: the first step of this process, whose
    times include compiling the engine and the learner step (kept out of the throughput
    plot)."""
    t0, idle0 = time.perf_counter(), rollout.backend.idle_s()
    kept, seen = await collect(run, rollout, step)
    t_collect = time.perf_counter() - t0
    m, totals = learn(
        run,
        kept,
        seen,
        rollout_s=t_collect,
        rollout_logprobs=rollout.backend.capabilities.logprobs,
        version=step,
        traced=trace_picks(seen, run.cfg.trainer.traces_per_step),
    )
    t1 = time.perf_counter()
    await rollout.backend.update_weights(run.serving_params(), step + 1)
    t_push = time.perf_counter() - t1
    t_rollout = totals["rollout_s/max"]
    m.update(
        {
            "time/rollout_s": t_rollout,
            "time/tools_cumulative_s": totals["tools_s"],
            "time/weight_push_s": t_push,
            "time/rollout_tokens_per_s": totals["model_tokens"] / max(t_rollout, 1e-9),
            **pace_metrics(
                time.perf_counter() - t0,
                rollout.backend.idle_s() - idle0,
                t_collect,
                totals["batch/trajectories"],
            ),
            **rollout.counted(),
            INCLUDES_COMPILE: float(compiles),
        }
    )
    return m, seen


def pace_metrics(
    step_s: float, rollout_idle_s: float, learner_idle_s: float, trajectories: float
) -> dict[str, float]:
    """How a step spent its time: the share the rollout backend had nothing in flight, the
    share the learner waited for trajectories, and trajectories trained per second."""
    step_s = max(step_s, 1e-9)
    return {
        "time/step_s": step_s,
        "time/rollout_idle_frac": min(rollout_idle_s / step_s, 1.0),
        "time/learner_idle_frac": min(learner_idle_s / step_s, 1.0),
        "time/trajectories_per_s": trajectories / step_s,
    }
