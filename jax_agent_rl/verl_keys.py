"""verl's Hydra keys in jarl's terms: one table, read by the override parser and by docs/verl.md.

A verl run script's overrides (``actor_rollout_ref.rollout.n=16``, ``data.train_files=...``)
can be passed to any jarl command as they are. `to_jarl` rewrites each verl key that has an
equivalent into jarl overrides, saying so once, one line each::

    verl key actor_rollout_ref.rollout.n=16 -> rollout.n=16

and refuses the others with one `ConfigError` line each, naming what to use instead or why
nothing is needed here (an engine detail of verl's FSDP / Megatron / SGLang workers).

Some equivalents are traps, converted rather than copied (``trap`` in `TABLE`): verl's
``ppo_mini_batch_size`` is a size in prompts, jarl's ``algorithm.mini_batches`` a count
(``data.prompts_per_step / ppo_mini_batch_size``, which must divide); verl's ``*_per_gpu`` sizes
are per device, jarl's ``learner.micro_batch_size`` is over the data-parallel devices;
``max_prompt_length`` becomes part of ``rollout.max_model_len``; epochs become steps.

A conversion reads the final value of the jarl keys it depends on (``data.prompts_per_step``
for mini-batches, ...), whichever spelling set it and in whatever order the overrides came,
as Hydra applies a command line's overrides together. A jarl key set both directly and through
a verl key is an error: keep one.

``python -m jax_agent_rl.verl_keys`` prints `TABLE` as the markdown table of docs/verl.md
(tests/test_verl_keys.py checks that the two agree).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jax_agent_rl.config import ConfigError

# top-level sections of verl's config that jarl does not have: a key under one is verl's
VERL_SECTIONS = (
    "actor_rollout_ref",
    "critic",
    "reward_model",
    "custom_reward_function",
    "global_profiler",
    "ray_kwargs",
    "reward_manager",
    "transfer_queue",
)


@dataclasses.dataclass(frozen=True)
class Given:
    """What a conversion reads: the verl keys given (parsed values), the final value of any
    jarl key (from a direct override, another verl key's conversion or the config) and a data
    file's row count."""

    verl: Mapping[str, Any]
    current: Callable[[str], Any]
    rows: Callable[[str], int]


Rule = Callable[[Any, Given], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """One verl key (or, ending in ``.``, every key under it) and its jarl equivalent."""

    verl: str
    jarl: str  # the jarl keys it sets, ", "-separated; "" when none
    how: str  # how the value converts, or why there is no equivalent
    # value, Given -> {jarl key: value}; None copies the value to ``jarl``; raises ConfigError
    # to refuse (`_refuse`: always)
    rule: Rule | None = None
    trap: bool = False  # a size or count that means something else in jarl: converted


def _refuse(_value: Any, _given: Given) -> dict[str, Any]:
    raise ConfigError("")  # `to_jarl` writes the entry's ``how``


def _fixed(*accepted: Any) -> Rule:
    """Accepts only the values that say what jarl always does; sets nothing."""

    def rule(value: Any, _given: Given) -> dict[str, Any]:
        if value not in accepted:
            raise ConfigError("")
        return {}

    return rule


def _count(value: Any, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ConfigError(f"expected a whole number >= {0 if zero else 1}")
    return value


def _one_file(value: Any) -> str:
    """verl's ``*_files``: a path or a list of paths; jarl reads one file."""
    files = value if isinstance(value, list) else [value]
    if len(files) > 1:
        raise ConfigError(f"jarl reads one file here, got {len(files)}: join the rows into one")
    if not files or not isinstance(files[0], str) or not files[0]:
        raise ConfigError(f"expected a file path, got {value!r}")
    return files[0]


def _data_file(jarl: str) -> Rule:
    return lambda value, _given: {jarl: _one_file(value)}


def _response_length(value: Any, _given: Given) -> dict[str, Any]:
    n = _count(value)
    return {"agent.max_response_tokens": n, "agent.max_tokens_per_turn": n}


def _prompt_length(value: Any, given: Given) -> dict[str, Any]:
    return {"rollout.max_model_len": _count(value) + given.current("agent.max_response_tokens")}


def _mini_batches(value: Any, given: Given) -> dict[str, Any]:
    size, prompts = _count(value), given.current("data.prompts_per_step")
    if prompts % size:
        raise ConfigError(
            f"a mini-batch SIZE in prompts; data.prompts_per_step={prompts} does not split into "
            f"mini-batches of {size} prompts: use a divisor of {prompts}, or set "
            "algorithm.mini_batches (a COUNT) instead"
        )
    return {"algorithm.mini_batches": prompts // size}


def _data_parallel(given: Given) -> int:
    return int(given.current("mesh.data")) * int(given.current("mesh.fsdp"))


def _micro_batch(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.micro_batch_size": _count(value) * _data_parallel(given)}


def _devices(_value: Any, given: Given) -> dict[str, Any]:
    per_node = _count(given.verl.get("trainer.n_gpus_per_node", 8))
    gpus = per_node * _count(given.verl.get("trainer.nnodes", 1))
    other = int(given.current("mesh.tensor")) * int(given.current("mesh.data"))
    if gpus % other:
        raise ConfigError(
            f"{gpus} devices do not split over mesh.tensor x mesh.data = {other}: set mesh.fsdp"
        )
    return {"mesh.fsdp": gpus // other}


def _kl(_value: Any, given: Given) -> dict[str, Any]:
    if "actor_rollout_ref.actor.use_kl_loss" not in given.verl:
        raise ConfigError(
            "verl ignores it unless actor_rollout_ref.actor.use_kl_loss=True (default False): "
            "add that, or set algorithm.kl_coef"
        )
    if not given.verl["actor_rollout_ref.actor.use_kl_loss"]:
        return {"algorithm.kl_coef": 0.0}
    coef = given.verl.get("actor_rollout_ref.actor.kl_loss_coef", 0.001)  # verl's default
    if isinstance(coef, bool) or not isinstance(coef, int | float):
        raise ConfigError("expected a number")
    return {"algorithm.kl_coef": float(coef)}


_KL_KINDS = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


def _kl_kind(value: Any, _given: Given) -> dict[str, Any]:
    if value not in _KL_KINDS:
        raise ConfigError(f"jarl's algorithm.kl_kind has {sorted(set(_KL_KINDS.values()))}")
    return {"algorithm.kl_kind": _KL_KINDS[value]}


def _backend(value: Any, _given: Given) -> dict[str, Any]:
    if value != "vllm":
        raise ConfigError(
            "jarl has no such backend: drop it (the embedded JAX engine is the default) or set "
            "rollout.backend=vllm|jetstream"
        )
    return {"rollout.backend": "vllm"}


def _max_turns(value: Any, _given: Given) -> dict[str, Any]:
    if value is None:
        raise ConfigError("jarl's agent.max_turns is a number (null: no limit, has none)")
    return {"agent.max_turns": _count(value)}


def _parser(value: Any, _given: Given) -> dict[str, Any]:
    if value != "hermes":
        raise ConfigError("jarl's agent.parser has hermes, llama3_json, python_tag, tool_tag, ...")
    return {"agent.parser": "hermes"}


def _betas(value: Any, _given: Given) -> dict[str, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError("expected [b1, b2]")
    b1, b2 = (_fraction(b) for b in value)
    return {"optim.b1": b1, "optim.b2": b2}


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ConfigError("expected numbers in [0, 1)")
    return float(value)


def _refills(value: Any, _given: Given) -> dict[str, Any]:
    if value == 0:
        raise ConfigError("verl's 0 (unbounded) has no equivalent: set rollout.max_refills")
    return {"rollout.max_refills": _count(value) - 1}


def _warmup_steps(value: Any, _given: Given) -> dict[str, Any]:
    if value == -1:
        return {"optim.warmup_steps": 0}
    return {"optim.warmup_steps": _count(value, zero=True)}


def _trace_backend(value: Any, _given: Given) -> dict[str, Any]:
    if value is None:
        return {}
    if value != "mlflow":
        raise ConfigError("jarl's trainer.trace_backend has jsonl and mlflow")
    return {"trainer.trace_backend": "mlflow"}


def _steps(value: Any, _given: Given) -> dict[str, Any]:
    return {} if value is None else {"trainer.steps": _count(value, zero=True)}


def _epochs(value: Any, given: Given) -> dict[str, Any]:
    if given.verl.get("trainer.total_training_steps") is not None:
        return {}  # verl: total_training_steps wins
    epochs, train = _count(value), given.current("data.train")
    prompts = given.current("data.prompts_per_step")
    if not train:
        raise ConfigError("steps are epochs of data.train, which is not set: set it first")
    try:
        rows = given.rows(str(train))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"steps are epochs of data.train, whose rows could not be counted "
            f"({type(e).__name__}: {train}): set data.train or trainer.steps"
        ) from None
    if rows < prompts:  # verl drops the incomplete batch: no step at all, and jarl's 0 is SFT only
        raise ConfigError(
            f"data.train has {rows} rows, fewer than a step's {prompts} prompts "
            "(data.prompts_per_step): no training step; lower data.train_batch_size or set "
            "trainer.steps"
        )
    return {"trainer.steps": epochs * (rows // prompts)}


def _save_every(value: Any, given: Given) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("expected a whole number")
    return {"trainer.save_every": value if value > 0 else max(1, given.current("trainer.steps"))}


def _eval_every(value: Any, _given: Given) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("expected a whole number")
    return {"trainer.eval_every": max(value, 0)}


def _logger(value: Any, _given: Given) -> dict[str, Any]:
    loggers = value if isinstance(value, list) else [value]
    other = [x for x in loggers if x not in ("console", "tensorboard")]
    if other:
        raise ConfigError(
            f"jarl has no {other[0]} logger: metrics go to the console, the run folder's "
            "metrics.jsonl and TensorBoard (trainer.tensorboard); traces to MLflow with "
            "trainer.trace_backend=mlflow"
        )
    return {"trainer.tensorboard": "tensorboard" in loggers}


def _run_dir(_value: Any, given: Given) -> dict[str, Any]:
    folder = given.verl.get("trainer.default_local_dir")
    if folder is None:  # verl's default: checkpoints/${project_name}/${experiment_name}
        project = given.verl.get("trainer.project_name", "verl_examples")
        folder = f"runs/{project}/{given.verl.get('trainer.experiment_name', 'gsm8k')}"
    return {"trainer.run_dir": str(folder)}


def _resume(value: Any, _given: Given) -> dict[str, Any]:
    if value not in ("auto", "disable"):
        raise ConfigError(
            "jarl resumes from the run folder's last complete checkpoint (trainer.resume=true) "
            "or starts afresh (false)"
        )
    return {"trainer.resume": value == "auto"}


def _reward(_value: Any, given: Given) -> dict[str, Any]:
    path = given.verl.get("custom_reward_function.path")
    if path is None:
        if "custom_reward_function.path" not in given.verl:
            raise ConfigError("needs custom_reward_function.path: data.reward=FILE.py:FUNCTION")
        return {}
    return {
        "data.reward": f"{path}:{given.verl.get('custom_reward_function.name', 'compute_score')}"
    }


_ENGINE = "not needed: a setting of verl's {} that jarl does not have"
_LOGPROB = (
    "not needed: jarl computes old and reference log-probs inside the train step, in the "
    "learner's micro-batches (learner.micro_batch_size, learner.row_tokens)"
)
_FSDP = (
    "not needed: jarl shards weights and optimizer state over the mesh (mesh.fsdp) and offloads "
    "nothing"
)

# Every key a verl GSM8K tool-agent run script sets (examples/sglang_multiturn/*gsm8k*.sh,
# examples/grpo_trainer/*gsm8k*.sh and their YAML), and the common ones near them.
TABLE: tuple[VerlKey, ...] = (
    # data
    VerlKey("data.train_files", "data.train", "a path, or a list of one", _data_file("data.train")),
    VerlKey("data.val_files", "data.val", "a path, or a list of one", _data_file("data.val")),
    VerlKey(
        "data.train_batch_size", "data.prompts_per_step", "prompts per step (both count prompts)"
    ),
    VerlKey(
        "data.max_response_length",
        "agent.max_response_tokens, agent.max_tokens_per_turn",
        "model and tool tokens after the prompt; verl has no per-turn cap (a turn may use it all)",
        _response_length,
        trap=True,
    ),
    VerlKey(
        "data.max_prompt_length",
        "rollout.max_model_len",
        "max_model_len = max_prompt_length + agent.max_response_tokens",
        _prompt_length,
        trap=True,
    ),
    VerlKey(
        "data.return_raw_chat",
        "",
        "True: what jarl always does (it renders the chat itself)",
        _fixed(True),
    ),
    VerlKey(
        "data.filter_overlong_prompts",
        "",
        "no equivalent: jarl keeps every prompt (filter the file beforehand; see data.truncation)",
        _refuse,
    ),
    VerlKey(
        "data.truncation",
        "",
        "no equivalent: jarl never truncates a prompt; `jarl train` refuses a file whose first "
        "rows leave no room in rollout.max_model_len, and a later such prompt ends its episode "
        "at once (stop reason max_model_len)",
        _refuse,
    ),
    VerlKey(
        "data.shuffle",
        "",
        "True: what jarl always does (a fresh order each epoch, from trainer.seed)",
        _fixed(True),
    ),
    VerlKey(
        "data.dataloader_num_workers",
        "",
        "not needed: jarl reads the rows once, in-process",
        _refuse,
    ),
    VerlKey(
        "data.sampler.class_path",
        "",
        "no equivalent: jarl samples uniformly, a fresh order each epoch",
        _refuse,
    ),
    VerlKey(
        "data.sampler.class_name",
        "",
        "no equivalent: jarl samples uniformly, a fresh order each epoch",
        _refuse,
    ),
    VerlKey(
        "data.custom_cls.path", "", "not needed: jarl reads verl's parquet columns itself", _refuse
    ),
    VerlKey(
        "data.custom_cls.name", "", "not needed: jarl reads verl's parquet columns itself", _refuse
    ),
    # model
    VerlKey(
        "actor_rollout_ref.model.path",
        "model.path",
        "a local HF checkpoint folder: jarl downloads nothing",
    ),
    VerlKey(
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "learner.remat",
        "recompute activations in the backward pass",
    ),
    VerlKey(
        "actor_rollout_ref.model.use_remove_padding",
        "",
        "not needed: with learner.packing=true (the default) jarl computes on no padding",
        _refuse,
    ),
    VerlKey("actor_rollout_ref.model.enable_activation_offload", "", _FSDP, _refuse),
    VerlKey(
        "actor_rollout_ref.model.lora_rank",
        "",
        "no equivalent: jarl trains every weight (no LoRA)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.model.lora_alpha",
        "",
        "no equivalent: jarl trains every weight (no LoRA)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.model.lora_adapter_path",
        "",
        "no equivalent: jarl trains every weight (no LoRA)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.model.use_shm",
        "",
        "not needed: jarl reads the checkpoint from its folder once",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.hybrid_engine",
        "",
        "not needed: the rollout backend decides where it runs (the embedded engine on the "
        "learner's devices, vLLM replicas on rollout.vllm_devices)",
        _refuse,
    ),
    # actor
    VerlKey("actor_rollout_ref.actor.optim.lr", "optim.lr", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.optim.weight_decay",
        "optim.weight_decay",
        "the same (verl's default is 0.01, jarl's 0)",
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.betas", "optim.b1, optim.b2", "[b1, b2] -> b1, b2", _betas
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "optim.warmup_steps",
        "the same; -1 (verl: use lr_warmup_steps_ratio, 0 by default) -> 0",
        _warmup_steps,
    ),
    VerlKey(
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "",
        "no equivalent ratio: set optim.warmup_steps, a COUNT of steps (verl's is ratio x total "
        "training steps)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.actor.strategy",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.prompt_length",
        "",
        "not needed: verl copies it from data.max_prompt_length; set that",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.response_length",
        "",
        "not needed: verl copies it from data.max_response_length; set that",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.agent.num_workers",
        "",
        "not needed: jarl runs every episode as a coroutine in one process "
        "(rollout.max_concurrent at once)",
        _refuse,
    ),
    VerlKey("actor_rollout_ref.actor.grad_clip", "optim.grad_clip", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "algorithm.mini_batches",
        "a SIZE in prompts (verl multiplies it by rollout.n); jarl's is a COUNT: "
        "mini_batches = data.prompts_per_step / ppo_mini_batch_size, which must divide",
        _mini_batches,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "learner.micro_batch_size",
        "per device; jarl's is over the data-parallel devices: micro_batch_size = per_gpu x "
        "mesh.data x mesh.fsdp (read when learner.packing=false)",
        _micro_batch,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "learner.packing",
        "micro-batches by token budget",
    ),
    VerlKey(
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "learner.row_tokens",
        "tokens per device row (learner.packing=true)",
    ),
    VerlKey("actor_rollout_ref.actor.ppo_epochs", "algorithm.ppo_epochs", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.use_kl_loss",
        "algorithm.kl_coef",
        "True: kl_coef = kl_loss_coef (verl's default 0.001); False: 0 (jarl's KL loss is on when "
        "kl_coef > 0)",
        _kl,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.kl_loss_coef",
        "algorithm.kl_coef",
        "read with use_kl_loss (alone, verl ignores it)",
        _kl,
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.actor.kl_loss_type",
        "algorithm.kl_kind",
        "low_var_kl -> k3, kl -> k1, mse -> k2, abs -> abs",
        _kl_kind,
    ),
    VerlKey("actor_rollout_ref.actor.entropy_coeff", "algorithm.entropy_coef", "the same"),
    VerlKey(
        "actor_rollout_ref.actor.clip_ratio",
        "",
        "verl's loss reads clip_ratio_low and clip_ratio_high (0.2 each by default), not this: "
        "set algorithm.clip_low and algorithm.clip_high",
        _refuse,
        trap=True,
    ),
    VerlKey("actor_rollout_ref.actor.clip_ratio_low", "algorithm.clip_low", "the same"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_high", "algorithm.clip_high", "the same"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_c", "algorithm.clip_c", "the same (dual clip)"),
    VerlKey("actor_rollout_ref.actor.loss_agg_mode", "algorithm.loss_agg_mode", "the same names"),
    VerlKey(
        "actor_rollout_ref.actor.use_torch_compile",
        "",
        "not needed: jarl's steps are always compiled (XLA)",
        _refuse,
    ),
    VerlKey("actor_rollout_ref.actor.fsdp_config.", "", _FSDP, _refuse),
    VerlKey(
        "actor_rollout_ref.actor.megatron.",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        _refuse,
    ),
    # reference model
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "", _LOGPROB, _refuse),
    VerlKey("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "", _LOGPROB, _refuse),
    VerlKey("actor_rollout_ref.ref.fsdp_config.", "", _FSDP, _refuse),
    VerlKey(
        "actor_rollout_ref.ref.megatron.",
        "",
        "not needed: jarl shards over the mesh (mesh.*)",
        _refuse,
    ),
    # rollout
    VerlKey(
        "actor_rollout_ref.rollout.name",
        "rollout.backend",
        "vllm -> vllm; jarl has no SGLang backend (the embedded JAX engine is its default)",
        _backend,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.mode",
        "",
        "async: what jarl always does (one coroutine per episode); not trainer.mode, which is "
        "off-policy training",
        _fixed("async"),
    ),
    VerlKey("actor_rollout_ref.rollout.n", "rollout.n", "samples per prompt"),
    VerlKey("actor_rollout_ref.rollout.temperature", "rollout.temperature", "the same"),
    VerlKey("actor_rollout_ref.rollout.top_p", "rollout.top_p", "the same"),
    VerlKey("actor_rollout_ref.rollout.top_k", "rollout.top_k", "the same (-1: off)"),
    VerlKey(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "mesh.tensor",
        "jarl's engine serves on the learner's mesh, so the learner shards tensors the same way",
        trap=True,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "",
        "no equivalent: jarl sizes the KV cache in GiB, rollout.kv_cache_gib (0: enough for "
        "rollout.max_concurrent sequences), or rollout.vllm_kv_cache_mb",
        _refuse,
    ),
    VerlKey("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "", _LOGPROB, _refuse),
    VerlKey("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "", _LOGPROB, _refuse),
    VerlKey(
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "",
        _ENGINE.format("rollout engine"),
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.free_cache_engine", "", _ENGINE.format("rollout engine"), _refuse
    ),
    VerlKey(
        "actor_rollout_ref.rollout.enforce_eager", "", _ENGINE.format("rollout engine"), _refuse
    ),
    VerlKey("actor_rollout_ref.rollout.load_format", "", _ENGINE.format("rollout engine"), _refuse),
    VerlKey(
        "actor_rollout_ref.rollout.layered_summon", "", _ENGINE.format("rollout engine"), _refuse
    ),
    VerlKey(
        "actor_rollout_ref.rollout.sglang_rollout_mode",
        "",
        _ENGINE.format("SGLang rollout"),
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.server.",
        "",
        _ENGINE.format("SGLang server"),
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.over_sample_rate",
        "",
        "no equivalent: jarl waits for every episode of a step (rollout.dynamic_sampling refills "
        "groups instead)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.enable",
        "",
        "not needed: each row's agent_name picks its loop (rows without one: "
        "agent.default_agent_loop)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "tools.config",
        "verl's tool YAML, read as it is",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
        "env.interaction_config",
        "verl's interaction YAML, read as it is",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
        "agent.max_turns",
        "model turns per episode",
        _max_turns,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_user_turns",
        "",
        "no equivalent: an environment ends its episode itself (agent.max_turns caps model turns)",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls",
        "agent.max_parallel_tool_calls",
        "the same",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
        "agent.max_tool_response_tokens",
        "the same",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side",
        "agent.tool_response_truncate",
        "the same names",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.multi_turn.format", "agent.parser", "hermes -> hermes", _parser
    ),
    VerlKey(
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "agent.default_agent_loop",
        "the same names",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.trace.backend",
        "trainer.trace_backend",
        "mlflow -> mlflow",
        _trace_backend,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.trace.token2text",
        "",
        "not needed: jarl's traces always hold the text",
        _refuse,
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.n",
        "",
        "1: what jarl's evaluation does (`jarl eval RUN --n N` for pass@N)",
        _fixed(1),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "",
        "0: what jarl's evaluation does (greedy)",
        _fixed(0),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        "",
        "1.0: what jarl's evaluation does (greedy)",
        _fixed(1),
    ),
    VerlKey(
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "",
        "False: what jarl's evaluation does (greedy)",
        _fixed(False),
    ),
    # algorithm
    VerlKey(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        "the same key: grpo, gae (PPO, adds a critic); verl's others have no equivalent",
    ),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", "the same"),
    VerlKey(
        "algorithm.filter_groups.enable",
        "rollout.dynamic_sampling",
        "the same (DAPO: drop groups whose rewards are all equal, refill)",
    ),
    VerlKey(
        "algorithm.filter_groups.metric",
        "",
        "acc, score, seq_reward, seq_final_reward: jarl compares a group's rewards (for 0/1 "
        "rules the same groups as acc)",
        _fixed("acc", "score", "seq_reward", "seq_final_reward"),
    ),
    VerlKey(
        "algorithm.filter_groups.max_num_gen_batches",
        "rollout.max_refills",
        "max_refills = max_num_gen_batches - 1 (verl counts the first batch); verl's 0 "
        "(unbounded) has no equivalent",
        _refills,
        trap=True,
    ),
    VerlKey(
        "data.gen_batch_size",
        "",
        "no equivalent: jarl rolls out data.prompts_per_step prompts and refills dropped groups "
        "with fresh ones (rollout.max_refills)",
        _refuse,
    ),
    VerlKey("algorithm.gamma", "algorithm.gamma", "the same key"),
    VerlKey("algorithm.lam", "algorithm.lam", "the same key"),
    VerlKey(
        "algorithm.use_kl_in_reward",
        "",
        "False: what jarl always does (its KL is in the loss: algorithm.kl_coef)",
        _fixed(False),
    ),
    VerlKey(
        "algorithm.kl_ctrl.kl_coef",
        "",
        "no equivalent: jarl has no KL in the reward; its KL is in the loss, algorithm.kl_coef",
        _refuse,
    ),
    VerlKey(
        "algorithm.kl_penalty",
        "",
        "no equivalent: jarl has no KL in the reward; its KL is in the loss, algorithm.kl_kind",
        _refuse,
    ),
    # reward
    VerlKey("custom_reward_function.path", "data.reward", "data.reward = path:name", _reward),
    VerlKey(
        "custom_reward_function.name",
        "data.reward",
        "data.reward = path:name (name alone: verl's compute_score)",
        _reward,
    ),
    VerlKey(
        "custom_reward_function.reward_kwargs.",
        "",
        "no equivalent: jarl calls data.reward's function without extra keyword arguments: "
        "give them defaults in the function",
        _refuse,
    ),
    VerlKey(
        "reward_model.enable",
        "",
        "False: what jarl always does (no scalar reward model; a model as the reward is "
        "data.reward=judge, data.judge.*)",
        _fixed(False),
    ),
    VerlKey(
        "reward_model.reward_manager",
        "",
        "naive: what jarl does (data.reward scores each episode)",
        _fixed("naive"),
    ),
    VerlKey(
        "reward_model.",
        "",
        "no equivalent: jarl has no scalar reward model; a model as the reward is "
        "data.reward=judge (data.judge.*)",
        _refuse,
    ),
    # critic
    VerlKey("critic.optim.lr", "optim.critic_lr", "the same"),
    VerlKey(
        "critic.ppo_max_token_len_per_gpu",
        "",
        "not needed: the critic uses the learner's layout (learner.row_tokens)",
        _refuse,
    ),
    VerlKey(
        "critic.forward_max_token_len_per_gpu",
        "",
        "not needed: the critic uses the learner's layout (learner.row_tokens)",
        _refuse,
    ),
    # trainer
    VerlKey("trainer.total_training_steps", "trainer.steps", "the same", _steps),
    VerlKey(
        "trainer.total_epochs",
        "trainer.steps",
        "steps = total_epochs x (rows of data.train // data.prompts_per_step), as verl counts "
        "them; ignored when trainer.total_training_steps is set, as in verl",
        _epochs,
        trap=True,
    ),
    VerlKey(
        "trainer.n_gpus_per_node",
        "mesh.fsdp",
        "mesh.fsdp = n_gpus_per_node x nnodes / (mesh.tensor x mesh.data)",
        _devices,
        trap=True,
    ),
    VerlKey(
        "trainer.nnodes",
        "mesh.fsdp",
        "as n_gpus_per_node; start each host with `jarl train --num-processes`",
        _devices,
        trap=True,
    ),
    VerlKey(
        "trainer.project_name",
        "trainer.run_dir",
        "run_dir = runs/project_name/experiment_name",
        _run_dir,
    ),
    VerlKey(
        "trainer.experiment_name",
        "trainer.run_dir",
        "run_dir = runs/project_name/experiment_name",
        _run_dir,
    ),
    VerlKey(
        "trainer.default_local_dir",
        "trainer.run_dir",
        "the run folder (checkpoints, logs, traces)",
        _run_dir,
    ),
    VerlKey(
        "trainer.logger",
        "trainer.tensorboard",
        "console and tensorboard; no wandb/mlflow/swanlab metrics",
        _logger,
    ),
    VerlKey(
        "trainer.save_freq",
        "trainer.save_every",
        "the same; -1 (never): jarl always saves at the end, so save_every = trainer.steps",
        _save_every,
    ),
    VerlKey(
        "trainer.test_freq",
        "trainer.eval_every",
        "the same; -1: 0 (jarl evaluates at the start and end only)",
        _eval_every,
    ),
    VerlKey(
        "trainer.val_before_train",
        "",
        "True: what jarl always does when data.val is set",
        _fixed(True),
    ),
    VerlKey(
        "trainer.critic_warmup", "", "0: what jarl always does (no critic-only steps)", _fixed(0)
    ),
    VerlKey("trainer.resume_mode", "trainer.resume", "auto -> true, disable -> false", _resume),
    VerlKey("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints", "the same"),
    VerlKey(
        "trainer.device",
        "",
        "not needed: JAX uses the accelerator it finds (JAX_PLATFORMS=cpu to force the CPU)",
        _refuse,
    ),
    VerlKey(
        "trainer.balance_batch",
        "",
        "not needed: jarl packs episodes into rows of learner.row_tokens (learner.packing)",
        _refuse,
    ),
    VerlKey(
        "data.seed",
        "",
        "no equivalent: jarl's data order comes from trainer.seed",
        _refuse,
    ),
    VerlKey(
        "trainer.log_val_generations",
        "",
        "no equivalent: jarl writes trainer.traces_per_step training episodes a step (`jarl "
        "traces`) and every evaluation's answers (`jarl eval`)",
        _refuse,
    ),
    VerlKey("global_profiler.", "", "no equivalent: profile with jax.profiler", _refuse),
    VerlKey("ray_kwargs.", "", "not needed: jarl's Ray settings are rollout.ray.*", _refuse),
    VerlKey("ray_init.", "", "not needed: jarl's Ray settings are rollout.ray.*", _refuse),
    VerlKey(
        "hydra.", "", "not needed: jarl has no Hydra (its run folder is trainer.run_dir)", _refuse
    ),
)


def find(key: str) -> VerlKey | None:
    """The entry for verl key ``key``: its own, else the entry of a section holding it."""
    for entry in TABLE:
        if key == entry.verl or (entry.verl.endswith(".") and key.startswith(entry.verl)):
            return entry
    return None


def _is_verl(key: str) -> bool:
    entry = find(key)
    if entry is not None:
        return entry.verl != entry.jarl  # a key both spell alike is jarl's
    return key.split(".", 1)[0] in VERL_SECTIONS


def _parse(raw: str) -> Any:
    """An override's value as Hydra / OmegaConf read it (``[a,b]`` a list, ``True`` a bool);
    text that is not of that syntax stays text."""
    try:
        parsed: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))
        return parsed["v"]
    except OmegaConfBaseException:
        return raw


def count_rows(path: str) -> int:
    """Rows of a ``.parquet`` (its metadata) or ``.jsonl`` (its non-blank lines) file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return int(pq.read_metadata(path).num_rows)
    with Path(path).open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def to_jarl(
    overrides: Sequence[str],
    config: Callable[[str], Any],
    say: Callable[[str], None],
    rows: Callable[[str], int] = count_rows,
) -> list[str]:
    """``overrides`` with every verl key replaced by the jarl overrides it means (`TABLE`), each
    told through ``say`` once; ``config`` gives a jarl key's value before the overrides, and
    ``rows`` counts a data file's rows (verl's epochs). Every refused key is a `ConfigError`
    line, all of them at once."""
    kept: list[str] = []  # jarl's own overrides, in their order
    jarl: dict[str, str] = {}  # their key -> raw value, the last one winning
    verl: dict[str, str] = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        bare = key.lstrip("+")  # Hydra's +key / ++key: add or force
        if _is_verl(bare):
            verl[bare] = raw
        else:
            kept.append(item)
            jarl[key] = raw
    if not verl:
        return kept
    results: dict[str, dict[str, Any]] = {}
    problems: list[str] = []

    given_verl = {key: _parse(raw) for key, raw in verl.items()}

    def current(target: str) -> Any:
        if target in jarl:
            return _parse(jarl[target])
        for key in verl:
            entry = find(key)
            if entry is not None and target in entry.jarl.split(", "):
                values = convert(key)
                if target in values:
                    return values[target]
        return config(target)

    def convert(key: str) -> dict[str, Any]:
        """The jarl values of verl key ``key`` (none when it is refused)."""
        if key in results:
            return results[key]
        results[key] = {}  # a key is converted once
        entry = find(key)
        try:
            if entry is None:
                raise ConfigError(
                    "a verl key with no jarl equivalent listed in docs/verl.md: set the jarl "
                    "key directly (`jarl config` lists them)"
                )
            if entry.rule is None:
                results[key] = {entry.jarl: given_verl[key]}
            else:
                results[key] = entry.rule(given_verl[key], Given(given_verl, current, rows))
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            why = str(e) or (entry.how if entry is not None else "")
            problems.append(f"verl key {key}={verl[key]}: {why}")
        return results[key]

    for key in verl:
        convert(key)
    problems += _clashes(results, jarl)
    if problems:
        raise ConfigError("\n".join(problems))
    out = list(kept)
    for key, raw in verl.items():
        say(_told(key, raw, results[key]))
        out += [f"{k}={json.dumps(v)}" for k, v in results[key].items()]
    return list(dict.fromkeys(out))  # two verl keys may give one jarl key the same value


def _told(key: str, raw: str, values: Mapping[str, Any]) -> str:
    """The line saying what verl key ``key`` became."""
    if values:
        return f"verl key {key}={raw} -> " + ", ".join(f"{k}={v}" for k, v in values.items())
    entry = find(key)
    return f"verl key {key}={raw}: {entry.how if entry is not None else ''}"


def _clashes(results: Mapping[str, Mapping[str, Any]], jarl: Mapping[str, str]) -> list[str]:
    """A jarl key set directly and by a verl key, or by two verl keys to different values."""
    problems: list[str] = []
    set_by: dict[str, tuple[str, Any]] = {}
    for key, values in results.items():
        for target, value in values.items():
            if target in jarl:
                problems.append(f"{target} is set directly and by verl key {key}: keep one")
            elif target in set_by and set_by[target][1] != value:
                problems.append(
                    f"{target} is set to {set_by[target][1]!r} by verl key {set_by[target][0]} "
                    f"and to {value!r} by verl key {key}: keep one"
                )
            set_by.setdefault(target, (key, value))
    return problems


def markdown_table() -> str:
    """`TABLE` as docs/verl.md's table."""
    lines = ["| verl key | jarl key | how |", "| --- | --- | --- |"]
    for e in TABLE:
        verl = f"`{e.verl}*`" if e.verl.endswith(".") else f"`{e.verl}`"
        jarl = ", ".join(f"`{k}`" for k in e.jarl.split(", ")) if e.jarl else "none"
        how = ("**trap**: " if e.trap else "") + e.how
        lines.append(f"| {verl} | {jarl} | {how} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
