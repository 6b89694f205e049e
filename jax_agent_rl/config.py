"""Typed run configuration: frozen dataclasses per concern, filled from YAML plus dotted overrides.

A YAML file only fills in these dataclasses (OmegaConf structured configs do the merging and
type checks). An unknown or misspelled key, a value of the wrong type or outside a ``Literal``
is a `ConfigError` naming the full dotted key and the keys allowed there::

    cfg = load_config("configs/demo.yaml", ["model.dtype=bfloat16", "mesh.fsdp=2"])

Every number is then checked against its range (`RANGES`: steps >= 0, temperature >= 0, top_p in
(0, 1], ...) and against the values it must fit (`check_ranges`: micro-batches split over the
mesh, ...), so every command refuses a bad value, not only ``jarl train``; all such problems
are reported at once, one line each.

Paths. A relative path in a config (a YAML file or an override) is relative to the current
directory, as on verl's and Hydra's command lines, wherever the YAML file lies. A value
``pkg://<package>/<path>`` names a file inside an installed Python package and is replaced by
that file's path when the config loads, so files shipped with the project work from any
directory: the default ``tools.config`` is ``pkg://jax_agent_rl/configs/tools_default.yaml``.
A run folder's ``config.yaml`` holds every path absolute (`absolute_paths`, against the
directory the run started in), so ``jarl export RUN``, ``jarl eval RUN``, ``jarl traces RUN``
and a resume from ``RUN/config.yaml`` work from any directory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to load and how to compute with it."""

    path: str = "???"  # a local HF checkpoint folder (config.json + safetensors)
    tokenizer: str = ""  # a tokenizer folder; empty: the checkpoint folder
    # compute dtype of the learner and the rollout engine; the learner's master weights and
    # optimizer state are always float32
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The learner's device mesh over the first data * fsdp * tensor devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class RaySection:
    """Rollout replicas as Ray actors across a cluster (`jax_agent_rl.rollout.ray_pool`);
    off while ``address`` is empty. Each replica is one ``rollout.backend`` engine, placed
    through a placement group of one bundle per replica."""

    # "": no Ray (the backend runs here); "auto": the cluster this machine belongs to;
    # "local": start a one-node cluster on this machine; else the head's HOST:PORT
    address: str = ""
    replicas: int = 2
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica (a vLLM engine: its GPUs)
    resources: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. {TPU: 4}
    # how the replicas' bundles spread over the nodes (Ray's placement group strategies)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    max_restarts: int = 3  # per replica (and per tool server); one that dies more often stays down
    # tool servers (`jarl serve-tools` of tools.config) as actors, spread over the nodes; the
    # rollout's tool calls go to them (a trajectory stays on one); 0: tools run in-process
    tool_servers: int = 0
    tool_server_cpus: float = 1.0  # per tool server
    start_timeout_s: float = 600.0  # placing and starting the replicas (compiles included)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """The inference backend and how it samples."""

    backend: str = (
        "embedded"  # a registered backend: embedded, vllm, jetstream (rollout/registry.py)
    )
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_model_len: int = 1024  # prompt + response tokens
    max_concurrent: int = 64  # sequences decoded together (engine slots)
    # embedded / jetstream: the KV cache is a pool of pages of this many positions, handed
    # out by real length and shared between sequences with a common prefix
    page_size: int = 32
    # the pool's size in GiB (keys and values, all layers, over all the engine's devices);
    # 0: enough for max_concurrent sequences of max_model_len (a dense cache's memory)
    kv_cache_gib: float = 0.0
    prefill_chunk: int = 512  # a longer prompt is prefilled in chunks between decode steps
    steps_per_call: int = 4  # decode steps per engine call (embedded and jetstream backends)
    # embedded: a decode step computes only the slots in use (rounded up to a power of two);
    # false: always all max_concurrent, so that no number depends on how requests happened
    # to share a batch (XLA:CPU's matmuls round differently by row count; bitwise-reproducible
    # runs, slower when few slots are busy)
    batch_buckets: bool = True
    replicas: int = 1  # engine processes (vllm backend)
    vllm_python: str = ""  # the vLLM venv's interpreter; empty: the repo's .venv-vllm/bin/python
    vllm_devices: str = ""  # CUDA devices of the vllm replicas, one each ("2,3"); empty: inherit
    vllm_kv_cache_mb: int = 0  # KV cache of each vllm replica; 0: vLLM's share of free memory
    jetstream_python: str = ""  # the JetStream venv's interpreter; empty: .venv-jetstream's
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refills: int = 3  # extra rollouts of fresh prompts per step, at most
    # an episode whose tool service failed (stop reason tool_error: a dead tool server) is run
    # again from its prompt, up to this many times; 0: it stays failed (masked, counted)
    tool_failure_reruns: int = 1
    ray: RaySection = dataclasses.field(default_factory=RaySection)


@dataclasses.dataclass(frozen=True)
class TreeSection:
    """A tree rollout's shape and per-prompt budget (agent.strategy=tree; agent/tree.py)."""

    n_roots: int = 2  # episodes started per prompt
    branch: int = 2  # an episode that branches goes on as this many (itself and copies)
    depth: int = 2  # turn boundaries at which an episode branches, at most
    # per prompt, over the whole tree; 0: what rollout.n chain episodes could use at most
    # (n x agent.max_response_tokens model tokens, n x agent.max_turns tool calls)
    model_tokens: int = 0
    tool_calls: int = 0


