"""Policies trained beside the run's own (``policies.<name>``; docs/agents.md, "Several
policies").

Each is a run of its own, built as the run is (`build.build_run` of `policy_config`): its
model, learner state, embedded engine, SFT warm start, checkpoints, metrics, traces and ``hf/``
export in ``RUN/policies/<name>``, with the run's other settings. Each episode's samples train
the policy that sampled them: the run's episodes the run's policy, a verifier's verdicts the
verifier.

The one role, ``verifier``: after each step of the run's policy it reads every episode of that
step that ended in an answer (its question and final answer, `verdict_samples`) ``n`` times,
and answers ``<answer>1</answer>`` (right) or ``<answer>0</answer>`` (wrong); its reward is
the ``math`` reward of that verdict against the episode's success, so 1 where it judged right.
Those verdicts, in groups of ``n`` per episode, are its update's batch (GRPO's groups: the
same question and answer judged ``n`` times). Its held-out figure is its accuracy on the
held-out questions, each given once with its right answer and once with another row's
(`verdict_rows`, written to its folder's ``val.jsonl``). Its hooks (metrics, traces, held-out,
checkpoint) run as the run's do, just before the run's own, so that a checkpoint of its is
never older than the run's: a resumed run restores it at the run's step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
from rich.console import Console

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.config import ConfigError, JarlConfig
from jax_agent_rl.config.sections import ContextSection, PolicySection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards.math import extract_answer
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.tokenization import Message
from jax_agent_rl.train.build import Rollout, Run, build_run, open_rollout, restore_at
from jax_agent_rl.train.checkpoints import RunCheckpoints
from jax_agent_rl.train.episodes import raise_if_all_failed
from jax_agent_rl.train.hooks import (
    Hook,
    StepEnd,
    checkpoint,
    evaluate,
    evaluate_held_out,
    export_hf,
    plot_metrics,
    write_metrics,
    write_traces,
)
from jax_agent_rl.train.learn import learn_and_push
from jax_agent_rl.train.rollout_score import final_answer_text, prompt_text, run_episodes

POLICIES = "policies"  # RUN/policies/<name>: each policy's run folder
VAL_FILE = "val.jsonl"  # a verifier's held-out rows, in its folder
TOOLS_FILE = "tools.yaml"  # its tools: none (a verdict is one model turn)
SFT_FILE = "sft.jsonl"  # its demonstrations, when the config gives none
VERDICT_SOURCE = "verifier"  # its rows' data_source
RIGHT, WRONG = "1", "0"  # its verdicts
ANSWERED = ("eos", "env_done")  # the episodes it judges ended so: in an answer


def policy_folder(run_dir: Path | str, name: str) -> Path:
    return Path(run_dir) / POLICIES / name


def policy_config(cfg: JarlConfig, name: str, section: PolicySection) -> JarlConfig:
    """The run config of policy ``name``: its model, optimizer and warm start, its run folder,
    its held-out rows (a verifier's: `verdict_rows`, when the run has held-out prompts), ``n``
    verdicts an episode as its group, one model turn an episode (a verdict) without tools,
    scored by the ``math`` reward; the run's other settings (engine, sampling, learner, loss,
    trainer)."""
    folder = policy_folder(cfg.trainer.run_dir, name)
    a = cfg.algorithm
    return dataclasses.replace(
        cfg,
        model=section.model,
        optim=section.optim,
        # no demonstrations given: its own, made from the run's training rows (`build_policies`)
        sft=section.sft
        if section.sft.data or not section.sft.steps
        else dataclasses.replace(section.sft, data=str(folder / SFT_FILE)),
        group=dataclasses.replace(cfg.group, n=section.n, strategy="chain", dynamic_sampling=False),
        agent=dataclasses.replace(
            cfg.agent,
            max_turns=1,
            context=ContextSection(),
            sub_agent_tool="",
            filters=[],
            default_agent_loop="tool_agent",
        ),
        tools=dataclasses.replace(
            cfg.tools, config=str(folder / TOOLS_FILE), server_url="", token_env=""
        ),
        data=dataclasses.replace(
            cfg.data,
            val=str(folder / VAL_FILE) if cfg.data.val else "",
            val_size=0,  # every row: two a held-out question
            reward="math",
            rewards_by_source={},
            success_reward=1.0,
        ),
        # one turn a verdict: no step-level credit, no per-turn samples; no router loss (the
        # run's router_aux_loss_coef is its own model's: a dense policy has no router)
        algorithm=dataclasses.replace(
            a,
            adv_estimator="grpo" if a.adv_estimator in ("gigpo", "tree_grpo") else a.adv_estimator,
            turn_mode="trajectory",
            router_aux_loss_coef=0.0,
        ),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(folder)),
        policies={},
    )


def answer_of(text: str) -> str:
    """What a verifier is shown of an answer: its ``<answer>`` (or boxed) content, else the
    whole final message."""
    found = extract_answer(text)
    return found if found is not None else text


def verdict_message(section: PolicySection, question: str, answer: str) -> Message:
    return {"role": "user", "content": section.prompt.format(question=question, answer=answer)}


def question_of(messages: Sequence[Message]) -> str:
    """An episode's question: the last user message before its first model turn."""
    question = ""
    for m in messages:
        if m["role"] == "assistant":
            break
        if m["role"] == "user":
            question = m["content"]
    return question


