"""What the table's entries are made of: a verl key's entry (`VerlKey`), what its conversion
reads (`Given`), and the conversions of the keys whose values mean something else in jarl."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax_agent_rl.config.errors import ConfigError

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
    jarl key (from a direct override, another verl key's conversion or the config), a data
    file's row count, and whether a jarl key is set directly (an override)."""

    verl: Mapping[str, Any]
    current: Callable[[str], Any]
    rows: Callable[[str], int]
    direct: Callable[[str], bool]


Rule = Callable[[Any, Given], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """One verl key (or, ending in ``.``, every key under it) and its jarl equivalent."""

    verl: str
    jarl: str  # the jarl keys it sets, ", "-separated; "" when none
    how: str  # how the value converts, or why there is no equivalent
    # value, Given -> {jarl key: value}; None copies the value to ``jarl``; raises ConfigError
    # to refuse (`refuse`: always)
    rule: Rule | None = None
    trap: bool = False  # a size or count that means something else in jarl: converted


def refuse(_value: Any, _given: Given) -> dict[str, Any]:
    raise ConfigError("")  # `to_jarl` writes the entry's ``how``


def not_needed(_value: Any, _given: Given) -> dict[str, Any]:
    """Accepts any value of a key whose effect jarl already has its own way (an engine, memory
    or layout detail of verl's workers that changes nothing the run computes); sets nothing.
    `to_jarl` lists it, with its entry's ``how``, in its one note of keys accepted as they are."""
    return {}


def fixed(*accepted: Any) -> Rule:
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


def data_file(jarl: str) -> Rule:
    return lambda value, _given: {jarl: _one_file(value)}


def response_length(value: Any, given: Given) -> dict[str, Any]:
    """verl's budget of the whole conversation after the prompt; verl caps no turn, so one model
    turn may take it all: a per-turn cap of the same (unless ``agent.max_tokens_per_turn`` is
    set directly, which stands). With an interaction that would let the first model turn take
    the whole budget and leave the interaction none (the run would train on nothing): refused
    unless the per-turn cap is given."""
    n = _count(value)
    out = {"agent.max_response_tokens": n}
    if given.direct("agent.max_tokens_per_turn"):
        return out
    if given.current("env.interaction_config"):
        raise ConfigError(
            f"verl's budget of the whole conversation: with an interaction "
            f"(env.interaction_config) one model turn may take all {n} tokens and leave the "
            f"interaction no turn; set agent.max_tokens_per_turn beside it (what one model turn "
            f"may take, e.g. agent.max_tokens_per_turn={max(1, n // 4)})"
        )
    return {**out, "agent.max_tokens_per_turn": n}


def prompt_length(value: Any, given: Given) -> dict[str, Any]:
    return {"engine.max_model_len": _count(value) + given.current("agent.max_response_tokens")}


def mini_batches(value: Any, given: Given) -> dict[str, Any]:
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


def micro_batch(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.micro_batch_size": _count(value) * _data_parallel(given)}


def devices(_value: Any, given: Given) -> dict[str, Any]:
    per_node = _count(given.verl.get("trainer.n_gpus_per_node", 8))
    gpus = per_node * _count(given.verl.get("trainer.nnodes", 1))
    other = int(given.current("mesh.tensor")) * int(given.current("mesh.data"))
    if gpus % other:
        raise ConfigError(
            f"{gpus} devices do not split over mesh.tensor x mesh.data = {other}: set mesh.fsdp"
        )
    return {"mesh.fsdp": gpus // other}


def kl(_value: Any, given: Given) -> dict[str, Any]:
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


def kl_kind(value: Any, _given: Given) -> dict[str, Any]:
    if value not in _KL_KINDS:
        raise ConfigError(f"jarl's algorithm.kl_kind has {sorted(set(_KL_KINDS.values()))}")
    return {"algorithm.kl_kind": _KL_KINDS[value]}


def backend(value: Any, _given: Given) -> dict[str, Any]:
    if value != "vllm":
        raise ConfigError(
            "jarl has no such backend: drop it (the embedded JAX engine is the default) or set "
            "engine.backend=vllm|jetstream"
        )
    return {"engine.backend": "vllm"}


def max_turns(value: Any, _given: Given) -> dict[str, Any]:
    if value is None:
        raise ConfigError("jarl's agent.max_turns is a number (null: no limit, has none)")
    return {"agent.max_turns": _count(value)}


def parser(value: Any, _given: Given) -> dict[str, Any]:
    if value != "hermes":
        raise ConfigError("jarl's agent.parser has hermes, llama3_json, python_tag, tool_tag, ...")
    return {"agent.parser": "hermes"}


def betas(value: Any, _given: Given) -> dict[str, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError("expected [b1, b2]")
    b1, b2 = (_fraction(b) for b in value)
    return {"optim.b1": b1, "optim.b2": b2}


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ConfigError("expected numbers in [0, 1)")
    return float(value)


def refills(value: Any, _given: Given) -> dict[str, Any]:
    if value == 0:
        raise ConfigError("verl's 0 (unbounded) has no equivalent: set group.max_refills")
    return {"group.max_refills": _count(value) - 1}


# verl's (PEFT's) LoRA module names -> jarl's model.lora.targets
_LORA_MODULES = {f"{t}_proj": t for t in ("q", "k", "v", "o", "gate", "up", "down")}


def lora_targets(value: Any, _given: Given) -> dict[str, Any]:
    """``all-linear`` (verl's default) or a list of ``q_proj`` ... ``down_proj``."""
    if value == "all-linear":
        return {"model.lora.targets": list(_LORA_MODULES.values())}
    if not isinstance(value, list) or not value or any(m not in _LORA_MODULES for m in value):
        raise ConfigError(f"expected all-linear or a list of {', '.join(_LORA_MODULES)}")
    return {"model.lora.targets": [_LORA_MODULES[m] for m in value]}


def warmup_steps(value: Any, _given: Given) -> dict[str, Any]:
    if value == -1:
        return {"optim.warmup_steps": 0}
    return {"optim.warmup_steps": _count(value, zero=True)}


def trace_backend(value: Any, _given: Given) -> dict[str, Any]:
    if value is None:
        return {}
    if value != "mlflow":
        raise ConfigError("jarl's trainer.trace_backend has jsonl and mlflow")
    return {"trainer.trace_backend": "mlflow"}


def steps(value: Any, _given: Given) -> dict[str, Any]:
    return {} if value is None else {"trainer.steps": _count(value, zero=True)}


def epochs(value: Any, given: Given) -> dict[str, Any]:
    if given.verl.get("trainer.total_training_steps") is not None:
        return {}  # verl: total_training_steps wins
    count, train = _count(value), given.current("data.train")
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
    return {"trainer.steps": count * (rows // prompts)}


def save_every(value: Any, given: Given) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("expected a whole number")
    return {"trainer.save_every": value if value > 0 else max(1, given.current("trainer.steps"))}


def eval_every(value: Any, _given: Given) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("expected a whole number")
    return {"trainer.eval_every": max(value, 0)}


def logger(value: Any, _given: Given) -> dict[str, Any]:
    loggers = value if isinstance(value, list) else [value]
    other = [x for x in loggers if x not in ("console", "tensorboard")]
    if other:
        raise ConfigError(
            f"jarl has no {other[0]} logger: metrics go to the console, the run folder's "
            "metrics.jsonl and TensorBoard (trainer.tensorboard); traces to MLflow with "
            "trainer.trace_backend=mlflow"
        )
    return {"trainer.tensorboard": "tensorboard" in loggers}


def run_dir(_value: Any, given: Given) -> dict[str, Any]:
    folder = given.verl.get("trainer.default_local_dir")
    if folder is None:  # verl's default: checkpoints/${project_name}/${experiment_name}
        project = given.verl.get("trainer.project_name", "verl_examples")
        folder = f"runs/{project}/{given.verl.get('trainer.experiment_name', 'gsm8k')}"
    return {"trainer.run_dir": str(folder)}


def resume(value: Any, _given: Given) -> dict[str, Any]:
    if value not in ("auto", "disable"):
        raise ConfigError(
            "jarl resumes from the run folder's last complete checkpoint (trainer.resume=true) "
            "or starts afresh (false)"
        )
    return {"trainer.resume": value == "auto"}


def reward(_value: Any, given: Given) -> dict[str, Any]:
    path = given.verl.get("custom_reward_function.path")
    if path is None:
        if "custom_reward_function.path" not in given.verl:
            raise ConfigError("needs custom_reward_function.path: data.reward=FILE.py:FUNCTION")
        return {}
    return {
        "data.reward": f"{path}:{given.verl.get('custom_reward_function.name', 'compute_score')}"
    }


ENGINE = "not needed: a setting of verl's {} that jarl does not have"
LOGPROB = (
    "not needed: jarl computes old and reference log-probs inside the train step, in the "
    "learner's micro-batches (learner.micro_batch_size, learner.row_tokens)"
)
FSDP = (
    "not needed: jarl shards weights and optimizer state over the mesh (mesh.fsdp) and offloads "
    "nothing"
)
