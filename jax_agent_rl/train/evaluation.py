"""Held-out evaluation: the agent loop over the validation prompts with the run's tools and
reward. The trainer's ``val`` figures (`hooks.evaluate`) and ``jarl eval`` (`eval_command`)
are the same function, `evaluate_samples`, so the two agree exactly for the same weights.

With one sample per prompt (greedy, as the trainer evaluates) ``pass@1`` and ``mean@1`` are the
success rate. With ``n`` samples per prompt (sampled at the run's rollout temperature, seeded by
``trainer.seed`` and the step), ``mean@n`` is the success rate over all ``n * prompts``
episodes and ``pass@k`` (for k = 1, 2, 4, ... up to n, and n) the unbiased estimate of Chen et
al. (2021) of the chance that at least one of k samples succeeds (`pass_at_k`); pass@n is the
share of prompts with any success. A success is an episode whose outcome reward (without
the tool rewards: `rollout_score.outcome_reward`) reaches ``data.success_reward`` (1 by default), or
whose environment said it succeeded (`Episode.success`): a judge's 1/10 is no success, nor
are many small tool rewards around a wrong answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.table import Table

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import ConfigError, JarlConfig, load_config, missing_paths
from jax_agent_rl.console import progress
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import Environments, make_environments
from jax_agent_rl.models import (
    ModelConfig,
    Policy,
    Weights,
    load_hf,
    one_device_sharder,
    policy_of,
    request_cpu_devices,
)
from jax_agent_rl.rewards import Scorer
from jax_agent_rl.rl.objectives import cast_floats
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train.build import (
    check_environments,
    held_out_samples,
    run_sharder,
    serve_policy,
)
from jax_agent_rl.train.check import check_names, prompts_fit
from jax_agent_rl.train.checkpoints import RUN_CONFIG, checkpoint_step, saved_policy
from jax_agent_rl.train.episodes import (
    Totals,
    add_totals,
    all_failed_error,
    episode_totals,
    first_error,
    metrics_of_totals,
    source_totals,
    success_of_sources,
)
from jax_agent_rl.train.push import Serving
from jax_agent_rl.train.rollout_score import rollout_episodes

ALL = "all"  # the row of every source together


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` succeeded (Chen et
    al. 2021): ``1 - C(n - c, k) / C(n, k)``, the chance that k of the n, drawn without
    replacement, include a success."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: the powers of two below n, and n."""
    return [*(2**i for i in range(n.bit_length()) if 2**i < n), n]


def pass_totals(episodes: Sequence[Episode], n: int, samples: Sequence[Sample]) -> Totals:
    """Per ``data_source`` and over all (``|all``): prompts, successes, and the sums of
    `pass_at_k` over prompts. ``episodes``: ``n`` consecutive ones per sample, in order."""
    if len(episodes) != n * len(samples):
        raise ValueError(f"{len(episodes)} episodes for {len(samples)} prompts x {n}")
    out: dict[str, float] = {}
    for i, sample in enumerate(samples):
        c = sum(e.success for e in episodes[i * n : (i + 1) * n])
        for source in (sample.data_source or "unknown", ALL):
            for key, value in (
                ("prompts", 1.0),
                ("successes", float(c)),
                *((f"pass@{k}", pass_at_k(n, c, k)) for k in pass_ks(n)),
            ):
                out[f"{key}|{source}"] = out.get(f"{key}|{source}", 0.0) + value
    return out


def pass_rates(t: Mapping[str, float], n: int) -> dict[str, dict[str, float]]:
    """Per source (sorted, ``all`` last): ``prompts``, ``mean@n`` and ``pass@k``."""
    sources = sorted(
        k.split("|", 1)[1] for k in t if k.startswith("prompts|") and k != "prompts|all"
    )
    out = {}
    for source in [*sources, ALL]:
        prompts = t.get(f"prompts|{source}", 0)
        out[source] = {
            "prompts": float(prompts),
            f"mean@{n}": t.get(f"successes|{source}", 0) / max(prompts * n, 1),
            **{f"pass@{k}": t.get(f"pass@{k}|{source}", 0) / max(prompts, 1) for k in pass_ks(n)},
        }
    return out


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """``metrics``: the trainer's ``val`` figures (`metrics_of_totals`, ``success/<source>``);
    ``pass_rates``: `pass_rates`; ``answers``: `answer_record` of every episode. All over every
    process's episodes."""

    n: int
    metrics: dict[str, float]
    pass_rates: dict[str, dict[str, float]]
    answers: list[dict[str, Any]]


