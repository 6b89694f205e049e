"""Typed run configuration: frozen dataclasses per concern, filled from YAML plus dotted overrides.

A YAML file only fills in these dataclasses (OmegaConf structured configs do the merging and
type checks). An unknown or misspelled key, a value of the wrong type or outside a ``Literal``
is a `ConfigError` naming the full dotted key and the keys allowed there::

    cfg = load_config("configs/demo.yaml", ["model.dtype=bfloat16", "mesh.fsdp=2"])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

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
class RolloutSection:
    """The inference backend and how it samples."""

    backend: Literal["embedded", "vllm"] = "embedded"
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_model_len: int = 1024  # prompt + response tokens
    max_concurrent: int = 64  # sequences decoded together (engine slots)
    steps_per_call: int = 4  # decode steps per engine call (embedded backend)
    replicas: int = 1  # engine processes (vllm backend)
    vllm_python: str = ""  # the vLLM venv's interpreter; empty: the repo's .venv-vllm/bin/python
    vllm_devices: str = ""  # CUDA devices of the vllm replicas, one each ("2,3"); empty: inherit


@dataclasses.dataclass(frozen=True)
class AgentSection:
    """Budgets of one episode and how tool calls are written."""

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_response_tokens: int = 768  # model + tool tokens after the prompt
    max_tool_response_tokens: int = 256
    parser: str = "hermes"  # hermes | llama3_json | python_tag | tool_tag | fenced_python


@dataclasses.dataclass(frozen=True)
class ToolsSection:
    """Where the tools come from."""

    config: str = "configs/tools_default.yaml"  # a tool registry YAML (see jarl serve-tools)
    server_url: str = ""  # a running `jarl serve-tools`; empty: tools run in-process
    timeout_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts (jsonl or parquet in verl's column layout) and their reward."""

    train: str = "???"
    val: str = ""  # held-out prompts for evaluation; empty: no evaluation
    prompts_per_step: int = 16
    val_size: int = 0  # 0: the whole validation file
    reward: str = "math"  # a name registered in jax_agent_rl.rewards


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """The RL objective. GRPO: adv_estimator=grpo. Dr.GRPO: norm_adv_by_std=false with
    loss_agg_mode=seq-mean-token-sum-norm. DAPO: clip_high=0.28, dynamic_sampling=true,
    overlong_buffer>0, loss_agg_mode=token-mean. PPO: adv_estimator=gae (adds a critic)."""

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
    gamma: float = 1.0  # GAE (PPO)
    lam: float = 1.0
    vf_clip: float = 0.5
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refills: int = 3
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N response tokens
    overlong_penalty: float = 1.0


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

    micro_batch_size: int = 8  # sequences per forward/backward (gradients accumulate)
    remat: bool = False  # recompute layer activations in the backward pass
    seq_bucket: int = 64  # batches are padded to a multiple of this many tokens


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
    run_dir: str = "runs/latest"
    eval_every: int = 10  # 0: only at the start and the end
    save_every: int = 10  # orbax checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the run folder's last complete checkpoint
    traces_per_step: int = 4  # trajectories written to traces.jsonl each step
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class JarlConfig:
    """The whole run configuration."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    agent: AgentSection = dataclasses.field(default_factory=AgentSection)
    tools: ToolsSection = dataclasses.field(default_factory=ToolsSection)
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
    """Loads ``schema`` from a YAML file (optional), then ``key.sub=value`` overrides in order."""
    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    # `key=` means the empty string (OmegaConf would read it as null)
    dotlist = [f"{item}''" if item.endswith("=") else item for item in overrides]
    layers.append(OmegaConf.from_dotlist(dotlist))
    try:
        merged = OmegaConf.merge(base, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"required config keys not set: {missing}")
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigKeyError as e:
        key = _full_key(e)
        raise ConfigError(
            f"unknown config key {key!r}; allowed here: {_allowed_keys(schema, key)}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad value for config key {_full_key(e)!r}: {e.msg}") from None


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (for run folders and ``--dry-run``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _full_key(e: OmegaConfBaseException) -> str:
    return str(e.full_key) if getattr(e, "full_key", None) else "<root>"


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
