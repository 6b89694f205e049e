"""The training loop: build the run, then rollout -> score -> advantages -> update -> push,
step after step, with the hooks after each (`jax_agent_rl.train.hooks`). The steps are
updates from continuously sampled groups (`jax_agent_rl.train.producer`), synchronous (the
learner waits for each step's groups) at ``max_staleness=0``.

Before the first step of a fresh run the held-out prompts are evaluated (step 0). Other
policies of the run (``policies``) take their steps on each step's episodes
(`jax_agent_rl.train.policies`). After the loop, the end hooks plot the metrics and export the
policy as an HF checkpoint in ``RUN/hf`` (each other policy's in ``RUN/policies/<name>/hf``).
A rerun with the same run folder resumes from the last complete checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import jax
from rich.console import Console

from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import JarlConfig
from jax_agent_rl.console import progress
from jax_agent_rl.models import request_cpu_devices
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.train.build import Run, build_run, open_rollout
from jax_agent_rl.train.hooks import Hook, StepEnd, default_hooks, end_hooks, evaluate
from jax_agent_rl.train.policies import (
    OtherPolicy,
    build_policies,
    close_policies,
    end_policies,
    evaluate_policies,
    open_policies,
    step_policies,
)
from jax_agent_rl.train.producer import update_steps


def _status(m: dict[str, float]) -> str:
    s = f"reward {m['reward']:.2f}  success {m['success']:.2f}"
    if "val/success" in m:
        s += f"  held-out {m['val/success']:.2f}"
    return s


async def rl_loop(
    run: Run, state: LearnerState, hooks: Sequence[Hook], others: Sequence[OtherPolicy] = ()
) -> LearnerState:
    """Steps ``run.start`` .. ``trainer.steps`` from the learner's ``state`` (donated), each
    followed by the ``others`` policies' steps on its episodes (`policies.step_policies`)
    and its due hooks; returns the last state. The steps are synchronous or
    asynchronous (`jax_agent_rl.train.producer`) by ``trainer.max_staleness``; the loop holds the
    state and hands each step's to the next and to the hooks (`StepEnd.state`)."""
    steps = run.cfg.trainer.steps
    async with open_rollout(run, state) as rollout, open_policies(others):
        if run.start == 0 and run.val_samples:
            await evaluate(run, rollout, 0)
        if run.start == 0:
            await evaluate_policies(others, 0)
        if run.start < steps:
            run.console.print(
                f"RL: steps {run.start + 1}..{steps}; the first also compiles the learner's update"
            )
        async with update_steps(run, rollout) as step_fn:
            # a log file has the console_line hook's line a step, and heartbeats between
            with progress.phase(run.console, "rl step", steps, lines=False) as bar:
                bar.update(run.start)
                for step in range(run.start, steps):
                    state, m, episodes, tokens = await step_fn(state, step, step == run.start)
                    end = StepEnd(step + 1, step + 1 == steps, m, episodes, state, tokens)
                    m.update(await step_policies(others, end, step == run.start))
                    for hook in hooks:
                        if hook.due(end):
                            await hook.fn(run, rollout, end)
                    bar.update(end.step, _status(m))
    return state


def train(cfg: JarlConfig, console: Console | None = None) -> Path:
    """Runs (or resumes) the job ``cfg`` describes: `rl_loop` with the default hooks, then the
    end hooks; returns its run folder. In a multi-process run (`jax_agent_rl.cluster.distributed`)
    every process calls it; only the first prints, plots and writes the export."""
    devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    request_cpu_devices(devices // distributed.joined_processes())
    console = console or Console(quiet=not distributed.is_primary())
    run, state = build_run(cfg, console)
    others: list[OtherPolicy] = []
    finished = False
    try:
        others = build_policies(run, console)
        state = asyncio.run(rl_loop(run, state, default_hooks(run), others))
        finished = True
    finally:
        # a failed multi-process run is stopped at once (`jarl train`): closing the
        # checkpoints would wait for the other processes, which may be gone
        if finished or jax.process_count() == 1:
            run.checkpoints.close()
            run.metrics.close()
            close_policies(others)
    for hook in end_hooks():
        hook(run, state)
    end_policies(others)
    return run.run_dir
