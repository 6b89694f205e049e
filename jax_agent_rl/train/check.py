"""Everything a run reads, loaded and checked before it starts.

`jarl train` runs `check_run` before anything heavy, and ``--dry-run`` stops after it. By then
`load_config` has checked every number's range and how the numbers fit each other
(`jax_agent_rl.config.check_ranges`). This module loads what the values name through the
functions `build_run` builds the run with (`jax_agent_rl.train.parts`), but reads no weights,
writes no file and compiles nothing:

- every name looked up in a registry: the rollout and judge backends and the filters
  (`check_names`) and the reward (user functions too); the tool-call parser's name
  `load_config` checked;
- the model's ``config.json`` (its weight files must exist): ``engine.max_model_len``
  against ``max_position_embeddings``, the mesh against this process's devices and against
  every parameter dimension it shards (`check_mesh`);
- the tokenizer and its chat template: the prompt of every row read, rendered with the tool
  schemas, must leave room for a response; the parser's stop strings must be single tokens;
- the first `ROWS` rows of each data file (``load_samples`` checks their columns and types)
  and of the SFT demonstrations;
- every environment the rows read name (an ``env_class``; an interaction name among the
  interaction YAML's), and ``agent.harness`` loaded (an async function; rows running
  openai_agent need one);
- every tool of ``tools.config``, built, its schema rendered, and closed again;
- the backend's own check (with ``engine.backend=vllm``, the vLLM interpreter), and the
  engine settings it cannot honour, when set (`rollout.registry.unhonoured`).

Each problem is one line naming the key, its value and what would be accepted. All problems
are reported; a check that needs something that failed to load is skipped. With none, what the
run will do unasked is noted (``# note:`` lines): the data sources the ``math`` fallback
scores, no reward being chosen for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax

from jax_agent_rl.agent.filters import check_filters
from jax_agent_rl.config import ConfigError, JarlConfig, ModelSection
from jax_agent_rl.config.sections import PolicySection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import make_environments
from jax_agent_rl.models import ModelConfig, Policy
from jax_agent_rl.rewards import scored_by_fallback
from jax_agent_rl.rollout.registry import (
    backend_factory,
    backend_names,
    tuned_by_backend,
    unhonoured,
    unread_sections,
)
from jax_agent_rl.tokenization import ChatTemplateError, Tokenizer
from jax_agent_rl.tokenization.tool_calls import PARSERS, ToolCallParser, make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import LocalTools
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool
from jax_agent_rl.train.check_mesh import model_fit, processes_fit, spans_every_device
from jax_agent_rl.train.parts import (
    check_environments,
    check_reward,
    checkpoint_model,
    custom_policy,
    lora_model,
    one_line,
    prompt_samples,
    run_tokenizer,
    tokenizer_source,
    tool_registry,
)
from jax_agent_rl.train.sft import load_demonstrations
from jax_agent_rl.usercode.load import load_function

ROWS = 16  # rows read from the top of each data file

T = TypeVar("T")


def check_run(cfg: JarlConfig, processes: int = 1) -> list[str]:
    """Every problem a run of ``cfg`` over ``processes`` processes would meet before its first
    step; empty when none. The devices are those of every process (each assumed to have as
    many as this one when `jax.distributed` has not joined them: ``--dry-run``). What the run
    will do that a user may not expect is `run_notes`'s."""
    return _problems(cfg, processes)


def _attempt(problems: list[str], load: Callable[[], T]) -> T | None:
    """What ``load`` returns, or None with its `ConfigError`'s line added to ``problems``."""
    try:
        return load()
    except ConfigError as e:
        problems.append(str(e))
        return None