def verdict_samples(episodes: Iterable[Episode], section: PolicySection) -> list[Sample]:
    """One verifier sample per episode that ended in an answer (the model ended its turn
    without a call, its reward computed), labelled by its success, under the episode's uid;
    as many right as wrong ones (the first of each, in order), so that a constant verdict
    earns half the reward whatever the run's success rate (none: the step has only one
    kind)."""
    answered = [e for e in episodes if e.traj.stop_reason in ANSWERED and e.reward_error is None]
    right = [e for e in answered if e.success]
    wrong = [e for e in answered if not e.success]
    k = min(len(right), len(wrong))
    kept = {e.uid for e in right[:k] + wrong[:k]}
    return [
        Sample(
            uid=e.uid,
            messages=[
                verdict_message(
                    section, question_of(e.traj.messages), answer_of(final_answer_text(e.traj))
                )
            ],
            ground_truth=RIGHT if e.success else WRONG,
            data_source=VERDICT_SOURCE,
        )
        for e in answered
        if e.uid in kept
    ]


def verdict_rows(samples: Sequence[Sample], section: PolicySection) -> list[dict[str, Any]]:
    """A verifier's held-out rows (verl's layout): each question with its right answer (label
    1) and with the next row's answer that differs from it (label 0); rows without a ground
    truth (an environment's, a judge's) give none."""
    samples = [s for s in samples if s.ground_truth not in (None, "")]
    truths = [str(s.ground_truth) for s in samples]
    others = _next_different(truths)
    rows = []
    for i, s in enumerate(samples):
        question = prompt_text(s)
        j = others[i]
        pairs = [(truths[i], RIGHT)] + ([(truths[j], WRONG)] if j is not None else [])
        rows += [
            {
                "data_source": VERDICT_SOURCE,
                "prompt": [verdict_message(section, question, answer)],
                "reward_model": {"style": "rule", "ground_truth": label},
                "agent_name": "tool_agent",
            }
            for answer, label in pairs
        ]
    return rows


def _next_different(values: Sequence[str]) -> list[int | None]:
    """For each index, the next one (round the end) whose value differs; None if none does.
    Linear: within a run of equal values the answer is where the run ends, and the runs that
    reach the end wrap to the first value that differs from theirs."""
    n = len(values)
    out: list[int | None] = [None] * n
    for i in range(n - 2, -1, -1):
        out[i] = i + 1 if values[i + 1] != values[i] else out[i + 1]
    if n:
        last = values[-1]
        wrap = next((j for j, v in enumerate(values) if v != last), None)
        for i in range(n - 1, -1, -1):
            if out[i] is not None:
                break
            out[i] = wrap
    return out


def verdict_demonstrations(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT rows of `verdict_rows`: each prompt answered with its right verdict."""
    return [
        {
            "messages": [
                *r["prompt"],
                {
                    "role": "assistant",
                    "content": f"<answer>{r['reward_model']['ground_truth']}</answer>",
                },
            ]
        }
        for r in rows
    ]


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.write_text("".join(f"{json.dumps(r)}\n" for r in rows))


@dataclasses.dataclass
class OtherPolicy:
    """Policy ``name``: its run, its learner's state (the loop's for it), its rollout while
    open, and the rollout counters its steps reported so far."""

    name: str
    section: PolicySection
    run: Run
    state: LearnerState
    rollout: Rollout | None = None
    reported: dict[str, float] = dataclasses.field(default_factory=dict)

    def hooks(self, updated: bool) -> list[Hook]:
        """Its step's hooks: held-out and checkpoint at the run's steps, and the step's
        metrics and traces when it ``updated`` (a step without verdicts writes none)."""
        t = self.run.cfg.trainer
        logs = [Hook(1, write_metrics), Hook(1, write_traces)] if updated else []
        return [*logs, Hook(t.eval_every, evaluate_held_out), Hook(t.save_every, checkpoint)]


def build_policies(run: Run, console: Console) -> list[OtherPolicy]:
    """Every ``policies.<name>`` of ``run``'s config, built (or resumed at ``run.start``)."""
    cfg = run.cfg
    if cfg.policies and jax.process_count() > 1:
        raise ValueError(
            f"policies: other policies train in a run of one process, not {jax.process_count()}"
        )
    built: list[OtherPolicy] = []
    try:
        for name, section in cfg.policies.items():
            own = policy_config(cfg, name, section)
            folder = Path(own.trainer.run_dir)
            folder.mkdir(parents=True, exist_ok=True)
            Path(own.tools.config).write_text("[]  # a verdict is one model turn, without tools\n")
            if own.data.val:
                held_out = verdict_rows(run.val_samples, section)
                _write_jsonl(Path(own.data.val), held_out)
                if not held_out:  # (no held-out answer to judge: no held-out figure)
                    own = dataclasses.replace(own, data=dataclasses.replace(own.data, val=""))
            if own.sft.data == str(folder / SFT_FILE) and run.start == 0:
                if not (rows := verdict_rows(run.sampler.samples, section)):
                    raise ConfigError(
                        f"policies.{name}.sft: no row of data.train has a ground truth to make "
                        f"its demonstrations of: give policies.{name}.sft.data"
                    )
                _write_jsonl(folder / SFT_FILE, verdict_demonstrations(rows))
            console.print(f"policy {name!r} ({section.role}): {section.model.path}, run {folder}")
            saved = RunCheckpoints.steps_in(folder / "checkpoints")
            if run.start > 0 and run.start not in saved:
                raise ConfigError(
                    f"policies.{name}: the run resumes at step {run.start} and {folder} has no "
                    f"checkpoint of it (it has {saved}): a policy joins a run at its start "
                    "(a fresh trainer.run_dir)"
                )
            try:
                other_run, state = build_run(own, console)
            except ConfigError as e:  # (it names the policy's keys as the run's)
                raise ConfigError(f"policies.{name}: {e}") from None
            if other_run.start != run.start:  # (its checkpoints run ahead of the run's by one)
                state = restore_at(other_run, state, run.start)
                other_run.checkpoints.drop_after(run.start)  # (the steps redone save again)
                console.print(f"{name}: restored at the run's step {run.start}")
            other_run = dataclasses.replace(other_run, start=run.start, label=f"{name}: ")
            built.append(OtherPolicy(name, section, other_run, state))
    except BaseException:
        close_policies(built)
        raise
    return built