def answer_record(sample: Sample, attempt: int, episode: Episode) -> dict[str, Any]:
    """What ``jarl eval`` writes of one episode (a line of its answers file): the prompt row
    (uid, data source, ground truth, prompt messages), which of its n episodes, the model's
    last message (its answer) and the whole conversation, the reward and success, and how the
    episode ended."""
    said = [m for m in episode.traj.messages if m.get("role") == "assistant"]
    return {
        "uid": sample.uid,
        "attempt": attempt,
        "data_source": sample.data_source,
        "ground_truth": sample.ground_truth,
        "prompt": sample.messages,
        "answer": said[-1].get("content") if said else None,
        "reward": episode.reward,
        "success": episode.success,
        "stop_reason": episode.reward_stop or episode.traj.stop_reason,
        "turns": episode.traj.num_turns,
        "messages": episode.traj.messages[len(sample.messages) :],
    }


def process_share(samples: Sequence[Sample]) -> Sequence[Sample]:
    """The slice of ``samples`` this process evaluates (every process-count-th, from its own
    index)."""
    return samples[jax.process_index() :: jax.process_count()]


async def evaluate_samples(
    cfg: JarlConfig,
    score: Scorer,
    samples: Sequence[Sample],
    n: int,
    ctx: AgentContext,
    step: int,
    episode_done: Callable[[Trajectory], None] | None = None,
) -> Evaluation:
    """``n`` chain episodes per sample on ``ctx`` (every process a slice of the samples),
    scored by the run's reward and tool-reward weight, seeded by ``trainer.seed`` and
    ``step``. Raises when every episode failed (`episodes.all_failed_error`)."""
    mine = process_share(samples)
    episodes = await rollout_episodes(
        mine,
        n,
        ctx,
        f"val{step}",
        seed=cfg.trainer.seed,
        score=score,
        tool_reward_weight=cfg.data.tool_reward_weight,
        success_reward=cfg.data.success_reward,
        tool_failure_reruns=cfg.group.tool_failure_reruns,
        episode_done=episode_done,
    )
    each = [s for s in mine for _ in range(n)]
    shares = distributed.gather_objects(
        (
            episode_totals(episodes),
            source_totals(episodes, each),
            pass_totals(episodes, n, mine),
            first_error(episodes),
            [
                answer_record(s, i % n, e)
                for i, (s, e) in enumerate(zip(each, episodes, strict=True))
            ],
        )
    )
    totals = add_totals(share[0] for share in shares)
    error = all_failed_error(totals, next((share[3] for share in shares if share[3]), None))
    if error is not None:
        raise error
    metrics = metrics_of_totals(totals)
    metrics.update(success_of_sources(add_totals(share[1] for share in shares)))
    answers = [a for share in shares for a in share[4]]
    return Evaluation(n, metrics, pass_rates(add_totals(share[2] for share in shares), n), answers)


# ``jarl eval``


class EvalInputError(ValueError):
    """What ``jarl eval`` was given cannot be evaluated (one line, naming the input)."""


@dataclasses.dataclass(frozen=True)
class EvalTarget:
    """What ``jarl eval`` evaluates: the weights of a run's orbax checkpoint of ``step``, of
    the HF folder ``checkpoint``, or (neither) of the config's ``model.path``; with ``cfg``'s
    data (``samples``: `held_out_samples`), tools, reward, agent and rollout settings.
    ``out``: where the JSON goes."""

    cfg: JarlConfig
    samples: list[Sample]
    run_dir: Path | None
    step: int | None
    checkpoint: Path | None
    n: int
    out: Path
    envs: Environments  # the environments the held-out rows name (`make_environments`)

    @property
    def weights(self) -> str:
        if self.step is not None:
            return f"{self.run_dir} step {self.step}"
        return str(self.checkpoint or self.cfg.model.path)


