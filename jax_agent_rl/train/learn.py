"""The learner's half of an RL step (`learn`), and the tail both loops end a step with
(`learn_and_push`): train on the step's groups, push the new weights, time the step.

`learn` packs the trainable trajectories (not those cut short by a dead tool service, an abort
or an unexpected error) into a batch, uploads it once with the rewards (DAPO's overlong
penalty shapes them: `shaped_rewards`) and groups, and lets the learner do the rest on the
device (`Learner.rl_update`): old-policy logprobs (and reference / critic values if used),
advantages (GRPO's group-normalised outcome or GAE), then ``algorithm.ppo_epochs`` passes of
``algorithm.mini_batches`` optimizer steps; only the metrics come back. The learner's state is
the loop's: each takes it and gives back the next.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import jax
import numpy as np

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import AlgorithmSection, JarlConfig
from jax_agent_rl.models.attention_kernels import training_kernel
from jax_agent_rl.rl import core, steps
from jax_agent_rl.rl.batch import per_turn_samples, step_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.sequence import TrainSequence
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.train.build import Rollout, Run, counted_since
from jax_agent_rl.train.episodes import (
    Totals,
    add_totals,
    all_failed_error,
    episode_totals,
    first_error,
    metrics_of_totals,
    split_groups,
)
from jax_agent_rl.train.metrics import INCLUDES_COMPILE
from jax_agent_rl.train.push import push_weights
from jax_agent_rl.train.traces import UpdateTokens


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


def shaped_rewards(episodes: Sequence[Episode], cfg: JarlConfig) -> np.ndarray:
    """The episodes' rewards, with DAPO's overlong penalty when ``overlong_buffer`` is set."""
    rewards = np.array([e.reward for e in episodes], np.float32)
    d = cfg.data
    if d.overlong_buffer:
        lengths = np.array([len(e.traj.response_ids) for e in episodes])
        rewards = rewards + np.asarray(
            core.overlong_penalty(
                lengths, cfg.agent.max_response_tokens, d.overlong_buffer, d.overlong_penalty
            )
        )
    return rewards


def staleness(seq: TrainSequence, version: int) -> int:
    """How many weight versions behind ``version`` the oldest sampled token of ``seq`` is
    (0 for a sequence with none)."""
    oldest = seq.oldest_version
    return 0 if oldest is None else version - oldest


def kv_behind(seqs: Sequence[TrainSequence]) -> tuple[int, int]:
    """Of the sampled tokens of ``seqs``: how many were sampled over keys and values older
    than the weights that sampled them (an engine that kept its KV over a push,
    ``engine.keep_kv_on_update``), and how many there are."""
    pairs = [
        (v, kv)
        for t in seqs
        for v, kv in zip(t.token_versions, t.kv_versions, strict=False)
        if v >= 0
    ]
    return sum(kv < v for v, kv in pairs), len(pairs)


def training_rows(
    episodes: Sequence[Episode], rewards: np.ndarray, algo: AlgorithmSection
) -> tuple[list[TrainSequence], np.ndarray, list[str], np.ndarray, np.ndarray | None]:
    """The learner's rows for ``episodes`` (shaped ``rewards``): one per sample of each
    trajectory (`Trajectory.train_sequences`, with its `Episode.reward`: one for an episode
    that only appended), or with ``turn_mode=per_turn`` one per model turn of each sample
    (`per_turn_samples`). Returns the rows, their rewards and groups (their episode's), the
    share of its episode each row is (``1 / rows of the episode``, so that GRPO's group
    statistics count every episode once), and with ``adv_estimator`` gigpo or tree_grpo each
    row's step-level advantage (`rl.steps`; else None)."""
    whole = algo.turn_mode == "trajectory"
    episode_turns = [
        [
            row
            for seq in e.traj.train_sequences(e.reward)
            for row in ([seq] if whole else per_turn_samples(seq))
        ]
        for e in episodes
    ]
    rows = [row for turns in episode_turns for row in turns]
    row_rewards = [float(r) for turns, r in zip(episode_turns, rewards, strict=True) for _ in turns]
    weights = [1.0 / len(turns) for turns in episode_turns for _ in turns]
    step_advantages = None
    if algo.adv_estimator == "gigpo":
        step_advantages = steps.gigpo_step_advantages(
            episode_turns, rewards, algo.gigpo_gamma, algo.norm_adv_by_std
        )
    elif algo.adv_estimator == "tree_grpo":
        step_advantages = steps.tree_branch_advantages(rows, row_rewards, algo.norm_adv_by_std)
    return (
        rows,
        np.asarray(row_rewards, np.float32),
        [t.group_id for t in rows],
        np.asarray(weights, np.float32),
        step_advantages,
    )


def learn(
    learner: Learner,
    state: LearnerState,
    cfg: JarlConfig,
    kept: Sequence[Episode],
    seen: Sequence[Episode],
    rollout_s: float = 0.0,
    rollout_logprobs: bool = True,
    version: int | None = None,
) -> tuple[LearnerState, dict[str, float], Totals, UpdateTokens | None]:
    """The learner's half of a step: this process's ``kept`` groups (whole groups of
    ``group.n``) trained on with every other process's, in one update of ``state``
    (donated) by ``learner`` (`Learner.rl_update`), batched and shaped as ``cfg`` says.
    ``seen`` (every episode this process sampled) and ``rollout_s`` (how long this process's
    rollout took) go into the metrics, which are those of every process (their
    `episode_totals` added up); returns the new state, the metrics and those totals.
    ``rollout_logprobs``: whether the trajectories carry the sampler's logprobs (a backend
    without them has the learner's stand in, `Learner.rl_update`). ``version``: the weight
    version of the policy being updated; with it, how far behind it each trained trajectory
    was sampled (`staleness`) goes into the metrics: ``staleness/<k>`` (the share k versions
    behind), ``staleness/max`` and the logprob gap per staleness (the oldest KV a token was
    sampled over counts as its age: `TrainSequence.oldest_version`). Always:
    ``staleness/kv_older_tokens``, the share of trained sampled tokens whose KV was older
    than the weights that sampled them. Also returns the update's per-token values, where a
    trace reads them (`traces.UpdateTokens`; in a one-process run that updated, else None).

    Each process's rows are padded to the same row count and length as every other's. Raises
    when every episode of every process failed (`episodes.all_failed_error`)."""
    processes, me = jax.process_count(), jax.process_index()
    trainable = [t for t in kept if t.trainable]
    rewards = shaped_rewards(trainable, cfg)
    group_ids = [t.group_id for t in trainable]
    rows_of, row_rewards, row_groups, row_weights, row_steps = training_rows(
        trainable, rewards, cfg.algorithm
    )
    mine = {
        **episode_totals(seen),
        **reward_groups(rewards, group_ids),  # additive: a group never spans processes
        "groups_kept": len(split_groups(kept)),
        "batch/trajectories": len(trainable),
        "batch/samples": len(rows_of),
        # rows a step advantage reaches (GiGPO: a state other turns also acted on; Tree-GRPO:
        # a node with siblings)
        "step_adv_rows": 0 if row_steps is None else int(np.count_nonzero(row_steps)),
        "train_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in rows_of),
        "rollout_s/max": rollout_s,
    }
    behind = [] if version is None else [staleness(t, version) for t in rows_of]
    mine.update({f"staleness_count/{k}": c for k, c in Counter(behind).items()})
    mine["staleness/max"] = max(behind, default=0)
    mine["staleness_kv_tokens"], mine["staleness_sampled_tokens"] = kv_behind(rows_of)
    shares = distributed.gather_objects((mine, first_error(seen)))
    totals = add_totals(share for share, _ in shares)
    error = all_failed_error(totals, next((e for _, e in shares if e), None))
    if error is not None:
        raise error
    m = metrics_of_totals(totals)
    m["groups_kept"] = totals["groups_kept"]
    m["batch/samples"] = totals["batch/samples"]  # per-turn samples: one per model turn
    if row_steps is not None:
        m["step_adv/nonzero_frac"] = totals["step_adv_rows"] / max(totals["batch/samples"], 1)
    m["episodes_sampled"] = totals["episodes"]  # with dynamic sampling, refills included
    if version is not None:
        trained = max(totals["batch/trajectories"], 1)
        for key, count in totals.items():
            if key.startswith("staleness_count/"):
                m[f"staleness/{key.split('/')[1]}"] = count / trained
        m["staleness/max"] = totals["staleness/max"]
    sampled = max(totals["staleness_sampled_tokens"], 1)
    m["staleness/kv_older_tokens"] = totals["staleness_kv_tokens"] / sampled
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
        min_sequences=cfg.data.prompts_per_step * cfg.group.n // processes,
        agree=distributed.agree_max,
        part=me,
        # a fused attention kernel masks by segments only, and so do exact logprobs' pages:
        # no tree rows where either runs
        tree=L.tree_packing
        and not learner.model.exact_pages
        and training_kernel(learner.sharder, learner.spec.compute_dtype) is None,
        step_advantages=row_steps,
    )
    m["batch/rows"] = real * K * learner.micro_batch_size
    width = batch.shape[1] if batch.tree is None else batch.tree.shape[1]  # the forward's rows
    m["batch/real_token_frac"] = totals["train_tokens"] / (m["batch/rows"] * width)
    t0 = time.perf_counter()
    tokens = None
    if totals["batch/samples"]:  # one upload; old / reference logprobs, advantages, updates
        staleness_s = None if version is None else np.zeros(len(sequences.rewards), np.int32)
        if staleness_s is not None:
            staleness_s[: len(behind)] = behind
        state, out, values = learner.rl_update(
            state,
            batch,
            sequences,
            real,
            rollout_logprobs=rollout_logprobs,
            staleness=staleness_s,
        )
        m.update(out)
        tokens = UpdateTokens(values, batch, rows_of) if processes == 1 else None
    jax.block_until_ready(state.policy.params)
    t_train = time.perf_counter() - t0
    m.update(
        {
            "time/train_s": t_train,
            "time/train_tokens_per_s": totals["train_tokens"] / max(t_train, 1e-9),
            **{k: totals[k] for k in ("batch/trajectories", "batch/groups")},
            "batch/groups_all_equal": totals["batch/groups_all_equal"],
        }
    )
    return state, m, totals, tokens


