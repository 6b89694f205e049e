"""The ``model`` section: the checkpoint, its compute dtype, and the LoRA adapters a run
trains instead of the whole model (``model.lora``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jax_agent_rl.config.ranges import NATURAL, POSITIVE, Rule, setting

# the projections an adapter may wrap (`jax_agent_rl.models.lora.TARGETS`; PEFT's q_proj ...)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# the smallest alpha and the largest alpha / rank (`jax_agent_rl.models.lora.MIN_ALPHA`,
# `MAX_SCALE`, which say why)
MIN_LORA_ALPHA, MAX_LORA_SCALE = 1e-4, 1e4


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA (HF PEFT's): the learner trains only adapters ``W + (alpha / rank) A B`` on the
    ``targets`` projections of every layer; the base weights stay frozen. ``rank`` 0: off,
    the whole model is trained. ``adapter_path``: a PEFT adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``, as ``jarl export`` writes a LoRA
    run's) whose adapters training starts from, instead of fresh ones; ``rank`` 0 takes its
    rank, alpha and targets, any other must agree with the folder's (`train.learners.lora_of`)."""

    rank: int = setting(0, NATURAL)
    alpha: float = setting(16.0, POSITIVE)
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    adapter_path: str = ""
    # dropout on the adapters' input (PEFT's lora_dropout): not implemented, so only 0
    dropout: float = setting(0.0, Rule(lambda v: v == 0, "0 (LoRA dropout is not implemented)"))


# the fewest rows a program of a model with exact logprobs (`model.exact_logprobs`) runs a
# matmul or a log-softmax over: XLA:CPU sums a matmul of fewer than about 60 rows in another
# order than a larger one (fp32 [M, 128] x [128, 384] up to the Qwen2.5-1.5B MLP's [M, 1536] x
# [1536, 8960]: rows differ at M <= 56, equal the 1024-row product's from 63 on; bf16 hides
# most of it in its rounding, not all: one token in ~2400 was 1.5e-3 off), and a log-softmax
# of two rows otherwise than of more
EXACT_ROWS = 64


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to load and how to compute with it."""

    path: str = "???"  # a local HF checkpoint folder (config.json + safetensors)
    tokenizer: str = ""  # a tokenizer folder; empty: the checkpoint folder
    # a custom policy instead of the checkpoint: path/to/file.py:make_policy (or module:fn),
    # called with the tokenizer's vocabulary size, returning a `models.policy.Policy` (a
    # Flax NNX module through `models.nnx_policy.NnxPolicy`); its parameters start from its
    # own init (trainer.seed), and model.path is then only the tokenizer's folder
    module: str = ""
    # compute dtype of the learner and the rollout engine; the learner's master weights and
    # optimizer state are always float32
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the sampler's logprobs equal the learner's bit for bit (bfloat16 too): both compile with
    # XLA's excess precision off, the training attention reads keys in the engine's pages
    # (engine.page_size), and the engine runs at least 64 rows a program (engine.max_concurrent
    # at least 64 per data shard); slower
    # (docs/algorithms.md, exact logprobs). Embedded engine, dense checkpoints, no LoRA
    exact_logprobs: bool = False
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)


def lora_targets_problem(section: LoraSection) -> str | None:
    """A LoRA run's targets: distinct names of `LORA_TARGETS`, at least one; and its scale
    ``alpha / rank`` at most `MAX_LORA_SCALE`, and its alpha at least `MIN_LORA_ALPHA`."""
    if not section.rank:
        return None
    if section.alpha < MIN_LORA_ALPHA:
        return (
            f"model.lora.alpha={section.alpha:g}: expected >= {MIN_LORA_ALPHA:g} (a smaller one "
            "rounds the adapters' contribution to nothing)"
        )
    if section.alpha / section.rank > MAX_LORA_SCALE:
        return (
            f"model.lora.alpha={section.alpha:g} over model.lora.rank={section.rank} is a scale "
            f"of {section.alpha / section.rank:g}: expected at most {MAX_LORA_SCALE:g} (larger "
            "scales overflow float32 once the adapters train)"
        )
    targets = list(section.targets)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        none = f" ({unknown[0]!r} is none)" if unknown else ""
        return (
            f"model.lora.targets={targets}: expected distinct names of {list(LORA_TARGETS)}{none}"
        )
    return None