def eval_target(
    target: str,
    step: int | None = None,
    checkpoint: str | None = None,
    n: int = 1,
    out: str | None = None,
    overrides: Sequence[str] = (),
) -> EvalTarget:
    """Reads ``target`` (a run folder or a config file) and checks the rest against it, and
    asks for the CPU devices of the run's mesh (`request_cpu_devices`, CPU processes only);
    raises `EvalInputError`, `ConfigError` or `FileNotFoundError` (no such checkpoint),
    naming what is wrong."""
    if n < 1:
        raise EvalInputError(f"--n {n}: samples per prompt must be at least 1")
    if step is not None and checkpoint is not None:
        raise EvalInputError("--step and --checkpoint both name weights: give one")
    if out is not None:  # written once every prompt is evaluated: checked before
        if Path(out).is_dir():
            raise EvalInputError(f"--out {out} is a folder: name the JSON file to write")
        try:
            Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EvalInputError(f"--out {out}: its folder cannot be made: {e.strerror}") from None
    path = Path(target)
    run_dir, cfg = _read_config(path, step, overrides)
    if not cfg.data.val:
        raise EvalInputError("data.val is empty: nothing to evaluate (give data.val=FILE)")
    mesh = cfg.mesh
    request_cpu_devices(mesh.data * mesh.fsdp * mesh.tensor)  # as the run had; JAX starts below
    hf = None if checkpoint is None else Path(checkpoint)
    if hf is not None:
        try:
            ModelConfig.from_pretrained(hf)
        except (ValueError, OSError) as e:
            raise EvalInputError(f"--checkpoint {hf}: {e}") from None
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(hf)))
    read = ("model.path", "model.tokenizer", "data.val", "tools.config", "env.interaction_config")
    missing = missing_paths(cfg, read)
    if missing:
        raise EvalInputError(f"{path / RUN_CONFIG if run_dir else path}: {missing[0]}")
    if hf is None and run_dir is not None:
        step = checkpoint_step(run_dir, cfg, step)
    name = f"step_{step}" if step is not None else (hf.name if hf is not None else "base")
    folder = run_dir if run_dir is not None else Path(cfg.trainer.run_dir)
    default = folder / "eval" / (name + (f"_n{n}" if n > 1 else "") + ".json")
    _check_out(Path(out) if out else default, "--out " if out else "the report's file ")
    _check_out(answers_path(Path(out) if out else default), "the answers' file ")
    samples = held_out_samples(cfg)
    named_all = next((s for s in samples if s.data_source == ALL), None)
    if named_all is not None:  # (its rows and every row would share one line of the report)
        raise EvalInputError(
            f"data.val row {named_all.uid!r} has data_source {ALL!r}, the name of the report's "
            "line of every source together: its prompts would count twice there and its own "
            "line would be lost; rename the source"
        )
    fit = prompts_fit(cfg, samples, "data.val")
    if fit:
        raise EvalInputError(fit[0])
    envs = make_environments(cfg.env, cfg.agent.max_turns)
    check_environments(envs, samples, "data.val")
    return EvalTarget(cfg, samples, run_dir, step, hf, n, Path(out) if out else default, envs)


def answers_path(out: Path) -> Path:
    """Where ``jarl eval`` writes every episode's answer (`answer_record`, one JSON line each):
    beside the report, ``<report's name>.answers.jsonl`` (a device, /dev/null: the same)."""
    return out if out.is_char_device() else out.with_name(f"{out.stem}.answers.jsonl")


def _check_out(out: Path, named: str) -> None:
    """Refuses an ``out`` the JSON could not be written to once every prompt is evaluated: a
    FIFO (its write waits for a reader for ever), a socket or a block device, or one under a
    folder this user may not write."""
    if out.exists() and not (out.is_file() or out.is_char_device()):  # (/dev/null: discarded)
        raise EvalInputError(f"{named}{out} is not a regular file: name the JSON file to write")
    folder = out.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not os.access(out if out.exists() else folder, os.W_OK):
        where = out if out.exists() else folder
        raise EvalInputError(f"{named}{out}: this user may not write {where}")


