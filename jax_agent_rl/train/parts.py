"""The parts of a run, each made from the config it reads by one function that writes no file,
reads no weights and compiles nothing: the reward, the checkpoint's model, the tokenizer, the
model the run trains, the prompts, the environments, the tools and the mesh.

`build_run` (`train.build`) composes them, then writes the run folder and loads the weights
(`run_policy`); the pre-run check (`train.check`) calls the same functions, on the first rows
of each data file, and collects every problem instead of stopping at the first. A problem is a
`ConfigError` of one line naming the key, its value and what would be accepted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax

from jax_agent_rl.agent.loop import AGENT_LOOPS
from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import ConfigError, JarlConfig, ModelSection
from jax_agent_rl.data.datasets import SUFFIXES, DatasetError, load_samples
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, Environments
from jax_agent_rl.models import ModelConfig, Policy, Sharder, make_mesh, policy_of
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train.learners import run_model
from jax_agent_rl.train.run_policy import module_policy


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's words."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def check_reward(cfg: JarlConfig) -> None:
    """``data.reward`` (and ``data.rewards_by_source``) load: user reward functions fail here."""
    try:
        make_reward(cfg.data)
    except ConfigError:
        raise
    except Exception as e:  # a user's reward module runs here: whatever it raises is the config's
        raise ConfigError(
            f"data.reward={cfg.data.reward!r} (or data.rewards_by_source) failed to load: "
            f"{one_line(e)}"
        ) from None


def checkpoint_model(path: str) -> ModelConfig:
    """The `ModelConfig` of the HF checkpoint folder ``path`` (``model.path``): its
    ``config.json``, with weight files beside it."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"model.path={path!r} {what}: expected an HF checkpoint folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.path={path!r} has no config.json: expected an HF checkpoint folder "
            "(config.json, model.safetensors or its index, the tokenizer)"
        )
    try:
        model = ModelConfig.from_pretrained(folder)
    except (ValueError, KeyError) as e:  # UnsupportedConfigError, bad JSON, a missing field
        raise ConfigError(f"model.path={path!r}: config.json: {one_line(e)}") from None
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any((folder / name).is_file() for name in weights):
        raise ConfigError(f"model.path={path!r} has no weights: expected {' or '.join(weights)}")
    return model


def tokenizer_source(section: ModelSection) -> tuple[str, str]:
    """(key, folder) of the tokenizer: model.tokenizer, else the checkpoint folder."""
    if section.tokenizer:
        return "model.tokenizer", section.tokenizer
    return "model.path", section.path


def run_tokenizer(section: ModelSection, checkpoint: ModelConfig | None) -> Tokenizer:
    """The run's tokenizer (`tokenizer_source`); with the ``checkpoint``'s model, one whose
    vocabulary fits the model's."""
    key, folder = tokenizer_source(section)
    if not (Path(folder) / "tokenizer.json").is_file():
        raise ConfigError(
            f"{key}={folder!r} has no tokenizer.json: expected a tokenizer folder "
            "(tokenizer.json, tokenizer_config.json with the chat template)"
        )
    try:
        tokenizer = Tokenizer.from_pretrained(folder)
    except Exception as e:  # the tokenizers library raises plain Exceptions on a bad file
        raise ConfigError(f"{key}={folder!r}: cannot load the tokenizer: {one_line(e)}") from None
    if checkpoint is not None and tokenizer.vocab_size > checkpoint.vocab_size:
        raise ConfigError(
            f"{key}={folder!r}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's vocab_size={checkpoint.vocab_size}: use the checkpoint's own tokenizer"
        )
    return tokenizer


def lora_model(cfg: JarlConfig, checkpoint: ModelConfig) -> Policy:
    """The policy a run of an HF checkpoint trains: the checkpoint family's, with
    ``model.lora``'s adapters (`learners.run_model`); adapters the model cannot carry (a MoE's
    expert MLPs, a family without adapters), or not the adapter folder's, are the problem."""
    try:
        return policy_of(run_model(cfg, checkpoint))
    except ValueError as e:
        raise ConfigError(f"model.lora: {e}") from None


def custom_policy(cfg: JarlConfig, tokenizer: Tokenizer) -> Policy:
    """The custom policy ``model.module`` names (`run_policy.module_policy`)."""
    try:
        return module_policy(cfg, tokenizer)
    except ConfigError as e:
        raise ConfigError(one_line(e)) from None
    except Exception as e:  # a user's module runs here: whatever it raises is the config's
        raise ConfigError(f"model.module={cfg.model.module!r} failed: {one_line(e)}") from None


