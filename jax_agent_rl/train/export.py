"""A run's policy as an HF checkpoint folder that transformers and vLLM load as they are.

The folder holds the safetensors, ``config.json`` with the special token ids,
``generation_config.json`` and the run's tokenizer files. HF ``generate`` stops where the
agent loop stops: at the end of an assistant turn, the tokenizer's ``eos_token`` (the token the
chat template ends assistant messages with; `TurnBuilder` refuses a template that does not),
and at any id the source checkpoint's own generation config stops at (Qwen2.5-Instruct's
``<|endoftext|>``, say). Its sampling defaults are the rollouts' temperature, top-p and top-k:
the distribution the policy was trained to sample from.

The trainer exports its final policy to ``RUN/hf``; `export_run` (``jarl export RUN --step N``)
exports any saved orbax checkpoint of a run, reading only the policy's parameters (not the
optimizer state) with the model and tokenizer the run's ``config.yaml`` names.

A LoRA run (``model.lora``) exports its adapters as an HF PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, on top of ``model.path``, with the
tokenizer files), or with ``merge`` (``jarl export --merge``) the adapters merged into the base
weights as a plain HF checkpoint; its final policy goes to both, ``RUN/hf`` merged (what
``jarl eval RUN`` and vLLM load) and ``RUN/hf-adapter``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_agent_rl.config import ConfigError, JarlConfig, SamplingSection, load_config, missing_paths
from jax_agent_rl.models import ModelConfig, Weights, save_hf
from jax_agent_rl.models.adapters import merge as merge_adapters
from jax_agent_rl.models.adapters import save_peft
from jax_agent_rl.models.checkpoint import GenerationConfig
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.checkpoints import RUN_CONFIG, checkpoint_step, saved_policy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def source_eos_ids(checkpoint: str | Path) -> tuple[int, ...]:
    """The ids a checkpoint folder stops generation at: its ``generation_config.json``'s
    ``eos_token_id``, else its ``config.json``'s (an int, a list, or absent)."""
    for name in ("generation_config.json", "config.json"):
        file = Path(checkpoint) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def generation_config(
    tokenizer: Tokenizer, sampling: SamplingSection, source_eos: tuple[int, ...] = ()
) -> GenerationConfig:
    """Stop at the end of a turn (the tokenizer's eos) or at ``source_eos``; pad with the
    tokenizer's pad token (else the end-of-turn token); sample as the rollouts did."""
    end_of_turn = tokenizer.eos_token_id
    if end_of_turn is None:
        raise ValueError("the tokenizer names no eos_token: an exported policy would never stop")
    bos = None if tokenizer.bos_token is None else tokenizer.token_id(tokenizer.bos_token)
    pad = tokenizer.pad_token_id
    return GenerationConfig(
        eos_token_ids=tuple(dict.fromkeys((end_of_turn, *source_eos))),
        pad_token_id=end_of_turn if pad is None else pad,
        bos_token_id=bos,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )


def check_out(out: Path, cfg: JarlConfig, new_folder: bool = False) -> None:
    """Raises ValueError when ``out`` is the run ``cfg``'s model or tokenizer folder, or with
    ``new_folder`` when it exists and is not an empty folder."""
    for source in {Path(cfg.model.path), Path(cfg.model.tokenizer or cfg.model.path)}:
        if out.resolve() == source.resolve():  # (it overwrote the base's weights, then failed)
            raise ValueError(
                f"--out {out} is the run's model or tokenizer folder ({source}): an export "
                "would overwrite its files; choose another folder"
            )
    if new_folder and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder: name a new one")


def export_policy(
    out: str | Path, cfg: JarlConfig, model: ModelConfig, params: Weights, merge: bool = False
) -> Path:
    """Writes ``params`` (host arrays) of the run ``cfg`` as an HF checkpoint folder ``out``;
    a LoRA policy's as a PEFT adapter folder, or with ``merge`` merged into its base."""
    out = Path(out)
    tokenizer_dir = Path(cfg.model.tokenizer or cfg.model.path)
    check_out(out, cfg)
    if merge and model.lora is None:
        raise ValueError("--merge merges LoRA adapters: this run has none (model.lora.rank=0)")
    if merge:
        model, params = merge_adapters(model, params)
    if model.lora is not None:
        save_peft(out, model, params, base_model=str(cfg.model.path))
    else:
        generation = generation_config(
            Tokenizer.from_pretrained(tokenizer_dir), cfg.sampling, source_eos_ids(cfg.model.path)
        )
        save_hf(out, model, params, generation=generation)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def export_run(
    run_dir: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    merge: bool = False,
) -> Path:
    """Exports the policy of ``run_dir``'s checkpoint of ``step`` (default: the latest) to
    ``out`` (default: ``run_dir/hf-step-<step>``, ``-merged`` with ``merge``); returns
    ``out``. A given ``out`` must be new or an empty folder: written beside another export's
    files (an adapter folder's, then a merged checkpoint's), what loaded it was neither
    (transformers reads such a folder as the adapter on its base)."""
    run_dir = Path(run_dir)
    config_file = run_dir / RUN_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: it has no {RUN_CONFIG}")
    try:
        cfg: JarlConfig = load_config(config_file)
    except ConfigError as e:  # (a run made before a key moved: name the file the user did not)
        raise ConfigError(f"{config_file}: {e}") from None
    missing = missing_paths(cfg, ("model.path", "model.tokenizer"))
    if missing:
        raise FileNotFoundError(f"{config_file}: {missing[0]}")
    if cfg.model.module:
        raise ValueError(
            f"{config_file}: model.module={cfg.model.module!r} is a custom policy, which has no "
            "HF layout to export: its weights are the run's checkpoints (jarl eval RUN reads them)"
        )
    if out is not None:  # (before a checkpoint is read)
        check_out(Path(out), cfg, new_folder=True)
    step = checkpoint_step(run_dir, cfg, step)
    policy, params = saved_policy(run_dir, cfg, step)
    _check_finite(params, step)
    default = run_dir / f"hf-step-{step}{'-merged' if merge else ''}"
    return export_policy(out or default, cfg, policy.cfg, params, merge)


def _check_finite(params: Weights, step: int) -> None:
    """Raises ValueError naming the first weight of ``params`` holding NaN or inf: such a
    checkpoint was exported (exit 0) and every logit of what loaded it was NaN."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        array = np.asarray(leaf)
        if jnp.issubdtype(array.dtype, jnp.inexact) and not np.isfinite(array).all():
            raise ValueError(
                f"the checkpoint of step {step} holds NaN or inf in {jax.tree_util.keystr(path)}:"
                " not exported (the run diverged by then; export an earlier --step)"
            )