def close_policies(others: Sequence[OtherPolicy]) -> None:
    for other in others:
        other.run.checkpoints.close()
        other.run.metrics.close()


@contextlib.asynccontextmanager
async def open_policies(others: Sequence[OtherPolicy]) -> AsyncIterator[None]:
    """Each policy's rollout (its engine, reward), open while the loop runs."""
    async with contextlib.AsyncExitStack() as stack:
        for other in others:
            other.rollout = await stack.enter_async_context(open_rollout(other.run, other.state))
        try:
            yield
        finally:
            for other in others:
                other.rollout = None


async def evaluate_policies(others: Sequence[OtherPolicy], step: int) -> dict[str, float]:
    """Each policy's held-out figures at ``step`` (its own metrics get them as ``val``), as
    ``policies/<name>/val/*`` for the run's."""
    out: dict[str, float] = {}
    for other in others:
        if other.run.val_samples:
            assert other.rollout is not None
            m = await evaluate(other.run, other.rollout, step)
            out |= {f"{POLICIES}/{other.name}/{k}": v for k, v in m.items()}
    return out


async def step_policies(
    others: Sequence[OtherPolicy], end: StepEnd, compiles: bool
) -> dict[str, float]:
    """Each policy's step ``end.step`` on the run's episodes of that step: its verdicts, its
    update and push, its hooks. Returns its headline figures for the run's metrics
    (``policies/<name>/...``: reward, success, and held-out when evaluated)."""
    out: dict[str, float] = {}
    for other in others:
        assert other.rollout is not None
        step, tag = end.step - 1, f"verify{end.step}"
        samples = verdict_samples(end.episodes, other.section)
        verdicts: list[Episode] = []
        tokens = None
        if samples:
            t0, idle0 = time.perf_counter(), other.rollout.backend.idle_s()
            verdicts = await run_episodes(other.run, other.rollout, samples, other.section.n, tag)
            raise_if_all_failed(verdicts)
            other.state, m, _, tokens = await learn_and_push(
                other.run,
                other.rollout,
                other.state,
                verdicts,
                verdicts,
                step,
                compiles,
                reported=other.reported,
                t0=t0,
                idle0=idle0,
                waited_s=time.perf_counter() - t0,
            )
        else:  # every answer right, or every one wrong: nothing to judge that a constant would not
            m = {"skipped": 1.0}
        own = StepEnd(end.step, end.last, m, verdicts, other.state, tokens)
        for hook in other.hooks(updated=bool(samples)):
            if hook.due(own):
                await hook.fn(other.run, other.rollout, own)
        # its checkpoint complete before the run's begins: a run killed between them resumes
        # with the policy's at or ahead of the run's (`build_policies`)
        other.run.checkpoints.wait()
        shown = ("reward", "success", "val/success", "grad_norm", "skipped")
        out |= {f"{POLICIES}/{other.name}/{k}": m[k] for k in shown if k in m}
    return out


def end_policies(others: Sequence[OtherPolicy]) -> None:
    """Each policy's plots and ``hf/`` export, as the run's end hooks make the run's."""
    for other in others:
        plot_metrics(other.run, other.state)
        export_hf(other.run, other.state)
