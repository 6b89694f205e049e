"""What happens around the RL steps, each on its own schedule: metrics, traces, held-out
evaluation, checkpoints and the console line are hooks with an ``every``, run after a step in
the order given (an evaluation adds its ``val/*`` figures before the console shows them); the
plots and the HF export are end hooks, run once the run is over.

``every=N`` runs a hook after every N-th step and after the last; ``every=0``, after the last
only. A hook is an async function of the run, its open rollout side and the step's `StepEnd`.
An end hook is a function of the run and its last state, called after the loop (its rollout
side closed, its checkpoints written) whether or not it had steps left: an SFT-only run
(``trainer.steps=0``) and a finished run resumed are exported too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.cluster import distributed
from jax_agent_rl.console import progress
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.train.build import Rollout, Run, save_checkpoint
from jax_agent_rl.train.episodes import stop_warning
from jax_agent_rl.train.evaluation import evaluate_samples, process_share
from jax_agent_rl.train.export import export_policy
from jax_agent_rl.train.metrics import equal_rewards_warning, plot_run, step_line
from jax_agent_rl.train.traces import (
    TRACES_FILE,
    UpdateTokens,
    append_traces,
    trace_picks,
    trace_record,
)


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """A finished step: ``step`` steps are done; ``metrics`` (the step's, which hooks may add
    to), every episode this process sampled for it (its trajectory and outcome; those too
    stale for the update are left out: `producer.Taken.fresh`), the learner's
    ``state`` after it (the loop's: the next step donates it, so a hook reads it and keeps
    none of it), and the
    update's per-token values (`traces.UpdateTokens`; None: no update, or several processes).
    """

    step: int
    last: bool
    metrics: dict[str, float]
    episodes: list[Episode]
    state: LearnerState
    tokens: UpdateTokens | None = None


HookFn = Callable[[Run, Rollout, StepEnd], Awaitable[None]]
EndHook = Callable[[Run, LearnerState], None]


@dataclasses.dataclass(frozen=True)
class Hook:
    every: int
    fn: HookFn

    def due(self, end: StepEnd) -> bool:
        return end.last or (self.every > 0 and end.step % self.every == 0)


async def evaluate(run: Run, rollout: Rollout, step: int) -> dict[str, float]:
    """Greedy episodes on the held-out prompts (one each; every process a slice,
    `evaluate_samples`), logged as ``val`` at ``step``; returns their metrics as ``val/*``."""
    episodes = len(process_share(run.val_samples))
    with progress.phase(
        run.console, f"{run.label}held-out @ step {step}, episode", episodes
    ) as bar:
        ev = await evaluate_samples(
            run.cfg,
            rollout.score,
            run.val_samples,
            1,
            rollout.eval_ctx,
            step,
            lambda _: bar.advance(),
        )
    m = ev.metrics
    run.metrics.write(step, "val", m)
    run.console.print(
        f"{run.label}held-out @ step {step}: success {m['success']:.3f}  "
        f"tool calls {m['tool_calls']:.2f}  turns {m['turns']:.2f}"
    )
    return {f"val/{k}": v for k, v in m.items()}


async def write_metrics(run: Run, rollout: Rollout, end: StepEnd) -> None:
    del rollout
    run.metrics.write(end.step, "train", end.metrics)


async def write_traces(run: Run, rollout: Rollout, end: StepEnd) -> None:
    """``trainer.traces_per_step`` trajectories, spread over the step's (process 0's share of
    them in a multi-process run), to ``traces.jsonl``, and with ``trainer.trace_backend=mlflow``
    to the run's MLflow store as well; those the update trained on with its per-token values
    (`traces.UpdateTokens.signals`)."""
    del rollout
    picks = trace_picks(end.episodes, run.cfg.trainer.traces_per_step)
    traced = [e.traj for e in picks]
    signals = end.tokens.signals(traced) if end.tokens is not None and picks else {}
    append_traces(
        run.run_dir / TRACES_FILE,
        (trace_record(t, run.tokenizer, end.step, signals.get(t.uid)) for t in picks),
    )
    if run.cfg.trainer.trace_backend == "mlflow":
        from jax_agent_rl.train.mlflow_traces import record_traces  # mlflow: an optional extra

        record_traces(run.run_dir, picks, run.tokenizer, end.step)


async def evaluate_held_out(run: Run, rollout: Rollout, end: StepEnd) -> None:
    if run.val_samples:
        end.metrics.update(await evaluate(run, rollout, end.step))


async def checkpoint(run: Run, rollout: Rollout, end: StepEnd) -> None:
    del rollout
    save_checkpoint(run, end.state, end.step)


async def console_line(run: Run, rollout: Rollout, end: StepEnd) -> None:
    """A log file gets one plain line a step; a terminal (which has the progress bar), the
    warnings only: the step's episodes mostly ended in an error or a budget
    (`episodes.stop_warning`), its rewards were equal in every group, or some of its updates
    were skipped for a loss or gradient norm that was not finite (`rl.update.apply_update`;
    no update ran: no such metric)."""
    del rollout
    m, console = end.metrics, run.console
    grpo = run.cfg.algorithm.adv_estimator != "gae"  # GRPO's groups (GiGPO, Tree-GRPO too)
    stops = stop_warning(m, end.episodes)
    skipped = int(m["nonfinite_updates"]) if "nonfinite_updates" in m else 0
    if skipped:
        line = f"WARNING: {skipped} update(s) skipped: the loss or gradient norm was not finite"
        stops = f"{stops}  {line}" if stops else line
    if not console.is_terminal or stops or (grpo and equal_rewards_warning(m)):
        line = step_line(end.step, run.cfg.trainer.steps, m, grpo)
        if stops:
            line += "  " + stops
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def default_hooks(run: Run) -> list[Hook]:
    """Every process evaluates and checkpoints (both are collective); only the first writes
    metrics, traces and console lines."""
    t = run.cfg.trainer
    primary = distributed.is_primary()
    return [
        *([Hook(1, write_metrics), Hook(1, write_traces)] if primary else []),
        Hook(t.eval_every, evaluate_held_out),
        Hook(t.save_every, checkpoint),
        *([Hook(1, console_line)] if primary else []),
    ]


def plot_metrics(run: Run, state: LearnerState) -> None:
    """The reward and throughput plots of ``metrics.jsonl`` (`metrics.plot_run`)."""
    del state
    plot_run(run.run_dir)


def export_hf(run: Run, state: LearnerState) -> None:
    """The final policy (of ``state``) as an HF checkpoint in ``RUN/hf``
    (`export.export_policy`; a LoRA run's merged, and its adapters as a PEFT folder in
    ``RUN/hf-adapter``). Every process takes part in copying the params to the host; the
    first writes, and the others wait for it on the devices (no time limit) rather than in
    jax.distributed's shutdown, which gives up after a few minutes (a 7B export can take
    more)."""
    if run.cfg.model.module:  # a custom policy has no HF layout
        run.console.print(f"{run.policy!r}: no HF export; its weights: RUN/checkpoints")
        return
    params = distributed.host_copy(state.policy.params)
    if distributed.is_primary():
        with progress.phase(run.console, f"exporting the policy to {run.run_dir / 'hf'}"):
            lora = run.model.lora is not None  # RUN/hf merged, RUN/hf-adapter the adapters
            export_policy(run.run_dir / "hf", run.cfg, run.model, params, merge=lora)
            if lora:
                export_policy(run.run_dir / "hf-adapter", run.cfg, run.model, params)
    distributed.barrier("exported")


def end_hooks() -> list[EndHook]:
    """Every process exports (copying the params is collective); only the first plots."""
    return [plot_metrics, export_hf] if distributed.is_primary() else [export_hf]