def prompt_samples(
    key: str, path: str, default_agent: str, limit: int | None = None
) -> list[Sample]:
    """The prompt rows of the data file (or ``reasoning_gym:`` set) ``key`` names, the first
    ``limit`` of them if given; at least one."""
    if path.startswith("reasoning_gym:"):
        try:
            return load_samples(path, agents=AGENT_LOOPS, default_agent=default_agent, limit=limit)
        except DatasetError as e:
            raise ConfigError(f"{key}: {e}") from None
    if not Path(path).exists():
        raise ConfigError(f"{key}={path!r} does not exist")
    if Path(path).suffix not in SUFFIXES:
        raise ConfigError(f"{key}={path!r}: expected a .jsonl or .parquet file")
    try:
        samples = load_samples(path, agents=AGENT_LOOPS, default_agent=default_agent, limit=limit)
    except DatasetError as e:
        raise ConfigError(f"{key}={path!r}: {str(e).removeprefix(f'{Path(path)}: ')}") from None
    if not samples:
        raise ConfigError(f"{key}={path!r} has no rows: expected at least one prompt")
    return samples


def held_out_samples(cfg: JarlConfig) -> list[Sample]:
    """The first ``data.val_size`` rows of ``data.val`` (all of them for 0; none without a file)."""
    if not cfg.data.val:
        return []
    default = cfg.agent.default_agent_loop
    return prompt_samples("data.val", cfg.data.val, default, limit=cfg.data.val_size or None)


def check_environments(envs: Environments, samples: Sequence[Sample], key: str) -> None:
    """Every environment ``samples`` name exists (an ``env_class``; an interaction the
    interaction YAML lists), and plays a loop that drives environments (tool_agent,
    single_turn_agent): a `ConfigError` naming the first that does not."""
    for s in samples:
        if not envs.plays(s):
            continue
        if not s.env_class and envs.interaction is not None:  # a verl interaction's row
            try:
                envs.interaction(s)
            except EnvError as e:
                raise ConfigError(f"{key}: {e}") from None
        if s.agent_name not in ("tool_agent", "single_turn_agent"):  # not react/openai_agent
            raise ConfigError(
                f"{key}: row {s.uid!r} has an environment but agent_name {s.agent_name!r}; "
                "environments are played by tool_agent and single_turn_agent"
            )
        if s.env_class:
            try:
                envs.factory(s.env_class)
            except KeyError as e:
                raise ConfigError(f"{key}: row {s.uid!r}: {e.args[0]}") from None


def tool_registry(path: str) -> ToolRegistry:
    """The tools of ``tools.config``, built (the caller closes them)."""
    if not Path(path).is_file():
        raise ConfigError(f"tools.config={path!r} does not exist: expected a tools YAML")
    try:
        return ToolRegistry.from_yaml(path)
    except Exception as e:  # the file names any class with any arguments: its failure is ours
        raise ConfigError(f"tools.config={path!r}: {one_line(e)}") from None


def run_sharder(cfg: JarlConfig) -> Sharder:
    """The run's mesh (``mesh.*``) over the first devices of every process, in order."""
    n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    if n > jax.device_count():
        raise ValueError(f"mesh needs {n} devices, the run sees {jax.device_count()}")
    if jax.process_count() > 1 and n != jax.device_count():
        raise ValueError(
            f"mesh has {n} devices but the {jax.process_count()} processes have "
            f"{jax.device_count()}: a multi-process mesh spans them all"
        )
    devices = distributed.ordered_devices()[:n]
    return Sharder(make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices))


def policy_and_tokenizer(cfg: JarlConfig) -> tuple[Policy, Tokenizer]:
    """The policy a run trains and its tokenizer: the checkpoint's decoder
    (`checkpoint_model`, `lora_model`), or the custom policy, made for the tokenizer
    (`custom_policy`)."""
    if cfg.model.module:
        tokenizer = run_tokenizer(cfg.model, None)
        return custom_policy(cfg, tokenizer), tokenizer
    checkpoint = checkpoint_model(cfg.model.path)
    return lora_model(cfg, checkpoint), run_tokenizer(cfg.model, checkpoint)