def _read_config(
    path: Path, step: int | None, overrides: Sequence[str]
) -> tuple[Path | None, JarlConfig]:
    """The run folder (None for a config file) and the config ``path`` names, its registry
    names checked as ``jarl train --dry-run`` checks them (`check_names`), weights unread."""
    if path.is_dir():
        if not (path / RUN_CONFIG).is_file():
            raise EvalInputError(f"{path} is not a run folder: it has no {RUN_CONFIG}")
        run_dir: Path | None = path
        cfg: JarlConfig = _run_config(path / RUN_CONFIG, overrides)
    elif path.is_file():
        if step is not None:
            raise EvalInputError(f"--step {step} needs a run folder, not the config {path}")
        run_dir, cfg = None, load_config(path, list(overrides))
    else:
        raise EvalInputError(f"{path}: no such run folder or config file")
    problems = check_names(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    return run_dir, cfg


def _run_config(path: Path, overrides: Sequence[str]) -> JarlConfig:
    """A run folder's config file with ``overrides``; a problem of the file itself names it (a
    run made before a key moved: "config key 'rollout.backend' is now 'engine.backend'" named
    no file, and the user had named only the folder)."""
    try:
        return load_config(path, list(overrides))
    except ConfigError as e:
        try:
            load_config(path)
        except ConfigError as own:
            raise ConfigError(f"{path}: {own}") from None
        raise e from None


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """What is evaluated: the policy, its weights (host, float32, as the learner keeps them)
    and the tokenizer."""

    policy: Policy
    params: Weights
    tokenizer: Tokenizer


def load_policy(target: EvalTarget) -> Evaluated:
    """The weights ``target`` names (its run's checkpoint of ``step``, else ``model.path``)."""
    cfg = target.cfg
    tokenizer = Tokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    if target.step is not None:
        assert target.run_dir is not None
        policy, params = saved_policy(target.run_dir, cfg, target.step)
    elif cfg.model.module:
        raise EvalInputError(
            f"model.module={cfg.model.module!r}: a custom policy's weights are a run's "
            "checkpoints only: evaluate its run folder (jarl eval RUN)"
        )
    else:
        model, params = load_hf(cfg.model.path, "float32", sharder=one_device_sharder())
        policy = policy_of(model)
    return Evaluated(policy, params, tokenizer)


def pass_table(rates: Mapping[str, Mapping[str, float]], title: str) -> Table:
    """One row per source of `pass_rates` (``all`` last): prompts, mean@n, pass@k."""
    columns = [c for c in rates[ALL] if c != "prompts"]
    table = Table(title=title)
    table.add_column("data source")
    table.add_column("prompts", justify="right")
    for c in columns:
        table.add_column(c, justify="right")
    for source, row in rates.items():
        cells = [f"{row[c]:.3f}" for c in columns]
        table.add_row(source, f"{row['prompts']:.0f}", *cells, end_section=source == ALL)
    return table


def eval_record(target: EvalTarget, ev: Evaluation, ctx: AgentContext) -> dict:
    """The JSON ``jarl eval`` writes."""
    c = target.cfg
    return {
        "weights": target.weights,
        "run_dir": None if target.run_dir is None else str(target.run_dir),
        "step": target.step,
        "checkpoint": None if target.checkpoint is None else str(target.checkpoint),
        "data": c.data.val,
        "prompts": len(target.samples),
        "n": ev.n,
        "sampling": {
            "temperature": ctx.config.temperature,
            "top_p": ctx.config.top_p,
            "top_k": ctx.config.top_k,
            "seed": c.trainer.seed,
        },
        "pass_rates": ev.pass_rates,
        "metrics": ev.metrics,
        "answers": ev.answers,
    }


async def run_eval(target: EvalTarget, policy: Evaluated, console: Console) -> dict:
    """Serves ``policy`` as the run's rollout backend does and evaluates the held-out prompts:
    greedy for ``n=1``, else sampled as the rollouts sample. Returns the `eval_record`."""
    cfg = target.cfg
    serving = Serving.of(policy.policy, run_sharder(cfg).mesh, cfg.model.dtype)
    async with serve_policy(
        cfg,
        policy.policy,
        cast_floats(policy.params, cfg.model.dtype),
        version=target.step or 0,
        sharder=serving.sharder,
        tokenizer=policy.tokenizer,
        registry=ToolRegistry.from_yaml(cfg.tools.config),
        envs=target.envs,
        console=console,
    ) as rollout:
        ctx = rollout.eval_ctx if target.n == 1 else rollout.ctx
        total = len(process_share(target.samples)) * target.n
        with progress.phase(console, "eval episode", total) as bar:
            ev = await evaluate_samples(
                cfg,
                rollout.score,
                target.samples,
                target.n,
                ctx,
                target.step or 0,
                lambda _: bar.advance(),
            )
    return eval_record(target, ev, ctx)


def eval_command(target: EvalTarget, policy: Evaluated, console: Console) -> dict:
    """``jarl eval``: evaluates ``policy`` (`load_policy`), prints the table, writes the JSON
    to ``target.out``; returns what it wrote."""
    record = asyncio.run(run_eval(target, policy, console))
    how = "greedy" if record["sampling"]["temperature"] == 0 else f"{target.n} samples per prompt"
    console.print(pass_table(record["pass_rates"], f"{target.weights} ({how})"))
    m = record["metrics"]
    console.print(
        f"turns {m['turns']:.2f}  tool calls {m['tool_calls']:.2f}  "
        f"malformed calls {m['malformed_call_rate']:.3f}  reward {m['reward']:.3f}"
    )
    target.out.parent.mkdir(parents=True, exist_ok=True)
    answers = answers_path(target.out)
    lines = "".join(json.dumps(a, default=str) + "\n" for a in record.pop("answers"))
    answers.write_text(lines)
    record["answers"] = str(answers)
    target.out.write_text(json.dumps(record, indent=1) + "\n")
    console.print(f"wrote {target.out} and every episode's answer to {answers}")
    return record
