"""The trainer: roll out groups, score, compute advantages, update, push weights, repeat.

One step (`Trainer._step`):

1. draw ``data.prompts_per_step`` prompts, roll each out ``rollout.n`` times through the agent
   loop on the backend (all episodes concurrently; the backend batches them);
2. score each trajectory's final answer; DAPO's overlong penalty shapes the reward and its
   dynamic sampling drops groups whose rewards are all equal, drawing more prompts to refill;
3. pack the trainable trajectories (not those cut short by a dead tool service, an abort or
   an unexpected error) into a batch; recompute old-policy logprobs (and reference / critic
   values if used);
4. advantages: GRPO (group-normalised outcome) or GAE (critic);
5. ``algorithm.ppo_epochs`` passes of ``algorithm.mini_batches`` optimizer steps;
6. push the new weights to the backend as version ``step + 1``.

Every step logs metrics (JSONL + TensorBoard), a few traces and, when the console is not a
terminal (a log file), one plain line; groups whose rewards are all equal (zero GRPO advantage)
are counted (``batch/groups_all_equal``) and a step where every group is so is warned about.
Every ``eval_every`` steps the held-out prompts are solved greedily; every ``save_every`` steps
an orbax checkpoint of both train states, the step, the prompt sampler's position and the seed
is written. A rerun with the same run folder resumes from the last complete checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jax_agent_rl.agent.loop import AGENT_LOOPS, AgentConfig, AgentContext, run_sample
from jax_agent_rl.agent.parsers import make_parser
from jax_agent_rl.agent.trajectory import STOP_REASONS, Sample, Trajectory
from jax_agent_rl.config import ConfigError, JarlConfig, ToolsSection, to_yaml
from jax_agent_rl.data.datasets import PromptSampler, load_samples
from jax_agent_rl.models import Sharder, load_hf, make_mesh, request_cpu_devices
from jax_agent_rl.rewards import ScoreFn, make_reward
from jax_agent_rl.rl import core
from jax_agent_rl.rl.batch import TrainBatch, last_token_rewards, make_batch
from jax_agent_rl.rl.learner import Learner, SamplingSpec, critic_from_policy
from jax_agent_rl.rollout.protocol import RolloutBackend
from jax_agent_rl.rollout.registry import BackendBuild, make_backend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import LocalTools, ToolExecutor, ToolRegistry
from jax_agent_rl.train.checkpoints import RunCheckpoints
from jax_agent_rl.train.export import export_policy
from jax_agent_rl.train.metrics import (
    INCLUDES_COMPILE,
    MetricsLog,
    equal_rewards_warning,
    plot_run,
    step_line,
)
from jax_agent_rl.train.sft import load_demonstrations, run_sft
from jax_agent_rl.train.traces import append_traces, trace_record


def final_answer_text(traj: Trajectory) -> str:
    """The last assistant message (what the reward reads)."""
    return next((m["content"] for m in reversed(traj.messages) if m["role"] == "assistant"), "")


def trajectory_reward(
    sample: Sample, traj: Trajectory, score: ScoreFn, tool_reward_weight: float
) -> float:
    """The reward the learner trains on: ``score`` of the final answer (by the sample's
    ``data_source``, ``ground_truth`` and ``extra``) plus ``tool_reward_weight`` times the sum
    of the tool rewards (``traj.turn_rewards``). As in verl, the reward function also gets the
    tool rewards as ``extra_info["tool_rewards"]`` (here one entry per tool turn, the sum of
    its calls; verl has one per call)."""
    extra = {**sample.extra, "tool_rewards": list(traj.turn_rewards)}
    outcome = score(sample.data_source, final_answer_text(traj), sample.ground_truth, extra)
    return outcome + tool_reward_weight * sum(traj.turn_rewards)


def episode_metrics(trajs: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """Outcome and behaviour statistics of a set of episodes."""
    n = max(len(trajs), 1)
    calls = sum(t.tool_calls for t in trajs)
    stops: Counter[str] = Counter(t.stop_reason for t in trajs)
    lengths = [len(t.response_ids) for t in trajs] or [0]
    out = {
        "reward": sum(t.reward for t in trajs) / n,
        "success": sum(t.reward > 0 for t in trajs) / n,
        "turns": sum(t.num_turns for t in trajs) / n,
        "tool_calls": calls / n,
        "malformed_call_rate": sum(t.malformed_calls for t in trajs) / max(calls, 1),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / max(calls, 1),
        "response_len/mean": float(np.mean(lengths)),
        "response_len/max": float(np.max(lengths)),
        "model_tokens/mean": sum(t.num_model_tokens for t in trajs) / n,
        "untrainable": sum(not t.trainable for t in trajs) / n,
    }
    out.update({f"stop/{r}": stops.get(r, 0) / n for r in STOP_REASONS})
    return {prefix + k: v for k, v in out.items()}


def raise_if_all_failed(trajs: Sequence[Trajectory]) -> None:
    """One trajectory's unexpected error ends that trajectory only (``agent_error``); when
    every trajectory of a rollout ended so, the backend, the tools or the loop is broken, not
    the policy: raise with the first traceback rather than train on nothing, step after step."""
    if trajs and all(t.stop_reason == "agent_error" for t in trajs):
        raise RuntimeError(
            f"all {len(trajs)} trajectories of the rollout failed; the first:\n{trajs[0].error}"
        )


def success_by_source(trajs: Sequence[Trajectory], samples: Sequence[Sample]) -> dict[str, float]:
    """Success per ``data_source`` (``success/<source>``) and, within it, on the episodes that
    called a tool (``success_with_tool/<source>``): where a mixed dataset gains or loses."""
    groups: dict[str, list[Trajectory]] = {}
    for traj, sample in zip(trajs, samples, strict=True):
        groups.setdefault(sample.data_source or "unknown", []).append(traj)
    out = {}
    for source, group in sorted(groups.items()):
        out[f"success/{source}"] = sum(t.reward > 0 for t in group) / len(group)
        used = [t for t in group if t.tool_calls]
        if used:
            out[f"success_with_tool/{source}"] = sum(t.reward > 0 for t in used) / len(used)
    return out


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


def logprob_gap(batch: TrainBatch) -> dict[str, float]:
    """Sampler-vs-learner logprob difference on sampled tokens (before the update)."""
    mask = np.asarray(batch.mask) > 0
    if not mask.any():
        return {}
    diff = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[mask]
    return {"logprob_gap/mean": float(diff.mean()), "logprob_gap/max": float(diff.max())}


def _mean_metrics(records: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}


def make_tools(
    section: ToolsSection, registry: ToolRegistry, environ: Mapping[str, str]
) -> ToolExecutor:
    """The run's tool executor: the ``server_url`` tool server (with the bearer token held by
    the environment variable ``token_env`` names, if it names one), else ``registry`` in this
    process."""
    if not section.server_url:
        if section.token_env:
            raise ConfigError("tools.token_env is set but tools.server_url is not")
        return LocalTools(registry, timeout_s=section.timeout_s)
    from jax_agent_rl.tools.server import HttpTools

    token = environ.get(section.token_env) if section.token_env else None
    if section.token_env and not token:
        raise ConfigError(
            f"tools.token_env={section.token_env!r}: that environment variable is not set or empty"
        )
    return HttpTools(section.server_url, token=token, timeout_s=section.timeout_s)


class Trainer:
    """Runs the configured job in ``cfg.trainer.run_dir`` (see the module docstring)."""

    def __init__(self, cfg: JarlConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = Path(cfg.trainer.run_dir)
        self.score = make_reward(cfg.data)  # user reward functions fail here, at startup

    # ------------------------------------------------------------------------- building

    def _load(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.tokenizer = Tokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
        n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
        if n > jax.device_count():
            raise ValueError(f"mesh needs {n} devices, this process sees {jax.device_count()}")
        mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, jax.devices()[:n])
        self.sharder = Sharder(mesh)
        self.model, params = load_hf(cfg.model.path, "float32", self.sharder)
        self.train_samples = load_samples(cfg.data.train, agents=AGENT_LOOPS)
        self.val_samples = (
            load_samples(cfg.data.val, agents=AGENT_LOOPS, limit=cfg.data.val_size or None)
            if cfg.data.val
            else []
        )
        self.sampler = PromptSampler(self.train_samples, cfg.trainer.seed)
        self.registry = ToolRegistry.from_yaml(cfg.tools.config)
        self.checkpoints = RunCheckpoints(
            self.run_dir / "checkpoints", cfg.trainer.keep_checkpoints
        )
        self.metrics = MetricsLog(self.run_dir, cfg.trainer.tensorboard)
        self.initial_params = params

    def _learner(
        self,
        params: Any,
        lr: float | None = None,
        warmup: int | None = None,
        decay_steps: int | None = None,
        micro_batch_size: int | None = None,
    ) -> Learner:
        cfg = self.cfg
        optim = cfg.optim if warmup is None else dataclasses.replace(cfg.optim, warmup_steps=warmup)
        r = cfg.rollout
        return Learner(
            self.model,
            params,
            algo=cfg.algorithm,
            optim=optim,
            sampling=SamplingSpec(r.temperature, r.top_k, r.top_p),
            compute_dtype=cfg.model.dtype,
            micro_batch_size=micro_batch_size or cfg.learner.micro_batch_size,
            remat=cfg.learner.remat,
            sharder=self.sharder,
            critic=critic_from_policy(params) if cfg.algorithm.adv_estimator == "gae" else None,
            lr=lr,
            decay_steps=decay_steps,
        )

    def _tools(self) -> ToolExecutor:
        return make_tools(self.cfg.tools, self.registry, os.environ)

    def _agent_config(self, greedy: bool) -> AgentConfig:
        a, r = self.cfg.agent, self.cfg.rollout
        return AgentConfig(
            max_turns=a.max_turns,
            max_tokens_per_turn=a.max_tokens_per_turn,
            max_response_tokens=a.max_response_tokens,
            max_tool_response_tokens=a.max_tool_response_tokens,
            max_model_len=r.max_model_len,
            temperature=0.0 if greedy else r.temperature,
            top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k,
            parser=a.parser,
        )

    # ------------------------------------------------------------------------- the run

    def run(self) -> Path:
        """Trains to ``trainer.steps`` (resuming if a checkpoint exists); returns the run dir."""
        self._load()
        try:
            asyncio.run(self._run())
        finally:
            self.checkpoints.close()
            self.metrics.close()
        plot_run(self.run_dir)
        self._export()
        return self.run_dir

    def _export(self) -> None:
        """The final policy as an HF checkpoint (with its tokenizer) in ``run_dir/hf``."""
        params = jax.device_get(self.learner.params)
        export_policy(self.run_dir / "hf", self.cfg, self.model, params)

    async def _run(self) -> None:
        cfg = self.cfg
        latest = self.checkpoints.latest_step() if cfg.trainer.resume else None
        params = self.initial_params
        if latest is None and cfg.sft.data and cfg.sft.steps > 0:
            params = self._sft(params)
        self.learner = self._learner(params)
        # The reference is a copy: the learner's jitted update donates the policy's buffers, so
        # a reference that shared them would be deleted by the first update.
        self.reference = jax.tree.map(jnp.copy, params) if cfg.algorithm.kl_coef else None
        start = 0
        if latest is not None:
            start = self._restore(latest)
            self.console.print(f"resumed from the checkpoint of step {start}")
        else:
            self._save(0)
        backend = make_backend(
            BackendBuild(
                cfg.rollout,
                self.model,
                self.learner.rollout_params(cfg.model.dtype),
                checkpoint=cfg.model.path,
                dtype=cfg.model.dtype,
                version=start,
                seed=cfg.trainer.seed,
            )
        )
        tools = self._tools()
        parser = make_parser(cfg.agent.parser)
        try:
            self.ctx = await AgentContext.create(
                backend, self.tokenizer, tools, parser, self._agent_config(False)
            )
            self.eval_ctx = dataclasses.replace(self.ctx, config=self._agent_config(True))
            if start == 0 and self.val_samples:
                await self._evaluate(0)
            with self._progress() as (progress, task):
                progress.update(task, completed=start)
                for step in range(start, cfg.trainer.steps):
                    m = await self._step(step, backend, compiles=step == start)
                    done = step + 1
                    last = done == cfg.trainer.steps
                    if self.val_samples and (
                        last or (cfg.trainer.eval_every and done % cfg.trainer.eval_every == 0)
                    ):
                        m.update(await self._evaluate(done))
                    if last or done % cfg.trainer.save_every == 0:
                        self._save(done)
                    progress.update(task, completed=done, status=self._status(m))
                    # a log file gets one plain line a step; a terminal, the warnings
                    if not self.console.is_terminal or equal_rewards_warning(m):
                        line = step_line(done, cfg.trainer.steps, m)
                        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        finally:
            await backend.close()
            await tools.close()

    @contextlib.contextmanager
    def _progress(self) -> Iterator[tuple[Progress, Any]]:
        progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
        )
        with progress:
            yield progress, progress.add_task("rl", total=self.cfg.trainer.steps, status="")

    @staticmethod
    def _status(m: dict[str, float]) -> str:
        s = f"reward {m['reward']:.2f}  success {m['success']:.2f}"
        if "val/success" in m:
            s += f"  held-out {m['val/success']:.2f}"
        return s

    # ------------------------------------------------------------------------- SFT

    def _sft(self, params: Any) -> Any:
        cfg = self.cfg
        builder = TurnBuilder(self.tokenizer, self.registry.schemas() or None)
        demos = load_demonstrations(cfg.sft.data, builder)
        learner = self._learner(
            params,
            lr=cfg.sft.lr,
            warmup=cfg.sft.warmup_steps,
            decay_steps=cfg.sft.steps,
            micro_batch_size=min(cfg.sft.batch_size, cfg.learner.micro_batch_size),
        )
        self.console.print(f"SFT: {cfg.sft.steps} steps on {len(demos)} demonstrations")
        with Progress(
            TextColumn("[bold]SFT"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
        ) as progress:
            task = progress.add_task("sft", total=cfg.sft.steps, status="")

            def on_step(step: int, metrics: dict[str, float]) -> None:
                self.metrics.write(step + 1, "sft", metrics)
                status = f"loss {metrics['sft_loss']:.3f}"
                progress.update(task, completed=step + 1, status=status)

            run_sft(
                learner,
                demos,
                steps=cfg.sft.steps,
                batch_size=cfg.sft.batch_size,
                bucket=cfg.learner.seq_bucket,
                seed=cfg.trainer.seed,
                on_step=on_step,
            )
        return learner.params

    # ------------------------------------------------------------------------- checkpoints

    def _states(self) -> dict[str, Any]:
        states = {"policy": self.learner.state}
        if self.learner.critic_state is not None:
            states["critic"] = self.learner.critic_state
        return states

    def _save(self, step: int) -> None:
        meta = {"step": step, "sampler": self.sampler.state(), "seed": self.cfg.trainer.seed}
        self.checkpoints.save(step, self._states(), meta)

    def _restore(self, step: int) -> int:
        states, meta = self.checkpoints.restore(step, self._states())
        self.learner.state = states["policy"]
        if "critic" in states:
            self.learner.critic_state = states["critic"]
        self.sampler.restore(meta["sampler"])
        return int(meta["step"])

    # ------------------------------------------------------------------------- one step

    def _seed(self, *parts: object) -> int:
        return zlib.crc32("/".join(map(str, (self.cfg.trainer.seed, *parts))).encode())

    async def _rollout(
        self, samples: Sequence[Sample], n: int, ctx: AgentContext, tag: str
    ) -> list[Trajectory]:
        episodes = [
            dataclasses.replace(s, uid=f"{s.uid}/{tag}/{i}", group_id=s.uid)
            for s in samples
            for i in range(n)
        ]
        ctx = dataclasses.replace(ctx, seed=self._seed(tag))
        trajs = list(await asyncio.gather(*(run_sample(e, ctx) for e in episodes)))
        raise_if_all_failed(trajs)
        for traj, e in zip(trajs, episodes, strict=True):
            traj.reward = trajectory_reward(e, traj, self.score, self.cfg.data.tool_reward_weight)
        return trajs

    def _shaped_rewards(self, trajs: Sequence[Trajectory]) -> np.ndarray:
        rewards = np.array([t.reward for t in trajs], np.float32)
        a = self.cfg.algorithm
        if a.overlong_buffer:
            lengths = np.array([len(t.response_ids) for t in trajs])
            rewards = rewards + np.asarray(
                core.overlong_penalty(
                    lengths,
                    self.cfg.agent.max_response_tokens,
                    a.overlong_buffer,
                    a.overlong_penalty,
                )
            )
        return rewards

    async def _collect(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Groups for one step; with dynamic sampling, only groups with a reward signal."""
        cfg = self.cfg
        want = cfg.data.prompts_per_step
        kept: list[list[Trajectory]] = []
        seen: list[Trajectory] = []
        for attempt in range(
            cfg.algorithm.max_refills + 1 if cfg.algorithm.dynamic_sampling else 1
        ):
            samples = self.sampler.next_batch(want - len(kept))
            trajs = await self._rollout(samples, cfg.rollout.n, self.ctx, f"s{step}a{attempt}")
            seen += trajs
            groups = [trajs[i : i + cfg.rollout.n] for i in range(0, len(trajs), cfg.rollout.n)]
            if cfg.algorithm.dynamic_sampling:
                groups = [groups[i] for i in self._groups_with_signal(groups)]
            kept += groups
            if len(kept) >= want:
                break
        stats = episode_metrics(seen)
        stats["groups_kept"] = len(kept)
        stats["episodes_sampled"] = len(seen)  # with dynamic sampling, refills included
        return [t for g in kept for t in g], stats

    @staticmethod
    def _groups_with_signal(groups: Sequence[Sequence[Trajectory]]) -> list[int]:
        """Indices of groups whose trainable members' rewards are not all equal (DAPO)."""
        members = [(i, t.reward) for i, g in enumerate(groups) for t in g if t.trainable]
        if not members:
            return []
        gids, rewards = (np.array(x) for x in zip(*members, strict=True))
        signal = core.groups_with_signal(rewards.astype(np.float32), gids)
        return sorted(set(gids[signal].tolist()))

    def _advantages(self, batch: TrainBatch, trajs: Sequence[Trajectory]) -> None:
        """Fills ``batch.advantages`` (and returns/values for GAE) in place."""
        cfg = self.cfg.algorithm
        rewards = self._shaped_rewards(trajs)
        B = batch.shape[0]
        mask = np.asarray(batch.mask)
        if cfg.adv_estimator == "grpo":
            names = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
            gids = np.full(B, len(names), np.int32)  # padding rows: a group of their own
            gids[: len(trajs)] = [names[t.group_id] for t in trajs]
            padded = np.zeros(B, np.float32)
            padded[: len(trajs)] = rewards
            adv_n = np.asarray(
                core.grpo_advantages(padded, gids, len(names) + 1, cfg.norm_adv_by_std)
            )
            batch.advantages = (adv_n[:, None] * mask).astype(np.float32)
            return
        values = self.learner.values(batch) * mask
        padded = np.zeros(B, np.float32)
        padded[: len(trajs)] = rewards
        token_rewards = last_token_rewards(batch, padded)
        adv, returns = core.gae_advantages(token_rewards, values, mask, cfg.gamma, cfg.lam)
        batch.advantages = np.asarray(core.masked_whiten(adv, mask) * mask, np.float32)
        batch.returns = np.asarray(returns, np.float32)
        batch.old_values = values.astype(np.float32)

    def _rows(self, n: int) -> int:
        """Rows for ``n`` trajectories: every mini-batch a whole number of micro-batches."""
        unit = self.cfg.learner.micro_batch_size * self.cfg.algorithm.mini_batches
        return max(unit, math.ceil(n / unit) * unit)

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        a = self.cfg.algorithm
        B = batch.shape[0]
        size = B // a.mini_batches
        records = []
        for _ in range(a.ppo_epochs):
            for i in range(a.mini_batches):
                mini = batch.rows(slice(i * size, (i + 1) * size))
                m = self.learner.update_policy(mini)
                if self.learner.critic_state is not None:
                    m.update(self.learner.update_critic(mini))
                records.append(m)
        return _mean_metrics(records)

    async def _step(self, step: int, backend: RolloutBackend, compiles: bool) -> dict[str, float]:
        """One RL step; ``compiles``: the first step of this process, whose times include
        compiling the engine and the learner step (kept out of the throughput plot)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        trajs, m = await self._collect(step)
        t_rollout = time.perf_counter() - t0
        trainable = [t for t in trajs if t.trainable]
        batch = make_batch(trainable, cfg.learner.seq_bucket, rows=self._rows(len(trainable)))
        t1 = time.perf_counter()
        batch.old_logp = self.learner.logprobs(batch) * np.asarray(batch.mask)
        if self.reference is not None:
            batch.ref_logp = self.learner.logprobs(batch, params=self.reference)
        self._advantages(batch, trainable)
        m.update(logprob_gap(batch))
        m.update(self._update(batch) if trainable else {})
        jax.block_until_ready(self.learner.params)
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        await backend.update_weights(self.learner.rollout_params(cfg.model.dtype), step + 1)
        t_push = time.perf_counter() - t2
        model_tokens = sum(t.num_model_tokens for t in trajs)
        train_tokens = int(np.asarray(batch.segment_ids).sum())
        m.update(
            {
                "time/rollout_s": t_rollout,
                "time/tools_cumulative_s": sum(t.timings.get("tools_s", 0.0) for t in trajs),
                "time/train_s": t_train,
                "time/weight_push_s": t_push,
                "time/step_s": time.perf_counter() - t0,
                "time/rollout_tokens_per_s": model_tokens / max(t_rollout, 1e-9),
                "time/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
                INCLUDES_COMPILE: float(compiles),
                "batch/trajectories": len(trainable),
                **reward_groups(self._shaped_rewards(trainable), [t.group_id for t in trainable]),
            }
        )
        self.metrics.write(step + 1, "train", m)
        picks = trajs[:: max(1, len(trajs) // max(cfg.trainer.traces_per_step, 1))]
        append_traces(
            self.run_dir / "traces.jsonl",
            (
                trace_record(t, self.tokenizer, step + 1)
                for t in picks[: cfg.trainer.traces_per_step]
            ),
        )
        return m

    async def _evaluate(self, step: int) -> dict[str, float]:
        """Greedy episodes on the held-out prompts (one each)."""
        trajs = await self._rollout(self.val_samples, 1, self.eval_ctx, f"val{step}")
        m = episode_metrics(trajs)
        m.update(success_by_source(trajs, self.val_samples))
        self.metrics.write(step, "val", m)
        self.console.print(
            f"held-out @ step {step}: success {m['success']:.3f}  "
            f"tool calls {m['tool_calls']:.2f}  turns {m['turns']:.2f}"
        )
        return {f"val/{k}": v for k, v in m.items()}


def train(cfg: JarlConfig, console: Console | None = None) -> Path:
    """Runs (or resumes) the job ``cfg`` describes; returns its run folder."""
    request_cpu_devices(cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor)
    return Trainer(cfg, console).run()