async def learn_and_push(
    run: Run,
    rollout: Rollout,
    state: LearnerState,
    kept: Sequence[Episode],
    seen: Sequence[Episode],
    step: int,
    compiles: bool,
    *,
    reported: dict[str, float],
    t0: float,
    idle0: float,
    waited_s: float,
    before_push: Callable[[], Awaitable[None]] | None = None,
) -> tuple[LearnerState, dict[str, float], Totals, UpdateTokens | None]:
    """A step's tail once its groups are in, in either loop: `learn` from ``kept`` (an update
    of ``state``, in a worker thread, so that the event loop, its agent loops and tool calls,
    goes on), push the new weights as version ``step + 1`` (once ``before_push()`` is done,
    if given), and the step's times: the rollouts' (the slowest process's ``waited_s``, how
    long it waited for its groups), the push's, and how the step spent them since ``t0``
    (`pace_metrics`; ``idle0``: the backend's idle time then). ``reported``: the counters of
    ``rollout`` its loop reported so far, brought up to date with this step's share
    (`counted_since`). Returns
    the new state, the metrics, the `learn` totals and the update's per-token values."""
    state, m, totals, tokens = await asyncio.to_thread(
        learn,
        run.learner,
        state,
        run.cfg,
        kept,
        seen,
        rollout_s=waited_s,
        rollout_logprobs=rollout.backend.capabilities.logprobs,
        version=step,
    )
    if before_push is not None:
        await before_push()
    pushed = await push_weights(
        run.serving, run.learner, state, rollout.pusher, rollout.backend, step + 1
    )
    m.update(
        {
            "time/rollout_s": totals["rollout_s/max"],
            "time/tools_cumulative_s": totals["tools_s"],
            **pushed,
            **pace_metrics(
                time.perf_counter() - t0,
                rollout.backend.idle_s() - idle0,
                waited_s,
                totals["batch/trajectories"],
            ),
            **counted_since(rollout.counters(), reported),
            INCLUDES_COMPILE: float(compiles),
        }
    )
    return state, m, totals, tokens


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