@dataclasses.dataclass(frozen=True)
class AgentSection:
    """Budgets of one episode and how tool calls are written."""

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_response_tokens: int = 768  # model + tool tokens after the prompt
    max_tool_response_tokens: int = 256  # per tool result, before templating
    tool_response_truncate: Literal["left", "right", "middle"] = "right"  # which end to keep
    parser: str = "hermes"  # hermes | llama3_json | python_tag | tool_tag | fenced_python
    # the loop of a data row that names no agent_name: single_turn_agent (one model turn, no
    # tool runs), as verl's actor_rollout_ref.rollout.agent.default_agent_loop; tool_agent for
    # tool calls and interactions over many turns. Rows in SkyRL's layout (an env_class) run
    # tool_agent, as SkyRL's generator does
    default_agent_loop: str = "single_turn_agent"
    # tool calls one trajectory runs at once (a turn can hold dozens); its other calls wait
    # for these, so one trajectory cannot take every tool worker from its siblings
    max_parallel_tool_calls: int = 4
    # the LangGraph graph of agent_name react_agent (agent/langgraph_loop.py, the `agents`
    # extra): package.module:function or path/to/file.py:function, given (chat_model, tools),
    # returning a compiled graph over MessagesState; empty: the default ReAct graph
    graph: str = ""
    # the harness of agent_name openai_agent (agent/openai_endpoint.py, the `harness` extra):
    # package.module:function or path/to/file.py:function, an async function given a
    # HarnessTask (the endpoint's base_url and api_key, the prompt, the tools) that drives one
    # episode through /v1/chat/completions; empty: no harness (openai_agent refuses to run)
    harness: str = ""
    # episodes to leave out of updates, counted as filter/<name> (agent/filters.py):
    # void_turn, overlong, tool_error, repetition, equal_reward (list it last)
    filters: list[str] = dataclasses.field(default_factory=list)
    # how a prompt's group is sampled: chain (rollout.n independent episodes) or tree
    # (episodes branching after tool observations, within a per-prompt budget: agent.tree)
    strategy: Literal["chain", "tree"] = "chain"
    tree: TreeSection = dataclasses.field(default_factory=TreeSection)