def _problems(cfg: JarlConfig, processes: int) -> list[str]:
    problems: list[str] = processes_fit(cfg, processes) + check_names(cfg) + _run_folder(cfg)
    attempt = functools.partial(_attempt, problems)

    parser = make_parser(cfg.agent.parser)  # a registered name: `load_config` checked it
    if cfg.engine.backend in backend_names():
        problems += unhonoured(cfg.engine)
        problems += backend_factory(cfg.engine.backend).check(cfg.engine, processes)
    judge = cfg.data.judge.backend
    if judge not in ("policy", cfg.engine.backend) and judge in backend_names():
        # a separate judge's engine takes engine.*'s settings on a backend of its own
        as_judge = dataclasses.replace(cfg.engine, backend=judge)
        problems += [f"data.judge.backend={judge}: {line}" for line in unhonoured(as_judge)]
    model, tokenizer = _model_and_tokenizer(cfg, attempt)
    joined = jax.process_count() == processes
    devices = jax.device_count() if joined else jax.local_device_count() * processes
    run_fit = model_fit(cfg, model, devices) if model is not None else []
    problems += run_fit
    if model is not None:
        problems += spans_every_device(cfg, processes, devices)
    for name, policy in cfg.policies.items():
        problems += _policy(cfg, name, policy, devices, run_fit)
    if cfg.policies and processes > 1:
        problems.append(f"policies: other policies train in a run of one process, not {processes}")
    default = cfg.agent.default_agent_loop
    train = attempt(lambda: prompt_samples("data.train", cfg.data.train, default, ROWS))
    val = (
        attempt(lambda: prompt_samples("data.val", cfg.data.val, default, ROWS))
        if cfg.data.val
        else []
    )
    rows = {"data.train": train or [], "data.val": val or []}
    attempt(lambda: _environments(cfg, rows))
    attempt(lambda: _harness(cfg, rows))
    schemas = attempt(lambda: _tool_schemas(cfg.tools.config))
    if schemas is not None:
        attempt(lambda: _rows_tools(rows, schemas, cfg))
    if tokenizer is None:
        return problems
    attempt(lambda: _stop_tokens(cfg.agent.parser, parser, tokenizer))
    builder = None if schemas is None else attempt(lambda: _builder(cfg.model, tokenizer, schemas))
    if builder is None:
        return problems
    for key, samples in rows.items():
        if samples:
            attempt(functools.partial(_prompts_fit, builder, samples, cfg, key))
    if cfg.sft.data:
        attempt(lambda: _demonstrations(cfg.sft.data, builder))
    return problems


def _run_folder(cfg: JarlConfig) -> list[str]:
    """``trainer.run_dir`` where a folder can be made (a dry run makes none): not a file, nor
    under one."""
    path = Path(cfg.trainer.run_dir).absolute()
    for at in (path, *path.parents):
        if at.exists():
            if at.is_dir():
                return []
            what = "is" if at == path else f"is under {str(at)!r},"
            return [f"trainer.run_dir={cfg.trainer.run_dir!r} {what} a file, not a folder"]
    return []


def _model_and_tokenizer(
    cfg: JarlConfig, attempt: Callable[[Callable[[], Any]], Any]
) -> tuple[ModelConfig | Policy | None, Tokenizer | None]:
    """The run's parts of `parts.policy_and_tokenizer`, each None where it failed: the model
    the mesh must fit (the checkpoint's, its adapters checked apart; or the custom policy)
    and the tokenizer (not one of a checkpoint folder found wrong)."""
    checkpoint = None if cfg.model.module else attempt(lambda: checkpoint_model(cfg.model.path))
    if not (cfg.model.module or cfg.model.tokenizer or checkpoint is not None):
        return None, None
    tokenizer = attempt(lambda: run_tokenizer(cfg.model, checkpoint))
    if checkpoint is not None:
        attempt(lambda: lora_model(cfg, checkpoint))
        return checkpoint, tokenizer
    return (
        None if tokenizer is None else attempt(lambda: custom_policy(cfg, tokenizer))
    ), tokenizer


def _policy(
    cfg: JarlConfig, name: str, section: PolicySection, devices: int, run_fit: Sequence[str]
) -> list[str]:
    """The problems of policy ``name``, each named by its keys: its checkpoint and tokenizer
    load, its model fits the run's context and mesh on ``devices`` (the lines the run's own
    model got, ``run_fit``, such as the device count's, are not said again), and its own
    demonstrations (``sft.data``, when it has SFT steps) read, rendered without tools as its
    verdicts are."""
    problems: list[str] = []
    attempt = functools.partial(_attempt, problems)

    model = attempt(lambda: checkpoint_model(section.model.path))
    if model is not None:
        # as `policies.policy_config` runs it: the run's settings, its model, no router loss
        algorithm = dataclasses.replace(cfg.algorithm, router_aux_loss_coef=0.0)
        own = dataclasses.replace(cfg, model=section.model, algorithm=algorithm)
        problems += [p for p in model_fit(own, model, devices) if p not in run_fit]
        tokenizer = attempt(lambda: run_tokenizer(section.model, model))
        if tokenizer is not None and section.sft.data and section.sft.steps:
            demos = section.sft.data
            attempt(lambda: _demonstrations(demos, _builder(section.model, tokenizer, [])))
    return [f"policies.{name}: {p}" for p in problems]


