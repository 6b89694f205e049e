"""A run, assembled once: every part built from its own config section (`build_run`), and
the rollout side (backend, tools, agent contexts) opened around the loop (`open_rollout`; for
weights from elsewhere, as ``jarl eval`` serves them, `serve_policy`).

Building, in order: the reward (loaded, to fail early); the run folder and its
``config.yaml``; the model and the tokenizer; the mesh (always one, ``mesh.*`` devices) and
the policy's weights on it (`run_policy`, the one heavy load); the data (train prompts through
a resumable `PromptSampler`, held-out prompts); the tool registry; the environments;
checkpoints and metrics; then the SFT warm start (unless resuming); the learner (and a critic
for GAE); the KL reference (a copy); then either the resumed state of the last complete
checkpoint, or a checkpoint of step 0. The loops (`jax_agent_rl.train.loop`) hold the
learner's state that `build_run` returns and pass it on; they and the hooks
(`jax_agent_rl.train.hooks`) only read what is built here. Every part but the weights,
checkpoints and metrics comes from `jax_agent_rl.train.parts`, whose functions the pre-run
check (`jax_agent_rl.train.check`) calls too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from jax_agent_rl.agent.context import AgentConfig, AgentContext, turn_stop_ids
from jax_agent_rl.cluster import device_turns, distributed
from jax_agent_rl.cluster.ray import connect, disconnect
from jax_agent_rl.config import (
    ConfigError,
    JarlConfig,
    RaySection,
    ToolsSection,
    absolute_paths,
    to_yaml,
)
from jax_agent_rl.config.paths import made_folder
from jax_agent_rl.console import progress
from jax_agent_rl.data.datasets import PromptSampler
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import Environments, make_environments
from jax_agent_rl.models import (
    ModelConfig,
    Policy,
    Sharder,
    load_hf,
    policy_of,
)
from jax_agent_rl.protocol import RolloutBackend
from jax_agent_rl.rewards import Judge, Scorer, make_reward
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.rollout.delta import DeltaPusher
from jax_agent_rl.rollout.metered import MeteredBackend
from jax_agent_rl.rollout.ray_pool import RayPool, make_pool
from jax_agent_rl.rollout.registry import BackendBuild, lora_problem, make_backend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.base import ToolExecutor
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.checkpoints import RUN_CONFIG, RunCheckpoints
from jax_agent_rl.train.learners import make_learner, sft_micro_batch_rows
from jax_agent_rl.train.metrics import MetricsLog
from jax_agent_rl.train.parts import (
    check_environments,
    check_reward,
    held_out_samples,
    policy_and_tokenizer,
    prompt_samples,
    run_sharder,
    tool_registry,
)
from jax_agent_rl.train.push import Serving
from jax_agent_rl.train.run_policy import run_policy
from jax_agent_rl.train.sft import warm_start


@dataclasses.dataclass(frozen=True)
class Run:
    """Every part of one run, built once. ``learner``: the steps (the state they update is
    the loop's); ``start`` is the first RL step to run (0, or the resumed checkpoint's step)."""

    cfg: JarlConfig
    run_dir: Path
    console: Console
    tokenizer: Tokenizer
    policy: Policy
    learner: Learner
    sampler: PromptSampler
    val_samples: list[Sample]
    registry: ToolRegistry
    envs: Environments
    checkpoints: RunCheckpoints
    metrics: MetricsLog
    serving: Serving
    start: int
    label: str = ""  # what its console lines start with: another policy's name (``policies``)

    @property
    def model(self) -> ModelConfig:
        """The sizes of the policy the run trains (`Policy.cfg`)."""
        return self.policy.cfg

    def serving_params(self, state: LearnerState) -> Any:
        """The policy of ``state`` for this process's rollout backend."""
        return self.serving.params(self.learner, state)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The rollout side of a run, open while the loop runs: the backend serving the policy,
    the tools, the agent contexts for training (sampling) and evaluation (greedy), the
    reward (with the judge, if a reward names it), and the pusher of new weights to the
    backend (as deltas where it takes them: ``engine.push``)."""

    backend: MeteredBackend
    tools: ToolExecutor
    ctx: AgentContext
    eval_ctx: AgentContext
    score: Scorer
    pusher: DeltaPusher
    judge: Judge | None = None

    def counters(self) -> dict[str, float]:
        """The running totals the backend, the tools and the judge keep of themselves (Ray:
        deaths, re-run requests, restarts; the judge: calls, failures, cache hits), by metric
        name (`counted_since` makes a step's share of them)."""
        return {
            **self.backend.counters(),
            **self.tools.counters(),
            **(self.judge.counters() if self.judge is not None else {}),
        }


def counted_since(now: Mapping[str, float], reported: dict[str, float]) -> dict[str, float]:
    """How much each of the totals ``now`` (`Rollout.counters`) grew since ``reported``, the
    totals reported so far, which it brings up to date: each step reports its growth once,
    so the counts of all steps add up to the run's (evaluations' go to the next step)."""
    grown = {k: v - reported.get(k, 0.0) for k, v in now.items()}
    reported.update(now)
    return grown


def train_states(state: LearnerState) -> dict[str, Any]:
    """What a checkpoint holds of the model side: the policy's train state, the critic's, and
    the KL reference (the policy RL started from, after SFT: a resumed run cannot rebuild it)."""
    states: dict[str, Any] = {"policy": state.policy}
    if state.critic is not None:
        states["critic"] = state.critic
    if state.reference is not None:
        states["reference"] = state.reference
    return states


def save_checkpoint(run: Run, state: LearnerState, step: int) -> None:
    """The train states of ``state``, the step, the prompt sampler's position and the seed."""
    meta = {"step": step, "sampler": run.sampler.state(), "seed": run.cfg.trainer.seed}
    with (
        progress.phase(run.console, f"saving the checkpoint of step {step}"),
        device_turns.TURN,  # copying the arrays off the devices runs programs on them
    ):
        run.checkpoints.save(step, train_states(state), meta)


def _restore(
    checkpoints: RunCheckpoints, step: int, fresh: LearnerState, sampler: PromptSampler
) -> tuple[LearnerState, int]:
    """The checkpoint of ``step``'s state (laid out as ``fresh``) and step; sets ``sampler``."""
    states, meta = checkpoints.restore(step, train_states(fresh))
    sampler.restore(meta["sampler"])
    state = LearnerState(states["policy"], states.get("critic"), states.get("reference"))
    return state, int(meta["step"])


def restore_at(run: Run, fresh: LearnerState, step: int) -> LearnerState:
    """``run``'s state as its checkpoint of ``step`` holds it (laid out as ``fresh``), its
    prompt sampler set back to there; an error naming the run folder if it has none."""
    if step not in run.checkpoints.steps():
        raise ConfigError(
            f"{run.run_dir} has no checkpoint of step {step} (it has "
            f"{run.checkpoints.steps()}): it cannot resume beside the run"
        )
    return _restore(run.checkpoints, step, fresh, run.sampler)[0]


def build_run(cfg: JarlConfig, console: Console) -> tuple[Run, LearnerState]:
    """Builds (or resumes, see the module docstring) the run ``cfg`` describes, and its state."""
    check_reward(cfg)  # user reward functions fail here, before anything is written
    run_dir = made_folder(Path(cfg.trainer.run_dir), f"trainer.run_dir={cfg.trainer.run_dir!r}")
    if distributed.is_primary():
        (run_dir / RUN_CONFIG).write_text(to_yaml(absolute_paths(cfg, Path.cwd())))
    with progress.phase(console, "loading the model, the data and the tools"):
        policy, tokenizer = policy_and_tokenizer(cfg)
        sharder = run_sharder(cfg)
        params = run_policy(cfg, policy, sharder)
        default = cfg.agent.default_agent_loop
        samples = prompt_samples("data.train", cfg.data.train, default)
        sampler = PromptSampler(samples, cfg.trainer.seed)
        val_samples = held_out_samples(cfg)
        registry = tool_registry(cfg.tools.config)
        envs = make_environments(cfg.env, cfg.agent.max_turns)
        for key, rows in (("data.train", sampler.samples), ("data.val", val_samples)):
            check_environments(envs, rows, key)
    checkpoints = RunCheckpoints(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
    metrics = MetricsLog(run_dir, cfg.trainer.tensorboard, enabled=distributed.is_primary())
    try:
        distributed.check_shared_folder(run_dir, "trainer.run_dir")
        latest = distributed.same_on_every_process(
            checkpoints.latest_step() if cfg.trainer.resume else None,
            f"the last complete checkpoint in {run_dir}",
        )
        if latest is None and cfg.sft.data and cfg.sft.steps > 0:
            sft, sft_state = make_learner(
                cfg,
                policy,
                params,
                sharder,
                lr=cfg.sft.lr,
                warmup=cfg.sft.warmup_steps,
                decay_steps=cfg.sft.steps,
                micro_batch_size=sft_micro_batch_rows(cfg),
            )
            params = warm_start(cfg, sft, sft_state, tokenizer, registry, metrics, console)
        # the KL reference: the policy RL starts from (the learner keeps a copy); a LoRA
        # policy's is its base, the adapters left out (no copy: `rl.update.reference_of`)
        reference = params if cfg.algorithm.kl_coef and not policy.adapted else None
        with progress.phase(console, "building the learner's state"):
            learner, state = make_learner(cfg, policy, params, sharder, reference=reference)
        start = 0
        if latest is not None:
            state, start = _restore(checkpoints, latest, state, sampler)
        run = Run(
            cfg,
            run_dir,
            console,
            tokenizer,
            policy,
            learner,
            sampler,
            val_samples,
            registry,
            envs,
            checkpoints,
            metrics,
            Serving.of(policy, sharder.mesh, cfg.model.dtype),
            start,
        )
        if latest is None:
            save_checkpoint(run, state, 0)
        else:
            console.print(f"resumed from the checkpoint of step {start}")
        return run, state
    except BaseException:
        checkpoints.close()
        metrics.close()
        raise


def make_tools(
    section: ToolsSection,
    registry: ToolRegistry,
    environ: Mapping[str, str],
    ray: RaySection | None = None,
) -> ToolExecutor:
    """The run's tool executor: tool servers as actors on the Ray cluster if ``ray`` asks for
    some (`RayToolServers`), else the ``server_url`` tool server (with the bearer token held by
    the environment variable ``token_env`` names, if it names one), else ``registry`` in this
    process."""
    if ray is not None and ray.tool_servers:
        from jax_agent_rl.tools.ray_servers import RayToolServers

        return RayToolServers(section, ray)
    if not section.server_url:
        if section.token_env:
            raise ConfigError("tools.token_env is set but tools.server_url is not")
        return LocalTools(registry, timeout_s=section.timeout_s)
    from jax_agent_rl.tools.client import HttpTools

    token = environ.get(section.token_env) if section.token_env else None
    if section.token_env and not token:
        raise ConfigError(
            f"tools.token_env={section.token_env!r}: that environment variable is not set or empty"
        )
    return HttpTools(section.server_url, token=token, timeout_s=section.timeout_s)


def agent_config(cfg: JarlConfig, greedy: bool) -> AgentConfig:
    """The agent loop's settings: ``sampling``, or greedy decoding (evaluation)."""
    return AgentConfig.of(
        cfg.agent,
        max_model_len=cfg.engine.max_model_len,
        temperature=0.0 if greedy else cfg.sampling.temperature,
        top_p=1.0 if greedy else cfg.sampling.top_p,
        top_k=-1 if greedy else cfg.sampling.top_k,
    )


@contextlib.asynccontextmanager
async def open_rollout(run: Run, state: LearnerState) -> AsyncIterator[Rollout]:
    """`serve_policy` of the policy of ``state`` as weight version ``run.start``."""
    async with serve_policy(
        run.cfg,
        run.policy,
        run.serving_params(state),
        version=run.start,
        sharder=run.serving.sharder,
        tokenizer=run.tokenizer,
        registry=run.registry,
        envs=run.envs,
        console=run.console,
    ) as rollout:
        yield rollout


@contextlib.asynccontextmanager
async def serve_policy(
    cfg: JarlConfig,
    policy: Policy,
    params: Any,
    *,
    version: int,
    sharder: Sharder,
    tokenizer: Tokenizer,
    registry: ToolRegistry,
    envs: Environments,
    console: Console,
) -> AsyncIterator[Rollout]:
    """Starts ``engine.backend`` serving ``policy`` with ``params`` (in ``model.dtype``, laid
    out by ``sharder``: the run's `Serving`) as weight ``version``, the tools and the reward (with
    its judge, if ``data.judge`` is used); closes them on the way out. With
    ``engine.ray.address``, the replicas (and tool servers) are actors on that cluster, which
    the process joins here."""
    joined = bool(cfg.engine.ray.address) and connect(cfg.engine.ray.address)
    try:
        parser = make_parser(cfg.agent.parser)
        start = make_pool if cfg.engine.ray.address else make_backend
        hits = progress.CacheHits()
        with progress.phase(
            console, f"starting the {cfg.engine.backend} rollout backend (compiling its programs)"
        ) as starting:

            def compiled(done: int, total: int) -> None:
                cached = f" ({hits.count} loaded from the compile cache)" if hits.count else ""
                starting.update(done, f"{done}/{total} programs compiled{cached}")

            spec = BackendBuild(
                cfg.engine,
                policy,
                params,
                checkpoint=cfg.model.path,
                dtype=cfg.model.dtype,
                version=version,
                seed=cfg.trainer.seed,
                sharder=sharder,
                stop_token_ids=turn_stop_ids(tokenizer, parser),
                on_program=compiled,
                decode=tokenizer.decode,
                sampling=cfg.sampling,
            )
            try:
                built = start(spec)
            finally:
                hits.close()
        if (problem := lora_problem(spec, built)) is not None:
            await built.close()
            raise ValueError(problem)
        backend = MeteredBackend(built, version)  # its idle time goes into each step's metrics
        if isinstance(built, RayPool):
            nodes = collections.Counter(built.nodes)
            console.print(
                f"rollout: {cfg.engine.ray.replicas} {cfg.engine.backend} replicas on Ray "
                f"({cfg.engine.ray.address}), over {len(nodes)} node(s): "
                + ", ".join(f"{n[:12]} x{k}" for n, k in nodes.items())
            )
        tools = make_tools(cfg.tools, registry, os.environ, cfg.engine.ray)
        greedy_eval = backend.capabilities.per_request_sampling
        if not greedy_eval:
            console.print(
                f"engine.backend={cfg.engine.backend} samples as its server was set "
                f"(temperature={cfg.sampling.temperature}): evaluation samples so too, not greedily"
            )
        if policy.experts is not None and cfg.algorithm.routing_replay:
            replayed = backend.capabilities.expert_ids
            console.print(
                f"algorithm.routing_replay: the learner replays the experts {cfg.engine.backend} "
                "sampled with"
                if replayed
                else f"algorithm.routing_replay: engine.backend={cfg.engine.backend} reports "
                "no experts: the learner routes every token itself"
            )
        judge_backend: RolloutBackend | None = None
        try:
            ctx = await AgentContext.create(
                backend, tokenizer, tools, parser, agent_config(cfg, False), envs=envs
            )
            eval_ctx = dataclasses.replace(ctx, config=agent_config(cfg, greedy_eval))
            judge = None
            if cfg.data.judged:
                judge, judge_backend = make_judge(cfg, tokenizer, sharder, backend)
            with make_reward(cfg.data, judge) as score:  # (closed: its worker processes stop)
                deltas = backend.capabilities.delta_push
                pusher = DeltaPusher(policy, cfg.engine.push.full_every if deltas else 1)
                yield Rollout(backend, tools, ctx, eval_ctx, score, pusher, judge)
        finally:
            await backend.close()
            await tools.close()
            if judge_backend is not None:
                await judge_backend.close()
    finally:
        disconnect(joined)


def make_judge(
    cfg: JarlConfig, tokenizer: Tokenizer, sharder: Sharder, policy: MeteredBackend
) -> tuple[Judge, RolloutBackend | None]:
    """The judge ``data.judge`` describes, and the backend started for it, if it has its own:
    ``policy`` with the run's ``tokenizer`` (judging with the weight version it serves), or a
    ``data.judge.backend`` engine of ``data.judge.model_path`` (its weights and tokenizer) on
    the policy's inference devices (``sharder``), with ``engine.*``'s settings and
    ``max_concurrency`` slots."""
    section = cfg.data.judge
    if section.backend == "policy":
        return Judge(section, policy, tokenizer, eos_ids(tokenizer), lambda: policy.version), None
    judge_tokenizer = Tokenizer.from_pretrained(section.model_path)
    model, params = load_hf(section.model_path, cfg.model.dtype, sharder=sharder)
    stops = eos_ids(judge_tokenizer)
    backend = make_backend(
        BackendBuild(
            dataclasses.replace(
                cfg.engine, backend=section.backend, max_concurrent=section.max_concurrency
            ),
            policy_of(model),
            params,
            checkpoint=section.model_path,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            sharder=sharder,
            stop_token_ids=stops,
            sampling=cfg.sampling,
        )
    )
    return Judge(section, backend, judge_tokenizer, stops, lambda: 0), backend  # fixed weights


def eos_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Where a judge's answer ends: the tokenizer's end of turn, if it has one."""
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