@dataclasses.dataclass(frozen=True)
class ToolsSection:
    """Where the tools come from."""

    # a tool registry YAML (see jarl serve-tools); the default (calculator + sandboxed python)
    # ships inside the package
    config: str = "pkg://jax_agent_rl/configs/tools_default.yaml"
    server_url: str = ""  # a running `jarl serve-tools`; empty: tools run in-process
    # the name of an environment variable holding the server's bearer token (the token
    # itself stays out of the YAML and of the run folder's config.yaml); empty: no token
    token_env: str = ""
    timeout_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class ToolServerSection:
    """The tool server's settings (`jax_agent_rl.tools.server`): the one definition of their
    defaults, which ``jarl serve-tools``, `create_app`, `serve` and the Ray tool servers read."""

    host: str = "127.0.0.1"  # the address to listen on; a non-loopback one needs a token
    port: int = 8765  # the port to listen on
    max_concurrency: int = 64  # calls running at once (and in flight per socket connection)
    timeout_s: float = 30.0  # seconds per call; a slower call is an error result
    # seconds after a trajectory's last call ends before its tool state is released
    idle_timeout_s: float = 600.0
    max_trajectories: int = 10_000  # trajectories holding tool state at once
    max_body_bytes: int = 8 * 2**20  # the largest request body (or socket frame); larger: 413
    body_timeout_s: float = 10.0  # seconds to receive a whole body (or frame); slower: 408
    max_id_bytes: int = 256  # the largest trajectory id, in UTF-8 bytes
    # calls of one /execute_batch and trajectories of one /get_observation
    max_batch_calls: int = 1024
    max_action_calls: int = 32  # tool calls of one verl-tool action
    max_connections: int = 512  # open connections at which a new request gets 503
    action_parser: str = "hermes"  # the parser that reads verl-tool's actions


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Environments that answer model turns (`jax_agent_rl.envs`), picked per row by its
    ``env_class`` (SkyRL's column) or verl's ``extra_info.interaction_kwargs.name``."""

    # env_class -> a class, package.module:Class or path/to/file.py:Class: a skyrl-gym Env
    # (made as SkyRL makes it) or a function of the sample returning an Environment. A row's
    # env_class not listed here names an id registered with skyrl-gym (gsm8k, ...)
    classes: dict[str, str] = dataclasses.field(default_factory=dict)
    # env_class -> the env_config a skyrl-gym environment is made with (SkyRL's
    # environment.skyrl_gym.<env_class>)
    config: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # verl's interaction config YAML (interaction: [{name, class_name, config}]); empty: none
    interaction_config: str = ""
    step_timeout_s: float = 60.0  # an environment call past it ends its episode (env_error)


@dataclasses.dataclass(frozen=True)
class JudgeSection:
    """A model as the reward (`jax_agent_rl.rewards.judge`), used by rows whose reward is
    ``judge`` (``data.reward=judge`` or an entry of ``data.rewards_by_source``). The judge reads
    ``template`` filled in, as one user message of its tokenizer's chat template, answers
    (greedy by default) and its last number matching ``score_pattern`` is the score. A judge
    call that fails (no score in its answer, a score outside [0, score_max], an error, a
    timeout) gives ``fallback`` and is counted (``reward/judge_failures``); it never fails a
    step."""

    # policy: the rollout backend under training (the judge sees the current weights); else
    # a registered rollout backend (embedded, vllm, ...) started beside it from model_path,
    # with rollout.*'s engine settings and max_concurrency slots
    backend: str = "policy"
    model_path: str = ""  # the separate judge's HF checkpoint folder (and its tokenizer)
    # a Python format string: {prompt} (the row's last user message), {response} (the final
    # answer), {ground_truth} (the row's, as text); literal braces are doubled
    template: str = (
        "Rate the response to the question from 0 (wrong or unhelpful) to 10 (correct and "
        "helpful).\nQuestion: {prompt}\nReference answer: {ground_truth}\nResponse: "
        "{response}\nReply with the rating, a number from 0 to 10."
    )
    # the score: the last match in the judge's answer (its first group if it has one)
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    score_max: float = 10.0  # a score in [0, score_max] is divided by it: rewards in [0, 1]
    fallback: float = 0.0  # the reward of an answer whose judge call failed
    max_concurrency: int = 16  # judge requests in flight at once (a step's go together)
    max_tokens: int = 32  # of the judge's answer
    temperature: float = 0.0  # 0: greedy
    timeout_s: float = 60.0  # per judge request, waiting for a free slot excluded
    # remember each judged (prompt, response, ground truth)'s score for the rest of the run
    # (in memory, the newest cache_size kept): the same answer is judged once
    cache: bool = True
    cache_size: int = 65536


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts (jsonl or parquet in verl's column layout) and their reward.

    A reward is a built-in name (verl's rules ``verl_gsm8k``, ``verl_math``, ``verl_dapo``,
    ``verl_qa_em``; ours ``math``, ``gsm8k_lenient``, ``format``, ``reasoning_gym``; ``judge``)
    or a user function, ``package.module:function`` or ``path/to/file.py:function``, taking
    ``(text, ground_truth)`` or verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info)`` (see `jax_agent_rl.rewards.registry`). A row is scored as verl picks: by its
    ``data_source``'s entry in ``rewards_by_source`` if it has one, else by ``reward`` if set
    (it overrides every other source, as verl's ``custom_reward_function`` does), else by
    source: verl's own rule for the sources verl's ``default_compute_score`` knows (so verl's
    data is scored as verl scores it, on the whole decoded response), the task's scorer for
    reasoning-gym rows, ``math`` for the rest. An empty entry in ``rewards_by_source`` is an
    error (it would leave open whether ``reward`` or the source's default applies).
    """

    train: str = "???"
    val: str = ""  # held-out prompts for evaluation; empty: no evaluation
    prompts_per_step: int = 16
    val_size: int = 0  # 0: the whole validation file
    reward: str = ""  # every row not in rewards_by_source; empty: by data_source (above)
    rewards_by_source: dict[str, str] = dataclasses.field(default_factory=dict)
    # the tool rewards of an episode (`ToolResult.reward` of every call), summed, are added to
    # its reward times this weight. 0 is what verl does: the reward function's score is the
    # reward, and a function of verl's signature reads the tool rewards, if it wants them, from
    # extra_info["tool_rewards"] (passed whatever this weight is)
    tool_reward_weight: float = 0.0
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N response tokens
    overlong_penalty: float = 1.0  # the penalty at the budget, scaled linearly over the buffer
    judge: JudgeSection = dataclasses.field(default_factory=JudgeSection)  # reward ``judge``


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """The RL objective: advantages and loss, every value static in the compiled training step
    (what to sample and how to shape rewards live in ``rollout`` and ``data``). GRPO:
    adv_estimator=grpo. Dr.GRPO: norm_adv_by_std=false with
    loss_agg_mode=seq-mean-token-sum-norm. DAPO: clip_high=0.28, loss_agg_mode=token-mean, with
    rollout.dynamic_sampling=true and data.overlong_buffer>0. PPO: adv_estimator=gae (adds a
    critic)."""

    adv_estimator: Literal["grpo", "gae"] = "grpo"
    norm_adv_by_std: bool = True  # GRPO divides by the group's std; Dr.GRPO does not
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    clip_c: float | None = 3.0  # dual clip for negative advantages; null: off
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    kl_coef: float = 0.0  # KL(policy || reference) in the loss; 0 keeps no reference model
    kl_kind: Literal["k1", "abs", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = 2.0  # truncated importance weights rollout -> learner; null: off
    # truncate: weight min(w, tis_cap); mask: weight w within [1/tis_cap, tis_cap], else the
    # token is dropped (masked IS: for stale data, trainer.mode=async; docs/async.md)
    tis_mode: Literal["truncate", "mask"] = "truncate"
    gamma: float = 1.0  # GAE (PPO)
    lam: float = 1.0
    vf_clip: float = 0.5
    # trajectory: one training row per episode; per_turn: one per model turn, its prompt the
    # token-exact prefix, its loss on that turn only, the episode's advantage shared
    # (GRPO's group statistics count each episode once: rl/core.py grpo_advantages)
    turn_mode: Literal["trajectory", "per_turn"] = "trajectory"
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW with warmup; fp32 state."""

    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class LearnerSection:
    """How a train step is laid out."""

    # packing on: each device's micro-batch is one row of `row_tokens` tokens holding as many
    # whole trajectories as fit (first-fit decreasing; verl's ppo_max_token_len_per_gpu). A
    # longer trajectory makes that step's rows the smallest row_tokens * 2**k holding it.
    packing: bool = True
    row_tokens: int = 4096
    # packing off: micro-batches of this many rows, one trajectory per row, padded to the
    # step's longest rounded up to seq_bucket * 2**k (also the SFT warm start's layout)
    micro_batch_size: int = 8  # sequences per forward/backward (gradients accumulate)
    seq_bucket: int = 64
    remat: bool = False  # recompute layer activations in the backward pass


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """An optional supervised warm start on demonstrations (jsonl rows with ``messages``)."""

    data: str = ""  # empty: no SFT stage
    steps: int = 0
    batch_size: int = 32
    lr: float = 1e-3  # peak; cosine-decayed to 0 over the steps
    warmup_steps: int = 20


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The outer loop: steps, evaluation, checkpoints, logs."""

    steps: int = 100
    seed: int = 0
    # sync: each step rolls out, then updates, then pushes. async: rollouts run on while the
    # learner updates (train/async_loop.py), every update taking only trajectories sampled
    # at most max_staleness weight versions behind the policy it updates (0: the sync loop)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    run_dir: str = "runs/latest"
    eval_every: int = 10  # 0: only at the start and the end
    save_every: int = 10  # orbax checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the run folder's last complete checkpoint
    traces_per_step: int = 4  # trajectories written to traces.jsonl each step
    # jsonl: traces.jsonl only (`jarl traces`). mlflow: also each of them as an MLflow trace
    # (a span per turn and per tool message) in <run_dir>/mlflow.db, for the MLflow UI
    # (`jarl traces RUN --mlflow`; needs the traces extra: train/mlflow_traces.py)
    trace_backend: Literal["jsonl", "mlflow"] = "jsonl"
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class JarlConfig:
    """The whole run configuration."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    agent: AgentSection = dataclasses.field(default_factory=AgentSection)
    tools: ToolsSection = dataclasses.field(default_factory=ToolsSection)
    env: EnvSection = dataclasses.field(default_factory=EnvSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    learner: LearnerSection = dataclasses.field(default_factory=LearnerSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    schema: type[T] = JarlConfig,  # type: ignore[assignment]
) -> T:
    """Loads ``schema`` from a YAML file (optional), then ``key.sub=value`` overrides in order;
    ``pkg://`` paths are resolved, and a `JarlConfig`'s numbers are checked (`check_ranges`)."""
    merged = _merged(path, overrides, schema)
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        settings = " ".join(f"{key}=..." for key in missing)
        raise ConfigError(
            f"required config keys not set: {missing}; set them in the YAML or as overrides "
            f"({settings})"
        )
    return _checked(merged, schema)


class Preview(NamedTuple):
    """A config as `preview_config` shows it: its YAML, the required keys still unset marked."""

    yaml: str
    missing: list[str]  # required keys not set, dotted


def preview_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    schema: type[T] = JarlConfig,  # type: ignore[assignment]
) -> Preview:
    """As `load_config`, but a required key left unset is shown, not refused: its line reads
    ``key: ???  # required: set a.b.key=...``. Every other value is checked as it loads."""
    merged = _merged(path, overrides, schema)
    missing = sorted(OmegaConf.missing_keys(merged))
    # required keys are strings; "" passes their checks
    unset = OmegaConf.from_dotlist([f"{key}=''" for key in missing])
    lines = to_yaml(_checked(OmegaConf.merge(merged, unset), schema)).splitlines()
    for i, key in _key_lines(lines):
        if key in missing:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            name = key.rpartition(".")[2]
            lines[i] = f"{indent}{name}: ???  # required: set {key}=..."
    return Preview("".join(f"{line}\n" for line in lines), missing)


def _key_lines(lines: Sequence[str]) -> list[tuple[int, str]]:
    """(line number, dotted key) of every ``key:`` line of block YAML indented by two spaces
    per level, as `to_yaml` writes it."""
    out: list[tuple[int, str]] = []
    parents: list[str] = []
    for i, line in enumerate(lines):
        name, colon, _ = line.strip().partition(":")
        if not colon or line.lstrip().startswith("- "):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        parents[depth:] = [name]
        out.append((i, ".".join(parents)))
    return out


def _merged(path: str | Path | None, overrides: Sequence[str], schema: type) -> Any:
    """The schema's defaults, the YAML file's values and then the overrides, merged (missing
    values left missing); every problem a one-line `ConfigError`."""
    layers = [] if path is None else [_read_yaml(Path(path))]
    # Hydra's +key=v / ++key=v (add / force) set the key as key=v does: every key exists here
    overrides = [item.lstrip("+") for item in overrides]
    for item in overrides:
        if item.startswith("~"):
            raise ConfigError(
                f"override {_shown(item)}: Hydra's ~key (delete) has nothing to do here: every "
                "key has a default; drop it"
            )
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, _, value = item.partition("=")
        if not all(key.split(".")):
            raise ConfigError(f"override {_shown(item)}: {key!r} is not a dotted key (a.b.c)")
        if key.count(".") >= MAX_DEPTH:
            raise ConfigError(f"override {_shown(key)}: nested deeper than {MAX_DEPTH} levels")
        _yaml_top(value, f"override {key}")
    if schema is JarlConfig:  # verl's spellings of its keys (docs/verl.md)
        overrides = _verl_overrides(overrides, OmegaConf.structured(schema), layers)
    # `key=` means the empty string (OmegaConf would read it as null)
    dotlist = [f"{item}''" if item.endswith("=") else item for item in overrides]
    try:
        layers.append(OmegaConf.from_dotlist(dotlist))
        for layer in layers:
            _check_sections(schema, layer)
        return OmegaConf.merge(OmegaConf.structured(schema), *layers)
    except ConfigKeyError as e:
        key = _full_key(e)
        if key in RENAMED:
            raise ConfigError(f"config key {key!r} is now {RENAMED[key]!r}") from None
        from jax_agent_rl.verl_keys import VERL_SECTIONS  # verl_keys -> config

        if key.split(".")[0] in ("defaults", *VERL_SECTIONS):
            raise ConfigError(
                f"unknown config key {key!r}: a verl (Hydra) config file? jarl reads verl's "
                "keys as command-line overrides only; start from a jarl config (docs/verl.md)"
            ) from None
        verl = "; a verl key? docs/verl.md" if key.split(".")[0] in _VERL_SHARED else ""
        raise ConfigError(
            f"unknown config key {key!r}; allowed here: {_allowed_keys(schema, key)}{verl}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(_bad_value(schema, e)) from None


# jarl's sections that verl's config has too: an unknown key there may be a verl key
_VERL_SHARED = ("data", "trainer", "algorithm")


def _check_sections(schema: Any, layer: Any, prefix: str = "") -> None:
    """Each section of ``schema`` that ``layer`` sets is a mapping (OmegaConf's own error for
    ``model: 5`` names no key)."""
    hints = typing.get_type_hints(schema)
    for name, value in layer.items_ex(resolve=False) if OmegaConf.is_dict(layer) else ():
        hint = hints.get(name)
        if not dataclasses.is_dataclass(hint):
            continue
        if not OmegaConf.is_dict(value):
            shown = _shown(str(value))
            raise ConfigError(f"{prefix}{name}={shown}: expected a section (key: value lines)")
        _check_sections(hint, value, f"{prefix}{name}.")


def _checked(merged: Any, schema: type[T]) -> T:
    """The dataclass of a merged config with every value set, ``pkg://`` paths resolved and
    (a `JarlConfig`) its numbers checked."""
    try:
        cfg: Any = OmegaConf.to_object(merged)
        OmegaConf.structured(cfg)  # a container where a mapping's value must be a string, ...
    except OmegaConfBaseException as e:
        raise ConfigError(_bad_value(schema, e)) from None
    cfg = _resolve_packaged(cfg)
    problems = check_ranges(cfg) if isinstance(cfg, JarlConfig) else []
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def _verl_overrides(overrides: Sequence[str], base: Any, layers: Sequence[Any]) -> list[str]:
    """`jax_agent_rl.verl_keys.to_jarl` over the config before the overrides, each verl key's
    jarl key told on stderr."""
    from jax_agent_rl.verl_keys import to_jarl  # verl_keys -> config

    @functools.cache  # merged only if a conversion reads a value
    def config() -> Any:
        try:
            return OmegaConf.merge(base, *layers)
        except OmegaConfBaseException:  # a bad YAML file: `load_config` says why when it merges
            return base

    return to_jarl(
        overrides,
        lambda key: OmegaConf.select(config(), key, throw_on_missing=False),
        lambda line: print(line, file=sys.stderr),
    )


# keys that moved, old -> new, so an old config names what to write instead
RENAMED = {
    "algorithm.dynamic_sampling": "rollout.dynamic_sampling",
    "algorithm.max_refills": "rollout.max_refills",
    "algorithm.overlong_buffer": "data.overlong_buffer",
    "algorithm.overlong_penalty": "data.overlong_penalty",
}


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (for run folders and ``--dry-run``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _full_key(e: OmegaConfBaseException) -> str:
    for key in (getattr(e, "full_key", None), getattr(e, "key", None)):
        if key:
            return str(key)
    return "<root>"


def _bad_value(schema: type, e: OmegaConfBaseException) -> str:
    """One line for a value OmegaConf refused: the key, the value and what the key takes."""
    key = _full_key(e)
    shown = _shown(str(getattr(e, "value", None)))
    expected = _expected(schema, key)
    if expected is None:  # not a typed field (a section given a value, ...): OmegaConf's words
        return f"bad value for config key {key!r}: {(e.msg or type(e).__name__).splitlines()[0]}"
    return f"{key}={shown}: expected {expected}"


def _shown(text: str, limit: int = 80) -> str:
    """``text`` quoted, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _expected(schema: type, dotted: str) -> str | None:
    """What the field ``dotted`` of ``schema`` takes, in words; None for no typed field."""
    hint: Any = schema
    for part in dotted.split("."):
        if typing.get_origin(hint) is dict:  # a mapping's entry: its value type
            hint = typing.get_args(hint)[1]
        elif dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        else:
            return None
    if hint is None:
        return None
    return "a section (key: value lines)" if dataclasses.is_dataclass(hint) else _describe(hint)


def _describe(hint: Any) -> str:
    """A field's type in words: "a whole number", "one of [...]", "a number or null", ..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return f"one of {list(args)}"
    if type(None) in args:
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    words = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}
    if hint in words:
        return words[hint]
    return {dict: "a mapping", list: "a list"}.get(typing.get_origin(hint), str(hint))


def _allowed_keys(schema: type, dotted: str) -> list[str]:
    """Field names of the dataclass that holds ``dotted``'s last part."""
    cls: Any = schema
    for part in dotted.split(".")[:-1]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            break
        inner = fields[part].default_factory
        if inner is dataclasses.MISSING or not dataclasses.is_dataclass(inner):
            break
        cls = inner
    return sorted(f.name for f in dataclasses.fields(cls))


# ----------------------------------------------------------------------------- run folders

# Keys whose value is a file or folder, and keys whose value may name a Python file
# (path/to/file.py:function), alone or as every value of a mapping.
PATH_KEYS = (
    "model.path",
    "model.tokenizer",
    "rollout.vllm_python",
    "rollout.jetstream_python",
    "tools.config",
    "env.interaction_config",
    "data.train",
    "data.val",
    "data.judge.model_path",
    "sft.data",
    "trainer.run_dir",
)
CODE_KEYS = ("agent.graph", "agent.harness", "data.reward")
CODE_MAP_KEYS = ("env.classes", "data.rewards_by_source")


def absolute_paths(cfg: JarlConfig, cwd: Path) -> JarlConfig:
    """``cfg`` with every relative path of it made absolute against ``cwd``, the directory they
    are relative to. A run folder's ``config.yaml`` holds this, so that the run's readers
    (export, eval, traces, a resume) work from any directory."""

    def code(spec: str) -> str:
        where, colon, name = spec.rpartition(":")
        return f"{_absolute(where, cwd)}:{name}" if colon and where.endswith(".py") else spec

    for key in PATH_KEYS:
        cfg = _with(cfg, key, _absolute(_get(cfg, key), cwd))
    for key in CODE_KEYS:
        cfg = _with(cfg, key, code(_get(cfg, key)))
    for key in CODE_MAP_KEYS:
        cfg = _with(cfg, key, {name: code(spec) for name, spec in _get(cfg, key).items()})
    return cfg


def missing_paths(cfg: JarlConfig, keys: Sequence[str]) -> list[str]:
    """For each of ``keys`` (`PATH_KEYS`) set to a path that does not exist, one line naming
    the key and the absolute path."""
    paths = [(key, _get(cfg, key)) for key in keys]
    return [
        f"{key}={str(Path(path).absolute())!r} does not exist"
        for key, path in paths
        if path and not Path(path).exists()
    ]


def _absolute(path: str, cwd: Path) -> str:
    return str(cwd / path) if path and not Path(path).is_absolute() else path


def _get(cfg: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)


def _with(cfg: T, dotted: str, value: Any) -> T:
    """``cfg`` with the field ``dotted`` (nested sections included) set to ``value``."""
    head, _, rest = dotted.partition(".")
    inner = value if not rest else _with(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: inner})  # type: ignore[type-var]


# ----------------------------------------------------------------------------- YAML text

# Nesting deeper than this is refused before OmegaConf sees it. The schema is three levels deep
# and its free-form values (env.config, rollout.ray.resources) a few more, while OmegaConf
# recurses through several Python frames per level and exhausts the interpreter's stack near
# 150 levels (a RecursionError, not a message).
MAX_DEPTH = 32


def _read_yaml(path: Path) -> Any:
    """The config file ``path`` as an OmegaConf mapping; a `ConfigError` naming the file if it
    is missing, no UTF-8 text, no single YAML document, nested deeper than `MAX_DEPTH`, or no
    mapping at its top level."""
    where = f"config file {path}"
    if path.is_dir():
        raise ConfigError(f"{where} is a folder: name a YAML file")
    if not path.is_file():
        shipped = Path(__file__).resolve().parents[1] / path  # configs/... of the checkout
        hint = f": did you mean {shipped}?" if shipped.is_file() and path != shipped else ""
        raise ConfigError(f"{where} does not exist{hint}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror}") from None
    top = _yaml_top(text, where)
    if top == "nothing":
        return OmegaConf.create({})
    if top != "mapping":
        raise ConfigError(
            f"{where} holds a {top} at its top level: expected a mapping of sections "
            "(model:, data:, ...)"
        )
    try:
        return OmegaConf.create(text)
    except yaml.YAMLError as e:  # what OmegaConf's loader adds: duplicate keys, ...
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {(e.msg or type(e).__name__).splitlines()[0]}") from None


def _yaml_top(text: str, where: str) -> str:
    """What the YAML ``text`` holds at its top level: mapping, list, scalar or nothing. A
    `ConfigError` (``where`` names the text) if it is no YAML, more than one document, or
    nested deeper than `MAX_DEPTH`. Reads the parser's events, which keeps no stack of its
    own, so no depth of nesting can exhaust the interpreter's."""
    top, depth, documents = "nothing", 0, 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    line = event.start_mark.line + 1
                    raise ConfigError(f"{where}: a second YAML document at line {line}")
            elif isinstance(event, yaml.NodeEvent) and depth == 0:
                kinds = {yaml.MappingStartEvent: "mapping", yaml.SequenceStartEvent: "list"}
                top = kinds.get(type(event), "scalar")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1
                    raise ConfigError(
                        f"{where}: nested deeper than {MAX_DEPTH} levels at line {line}"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    return top


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    if isinstance(e, yaml.reader.ReaderError):
        return f"invalid YAML: character {chr(e.character)!r} at offset {e.position} is not allowed"
    return f"invalid YAML: {' '.join(str(e).split())}"


# ----------------------------------------------------------------------------- packaged files

PACKAGE_SCHEME = "pkg://"


def package_file(value: str, key: str) -> str:
    """The path of ``pkg://<package>/<path>``: ``<path>`` inside the installed ``<package>``
    (whether or not the file exists: the reader says so). Other values are returned as they are.
    ``key`` names the setting in errors."""
    if not value.startswith(PACKAGE_SCHEME):
        return value
    package, _, inner = value.removeprefix(PACKAGE_SCHEME).partition("/")
    try:
        root = importlib.resources.files(package)
    except (ImportError, TypeError, ValueError):
        raise ConfigError(
            f"{key}={value!r}: no installed package {package!r}; expected "
            f"{PACKAGE_SCHEME}<package>/<path inside it>"
        ) from None
    return str(root.joinpath(inner))


def _resolve_packaged(cfg: T, prefix: str = "") -> T:
    """``cfg`` with every ``pkg://`` string of it (nested sections included) resolved."""
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value, key = getattr(cfg, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            changes[field.name] = _resolve_packaged(value, f"{key}.")
        elif isinstance(value, str) and value.startswith(PACKAGE_SCHEME):
            changes[field.name] = package_file(value, key)
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]


# ----------------------------------------------------------------------------- ranges


class Rule(NamedTuple):
    """What a number must satisfy, and how an error message says it."""

    ok: Callable[[Any], bool]
    accepted: str


def _interval(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> Rule:
    """``lo <= v <= hi`` (either end open). Infinity and NaN never pass."""

    def ok(v: Any) -> bool:
        above = lo < v if lo_open else lo <= v
        below = v < hi if hi_open or hi == math.inf else v <= hi
        return bool(above and below and math.isfinite(v))

    if hi == math.inf:
        return Rule(ok, f"{'>' if lo_open else '>='} {lo:g}")
    return Rule(ok, f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}")


def _or(value: Any, rule: Rule) -> Rule:
    """``value`` itself (an "off" setting), or what ``rule`` accepts."""
    shown = "null" if value is None else value
    return Rule(lambda v: v == value or rule.ok(v), f"{shown} or {rule.accepted}")


_COUNT = _interval(1)  # sizes and counts that must be at least one
_NATURAL = _interval(0)  # counts where 0 means none / off
_POSITIVE = _interval(0, lo_open=True)
_FRACTION = _interval(0, 1)
_BELOW_ONE = _interval(0, 1, hi_open=True)

# Every int and float field of JarlConfig (tests/test_config.py checks that none is missing).
RANGES: dict[str, Rule] = {
    "mesh.data": _COUNT,
    "mesh.fsdp": _COUNT,
    "mesh.tensor": _COUNT,
    "rollout.n": _COUNT,
    "rollout.temperature": _NATURAL,  # 0: greedy
    "rollout.top_p": _interval(0, 1, lo_open=True),
    "rollout.top_k": _or(-1, _COUNT),
    "rollout.max_model_len": _COUNT,
    "rollout.max_concurrent": _COUNT,
    "rollout.page_size": _COUNT,
    "rollout.kv_cache_gib": _NATURAL,  # 0: a dense cache's memory
    "rollout.prefill_chunk": _COUNT,
    "rollout.steps_per_call": _COUNT,
    "rollout.replicas": _COUNT,
    "rollout.vllm_kv_cache_mb": _NATURAL,
    "rollout.ray.replicas": _COUNT,
    "rollout.ray.num_cpus": _NATURAL,
    "rollout.ray.num_gpus": _NATURAL,
    "rollout.ray.max_restarts": _NATURAL,
    "rollout.ray.tool_servers": _NATURAL,
    "rollout.ray.tool_server_cpus": _NATURAL,
    "rollout.ray.start_timeout_s": _POSITIVE,  # 0: vLLM's share of free memory
    "agent.max_turns": _COUNT,
    "agent.max_tokens_per_turn": _COUNT,
    "agent.max_response_tokens": _COUNT,
    "agent.max_tool_response_tokens": _COUNT,
    "agent.max_parallel_tool_calls": _COUNT,
    "agent.tree.n_roots": _COUNT,
    "agent.tree.branch": _COUNT,
    "agent.tree.depth": _NATURAL,
    "agent.tree.model_tokens": _NATURAL,  # 0: rollout.n x agent.max_response_tokens
    "agent.tree.tool_calls": _NATURAL,  # 0: rollout.n x agent.max_turns
    "tools.timeout_s": _POSITIVE,
    "env.step_timeout_s": _POSITIVE,
    "data.prompts_per_step": _COUNT,
    "data.val_size": _NATURAL,  # 0: the whole file
    "data.tool_reward_weight": Rule(math.isfinite, "a finite number"),
    "algorithm.clip_low": _BELOW_ONE,
    "algorithm.clip_high": _NATURAL,
    "algorithm.clip_c": _or(None, _interval(1, lo_open=True)),
    "algorithm.kl_coef": _NATURAL,
    "algorithm.entropy_coef": _NATURAL,
    "algorithm.tis_cap": _or(None, _POSITIVE),
    "algorithm.gamma": _FRACTION,
    "algorithm.lam": _FRACTION,
    "algorithm.vf_clip": _POSITIVE,
    "algorithm.ppo_epochs": _COUNT,
    "algorithm.mini_batches": _COUNT,
    "rollout.max_refills": _NATURAL,
    "rollout.tool_failure_reruns": _NATURAL,
    "data.overlong_buffer": _NATURAL,
    "data.overlong_penalty": _NATURAL,
    "data.judge.score_max": _POSITIVE,
    "data.judge.fallback": Rule(math.isfinite, "a finite number"),
    "data.judge.max_concurrency": _COUNT,
    "data.judge.max_tokens": _COUNT,
    "data.judge.temperature": _NATURAL,  # 0: greedy
    "data.judge.timeout_s": _POSITIVE,
    "data.judge.cache_size": _COUNT,
    "optim.lr": _POSITIVE,
    "optim.critic_lr": _POSITIVE,
    "optim.weight_decay": _NATURAL,
    "optim.b1": _BELOW_ONE,
    "optim.b2": _BELOW_ONE,
    "optim.grad_clip": _POSITIVE,
    "optim.warmup_steps": _NATURAL,
    "learner.micro_batch_size": _COUNT,
    "learner.seq_bucket": _COUNT,
    "learner.row_tokens": _COUNT,
    "sft.steps": _NATURAL,  # 0: no SFT stage
    "sft.batch_size": _COUNT,
    "sft.lr": _POSITIVE,
    "sft.warmup_steps": _NATURAL,
    "trainer.steps": _NATURAL,  # 0: SFT and evaluation only
    "trainer.seed": _NATURAL,
    "trainer.max_staleness": _NATURAL,
    "trainer.eval_every": _NATURAL,  # 0: at the start and the end only
    "trainer.save_every": _COUNT,
    "trainer.keep_checkpoints": _COUNT,
    "trainer.traces_per_step": _NATURAL,
}


def check_ranges(cfg: JarlConfig) -> list[str]:
    """Every value outside its range (`RANGES`), one line each; when all are in range, every
    value that does not fit another (`_FIT_CHECKS`)."""
    problems = []
    for key, rule in RANGES.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        if not rule.ok(value):
            problems.append(f"{key}={value!r}: expected {rule.accepted}")
    if problems:
        return problems
    return [p for check in _FIT_CHECKS if (p := check(cfg)) is not None]


def _micro_batch_over_mesh(cfg: JarlConfig) -> str | None:
    dp, micro = cfg.mesh.data * cfg.mesh.fsdp, cfg.learner.micro_batch_size
    if micro % dp:
        return (
            f"learner.micro_batch_size={micro} does not split over mesh.data x mesh.fsdp = {dp} "
            f"devices: use a multiple of {dp}"
        )
    return None


def _sft_batch(cfg: JarlConfig) -> str | None:
    """SFT batches are split into micro-batches of min(sft.batch_size, micro_batch_size) rows."""
    if not cfg.sft.data or not cfg.sft.steps:
        return None
    dp, micro, batch = (
        cfg.mesh.data * cfg.mesh.fsdp,
        cfg.learner.micro_batch_size,
        cfg.sft.batch_size,
    )
    if batch % min(batch, micro) or min(batch, micro) % dp:
        return (
            f"sft.batch_size={batch} does not split into micro-batches of "
            f"learner.micro_batch_size={micro} over mesh.data x mesh.fsdp = {dp} devices: use a "
            f"multiple of {micro}, or a multiple of {dp} below {micro}"
        )
    return None


def _group_size(cfg: JarlConfig) -> str | None:
    if cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 1:
        return (
            "rollout.n=1: a GRPO group of one sample has zero advantage, nothing is learned; "
            "use rollout.n >= 2 (or algorithm.adv_estimator=gae)"
        )
    return None


def _masked_is(cfg: JarlConfig) -> str | None:
    cap, mode = cfg.algorithm.tis_cap, cfg.algorithm.tis_mode
    if mode == "mask" and (cap is None or cap <= 1):
        return (
            f"algorithm.tis_mode=mask with algorithm.tis_cap={cap}: masking keeps the tokens "
            "whose importance weight lies in [1/tis_cap, tis_cap]; use a tis_cap above 1"
        )
    return None


def _overlong_buffer(cfg: JarlConfig) -> str | None:
    buffer, budget = cfg.data.overlong_buffer, cfg.agent.max_response_tokens
    if buffer > budget:
        return (
            f"data.overlong_buffer={buffer} is longer than agent.max_response_tokens="
            f"{budget}: use 0 (off) to {budget}"
        )
    return None


def _backend(cfg: JarlConfig) -> str | None:
    from jax_agent_rl.rollout.registry import backend_names  # registry -> protocol -> engine

    names = backend_names()
    if cfg.rollout.backend not in names:
        return f"rollout.backend={cfg.rollout.backend!r}: expected one of {names}"
    return None


def _slots_over_mesh(cfg: JarlConfig) -> str | None:
    """The embedded engine serves on the inference mesh: slots split over data x fsdp."""
    dp, slots = cfg.mesh.data * cfg.mesh.fsdp, cfg.rollout.max_concurrent
    if cfg.rollout.backend == "embedded" and slots % dp:
        return (
            f"rollout.max_concurrent={slots} does not split over mesh.data x mesh.fsdp = {dp} "
            f"devices (the embedded engine's decode slots): use a multiple of {dp}"
        )
    return None


def _vllm_devices(cfg: JarlConfig) -> str | None:
    r = cfg.rollout
    devices = [d for d in r.vllm_devices.split(",") if d]
    if r.backend == "vllm" and devices and len(devices) != r.replicas:
        return (
            f"rollout.vllm_devices={r.vllm_devices!r} names {len(devices)} devices for "
            f"rollout.replicas={r.replicas}: give one per replica, or none"
        )
    return None


def _filters(cfg: JarlConfig) -> str | None:
    from jax_agent_rl.agent.filters import check_filters  # filters -> trajectory -> config

    return "\n".join(check_filters(cfg.agent.filters)) or None


def _tool_servers(cfg: JarlConfig) -> str | None:
    ray = cfg.rollout.ray
    if ray.tool_servers and not ray.address:
        return f"rollout.ray.tool_servers={ray.tool_servers} needs rollout.ray.address (a cluster)"
    if ray.tool_servers and cfg.tools.server_url:
        return (
            f"rollout.ray.tool_servers={ray.tool_servers} and tools.server_url="
            f"{cfg.tools.server_url!r} both say where tools run: set one"
        )
    return None


def _judge(cfg: JarlConfig) -> str | None:
    from jax_agent_rl.rollout.registry import backend_names  # registry -> protocol -> engine

    j = cfg.data.judge
    if j.backend != "policy" and not j.model_path:
        return f"data.judge.backend={j.backend!r} (a separate judge) needs data.judge.model_path"
    if j.backend == "policy" and j.model_path:
        return (
            f"data.judge.model_path={j.model_path!r} is read only by a separate judge: set "
            "data.judge.backend to a rollout backend (embedded, ...), or clear the path"
        )
    if j.backend != "policy" and j.backend not in backend_names():
        return (
            f"data.judge.backend={j.backend!r}: use policy or a registered rollout backend "
            f"{backend_names()}"
        )
    return None


_FIT_CHECKS: tuple[Callable[[JarlConfig], str | None], ...] = (
    _backend,
    _micro_batch_over_mesh,
    _slots_over_mesh,
    _sft_batch,
    _group_size,
    _overlong_buffer,
    _masked_is,
    _vllm_devices,
    _tool_servers,
    _filters,
    _judge,
)