def check_names(cfg: JarlConfig) -> list[str]:
    """The rollout backend, the judge's backend and the filters, each against its registry,
    and the reward loaded (``jarl eval`` checks these too, before it loads weights)."""
    names, judge = backend_names(), cfg.data.judge.backend
    problems = check_filters(cfg.agent.filters)
    if cfg.engine.backend not in names:
        problems.insert(0, f"engine.backend={cfg.engine.backend!r}: expected one of {names}")
    if judge != "policy" and judge not in names:
        problems.append(
            f"data.judge.backend={judge!r}: use policy or a registered rollout backend {names}"
        )
    try:
        check_reward(cfg)
    except ConfigError as e:
        problems.append(str(e))
    return problems


def _is_token(tokenizer: Tokenizer, text: str) -> bool:
    try:
        tokenizer.token_id(text)
    except KeyError:
        return False
    return True


def _stop_tokens(name: str, parser: ToolCallParser, tokenizer: Tokenizer) -> None:
    """Generation stops at a parser's stop strings, so each must be one token."""
    missing = [t for t in parser.stop_tokens if not _is_token(tokenizer, t)]
    if missing:
        usable = sorted(
            n for n in PARSERS if all(_is_token(tokenizer, t) for t in make_parser(n).stop_tokens)
        )
        raise ConfigError(
            f"agent.parser={name!r} stops generation at {missing[0]!r}, which is not one token "
            f"of the tokenizer: use one of {usable}"
        )


def _environments(cfg: JarlConfig, rows: dict[str, list[Sample]]) -> None:
    """The ``env`` section loads, and every environment the first rows name exists (an
    interaction's name among the interaction YAML's)."""
    try:
        envs = make_environments(cfg.env, cfg.agent.max_turns)
        for key, samples in rows.items():
            check_environments(envs, samples, key)
    except ConfigError as e:
        raise ConfigError(f"{e} (the check reads the first {ROWS} rows of each file)") from None


def _harness(cfg: JarlConfig, rows: dict[str, list[Sample]]) -> None:
    """``agent.harness`` names an async function of one argument, loaded as the run loads it;
    rows that run openai_agent need one."""
    spec = cfg.agent.harness
    drives = [
        f"{k} row {s.uid!r}" for k, ss in rows.items() for s in ss if s.agent_name == "openai_agent"
    ]
    if not spec:
        if drives:
            raise ConfigError(
                f"{drives[0]} runs agent_name openai_agent, which needs agent.harness "
                "(package.module:function or path/to/file.py:function)"
            )
        return
    try:
        harness = load_function(spec, "agent.harness")
    except ConfigError:
        raise
    except Exception as e:  # the user's module runs here: whatever it raises is the config's
        raise ConfigError(f"agent.harness={spec!r} failed to load: {one_line(e)}") from None
    if not inspect.iscoroutinefunction(harness):
        raise ConfigError(f"agent.harness={spec!r} is not an async function (async def)")
    try:  # each episode calls it with its HarnessTask: another signature failed every episode
        inspect.signature(harness).bind(None)
    except TypeError as e:
        raise ConfigError(
            f"agent.harness={spec!r} cannot be called with one argument, the episode's "
            f"HarnessTask ({e})"
        ) from None


def run_notes(cfg: JarlConfig) -> list[str]:
    """What the run will do unasked: the speed settings its backend tunes itself, what it
    chooses by itself (`BackendFactory.notes`: the vllm weight transport), the settings
    of a backend's section another backend leaves unread, and the data
    sources the ``math`` fallback scores (the first rows of data.train and data.val), since no
    reward was chosen for them."""
    notes = []
    if cfg.engine.backend in backend_names():
        notes += tuned_by_backend(cfg.engine) + backend_factory(cfg.engine.backend).notes(
            cfg.engine
        )
    notes += unread_sections(cfg.engine)
    notes += [
        f"policies.{name}: a {p.role} with an engine and a learner of its own on the run's "
        f"devices (not in the memory plan), its run folder {cfg.trainer.run_dir}/policies/{name}"
        for name, p in cfg.policies.items()
    ]
    sources = []
    for key, path in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
        if path:
            rows = prompt_samples(key, path, cfg.agent.default_agent_loop, ROWS)
            sources += [s.data_source for s in rows]
    fallback = scored_by_fallback(cfg.data, sources)
    if not fallback:
        return notes
    return [
        *notes,
        f"data sources {fallback} (in the first {ROWS} rows of the data files) have no reward "
        "of their own and data.reward is unset: they are scored by the math fallback (the "
        "last <answer> or \\boxed{} against the ground truth); set data.reward or "
        "data.rewards_by_source to choose",
    ]


def _tool_schemas(path: str) -> list[dict[str, Any]]:
    """Builds every tool of the file, reads its schema and closes it again."""
    registry = tool_registry(path)
    try:
        return registry.schemas()
    finally:
        asyncio.run(LocalTools(registry).close())


def _rows_tools(
    rows: dict[str, list[Sample]], schemas: Sequence[dict[str, Any]], cfg: JarlConfig
) -> None:
    """The first rows' create kwargs (``extra_info.tools_kwargs``) are of verl's shape (each
    episode reads them first), and every tool they name is one of tools.config's: a verl row
    set for a tool the run lacks would never reach it (rows run by ``single_turn_agent`` call
    no tool)."""
    have = sorted(schema["function"]["name"] for schema in schemas)
    for key, samples in rows.items():
        for i, sample in enumerate(samples):
            try:
                single = sample.agent_name == "single_turn_agent"
                named = {} if single else create_kwargs_by_tool(sample.extra)
            except ValueError as e:
                raise ConfigError(f"{key}: row {i}: {e}") from None
            missing = sorted(set(named) - set(have))
            if missing:
                raise ConfigError(
                    f"{key}: row {i}'s extra_info.tools_kwargs names {missing}, which "
                    f"tools.config={cfg.tools.config!r} lacks (it has {have}): set tools.config "
                    "to the YAML of those tools"
                )


def _builder(
    section: ModelSection, tokenizer: Tokenizer, schemas: Sequence[dict[str, Any]]
) -> TurnBuilder:
    try:
        return TurnBuilder(tokenizer, schemas or None)
    except ChatTemplateError as e:
        key, folder = tokenizer_source(section)
        raise ConfigError(f"{key}={folder!r}: {e}") from None


def prompts_fit(cfg: JarlConfig, samples: Sequence[Sample], key: str) -> list[str]:
    """The problem (one line; none: []) of ``samples`` (``key``'s rows) whose prompt, rendered
    with tools.config's schemas by model.path's (or model.tokenizer's) tokenizer, leaves no
    room for a response within engine.max_model_len (`jarl eval`'s check of data.val: each
    such episode ended before its first token, scored as a wrong answer, with no word)."""
    try:
        tokenizer = run_tokenizer(cfg.model, None)
        builder = _builder(cfg.model, tokenizer, _tool_schemas(cfg.tools.config))
        _prompts_fit(builder, samples, cfg, key)
    except ConfigError as e:
        return [str(e)]
    return []


def _prompts_fit(
    builder: TurnBuilder, samples: Sequence[Sample], cfg: JarlConfig, key: str
) -> None:
    """Each prompt of ``key``'s rows, rendered with the tool schemas, leaves room for a
    response."""
    lengths = []
    for sample in samples:
        try:
            lengths.append(len(builder.prompt_ids(sample.messages)))
        except ChatTemplateError as e:
            raise ConfigError(
                f"{key}={getattr(cfg.data, key.removeprefix('data.'))!r}: the chat template "
                "cannot render the prompt of "
                f"{sample.uid!r}: {e}"
            ) from None
    longest, limit = max(lengths), cfg.engine.max_model_len
    if longest >= limit:
        raise ConfigError(
            f"engine.max_model_len={limit} leaves no room for a response: a prompt of "
            f"{key} is {longest} tokens with the tool schemas; use engine.max_model_len "
            f"> {longest}"
        )


def _demonstrations(path: str, builder: TurnBuilder) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"sft.data={path!r} does not exist")
    try:
        demos = load_demonstrations(path, builder, limit=ROWS)
    except ValueError as e:
        raise ConfigError(f"sft.data={path!r}: {str(e).removeprefix(f'{path}: ')}") from None
    if not demos:
        raise ConfigError(f'sft.data={path!r} has no rows: expected JSONL of {{"messages": [...]}}')
