"""verl's Hydra keys on jarl's command line: a real verl run script's overrides either become
jarl's keys (sizes converted to counts) or each get one line naming what to use instead."""

import dataclasses
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_agent_rl.compat.verl.keys import TABLE, find, markdown_table, to_jarl
from jax_agent_rl.config import ConfigError, JarlConfig, load_config

ROOT = Path(__file__).parents[1]

# The overrides of verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh (verl
# main, 2026-01), as they are; only the shell variables are filled in below.
VERL_SCRIPT = r"""
    algorithm.adv_estimator=grpo \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    global_profiler.tool=torch_memory \
    global_profiler.save_path=./mem_snapshots \
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000 \
    global_profiler.global_tool_config.torch_memory.stack_depth=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.85 \
    actor_rollout_ref.rollout.multi_stage_wake_up=True \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.rollout.over_sample_rate=0.1 \
    actor_rollout_ref.rollout.mode=async \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang' \
    trainer.experiment_name=$EXPERIMENT_NAME \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=20 \
    trainer.val_before_train=True \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml" \
    trainer.total_epochs=15 $@
"""

# what jarl refuses of it (what it cannot honour), and the words each refusal must say
REFUSED = {
    "data.filter_overlong_prompts": "no equivalent",
    "data.truncation": "never truncates",
    "global_profiler.tool": "jax.profiler",
    "global_profiler.save_path": "jax.profiler",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries": "jax.profiler",
    "global_profiler.global_tool_config.torch_memory.stack_depth": "jax.profiler",
    "actor_rollout_ref.rollout.name": "engine.backend",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "engine.kv_cache_gib",
    "actor_rollout_ref.rollout.over_sample_rate": "no equivalent",
    "trainer.logger": "trainer.tensorboard",
}
# what it accepts with nothing to set (jarl already has their effect), named in one note:
# verl's worker details ("not needed") and values saying what jarl always does
NOT_NEEDED = {
    "actor_rollout_ref.model.use_remove_padding": "learner.packing",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "mesh.fsdp",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "mesh.fsdp",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "learner.micro_batch_size",
    "actor_rollout_ref.rollout.multi_stage_wake_up": "rollout engine",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "learner.micro_batch_size",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "mesh.fsdp",
}
ALWAYS = {
    "data.return_raw_chat": "renders the chat itself",
    "actor_rollout_ref.rollout.mode": "one coroutine per episode",
    "algorithm.use_kl_in_reward": "its KL is in the loss",
    "trainer.critic_warmup": "no critic-only steps",
    "trainer.val_before_train": "when data.val is set",
}


def _script_overrides(tmp_path: Path) -> list[str]:
    """The script's overrides as the shell hands them over, and a 600-row train file."""
    text = (
        VERL_SCRIPT.replace("$HOME", str(tmp_path))
        .replace("$PROJECT_DIR", str(tmp_path))
        .replace("$EXPERIMENT_NAME", "qwen2.5-3b_baseline")
        .replace("$@", "")
    )
    (tmp_path / "data/gsm8k").mkdir(parents=True)
    # verl counts epochs of the train file's rows: 600 of them
    pq.write_table(pa.table({"row": range(600)}), tmp_path / "data/gsm8k/train.parquet")
    return shlex.split(text.replace("\\\n", " "))


def test_a_verl_script_maps_or_says_why_key_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pasted whole, the script is refused for the keys jarl cannot honour only, one line
    each; without them it loads, each converted key told once and the keys jarl needs
    nothing for named in one note."""
    overrides = _script_overrides(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    lines = str(refused.value).splitlines()
    assert len(lines) == len(REFUSED)
    for line, (key, says) in zip(lines, REFUSED.items(), strict=True):
        assert line.startswith(f"verl key {key}="), line
        assert says in line, line
    capsys.readouterr()

    kept = [o for o in overrides if o.split("=")[0] not in REFUSED]
    cfg = load_config(None, kept)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.prompts_per_step == 256
    assert cfg.agent.max_response_tokens == cfg.agent.max_tokens_per_turn == 1024
    assert cfg.engine.max_model_len == 1024 + 1024
    assert cfg.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.optim.lr == 1e-6
    assert cfg.algorithm.mini_batches == 1  # 256 prompts a step in mini-batches of 256
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 8, 1)  # 8 GPUs, TP 1
    assert cfg.learner.micro_batch_size == 32 * 8  # per GPU, over 8 data-parallel devices
    assert (cfg.algorithm.kl_coef, cfg.algorithm.kl_kind) == (0.001, "k3")
    assert cfg.algorithm.entropy_coef == 0.0
    assert cfg.learner.remat is True
    assert cfg.group.n == 16
    assert cfg.trainer.run_dir == "runs/multi-turn-grpo-qwen2.5-3b-sglang/qwen2.5-3b_baseline"
    assert cfg.trainer.steps == 15 * (600 // 256)  # 15 epochs of 2 steps, as verl counts
    assert cfg.trainer.save_every == cfg.trainer.steps  # -1: jarl saves at the end only
    assert cfg.trainer.eval_every == 20
    assert cfg.data.train == f"{tmp_path}/data/gsm8k/train.parquet"
    assert cfg.data.val == f"{tmp_path}/data/gsm8k/test.parquet"
    assert cfg.tools.config.endswith("config/tool_config/gsm8k_tool_config.yaml")
    told = capsys.readouterr().err.splitlines()
    assert "verl key actor_rollout_ref.rollout.n=16 -> group.n=16" in told
    assert (
        "verl key actor_rollout_ref.actor.ppo_mini_batch_size=256 -> algorithm.mini_batches=1"
        in told
    )
    converted = [line for line in told if line.startswith("verl key ")]
    # once each; algorithm.adv_estimator is jarl's own key
    assert len(converted) == len(kept) - 1 - len(NOT_NEEDED) - len(ALWAYS)
    note = told[len(converted) :]
    accepted = len(NOT_NEEDED) + len(ALWAYS)
    assert note[0] == (
        f"{accepted} verl keys accepted with nothing to set (jarl already has their effect):"
    )
    for key, why in (NOT_NEEDED | ALWAYS).items():
        (line,) = [line for line in note[1:] if f"{key}=" in line]
        assert why in line.partition(": ")[2], line
    assert all(line.startswith("  ") for line in note[1:])


def _to_jarl(overrides: list[str], **config: object) -> dict[str, str]:
    base = {"data.prompts_per_step": 16, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
    base |= config
    out = to_jarl(overrides, base.get, lambda _line: None, rows=lambda _path: 100)
    return dict(o.split("=", 1) for o in out)


def test_ppo_mini_batch_size_is_a_size_and_mini_batches_a_count() -> None:
    assert _to_jarl(["actor_rollout_ref.actor.ppo_mini_batch_size=4"]) == {
        "algorithm.mini_batches": "4"  # 16 prompts in mini-batches of 4: 4 optimizer steps
    }
    # the prompts a step from either spelling, in either order
    for overrides in (
        ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
        ["actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.prompts_per_step=64"],
    ):
        assert _to_jarl(overrides)["algorithm.mini_batches"] == "4"


def test_a_mini_batch_size_that_does_not_divide_is_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        _to_jarl(["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=96"])
    (line,) = str(e.value).splitlines()
    assert line.startswith("verl key actor_rollout_ref.actor.ppo_mini_batch_size=96: ")
    assert "data.prompts_per_step=256 does not split into mini-batches of 96" in line
    assert "algorithm.mini_batches (a COUNT)" in line
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=0: expected a whole number >= 1"):
        _to_jarl(["actor_rollout_ref.actor.ppo_mini_batch_size=0"])


def test_other_traps_convert() -> None:
    # epochs count steps only without total_training_steps (verl's rule)
    assert _to_jarl(["trainer.total_epochs=3"], **{"data.train": "t.jsonl"}) == {
        "trainer.steps": "18"  # 3 x (100 rows // 16)
    }
    with pytest.raises(ConfigError, match="has 100 rows, fewer than a step's 128 prompts"):
        _to_jarl(["trainer.total_epochs=3", "data.train_batch_size=128"], **{"data.train": "t"})
    with pytest.raises(ConfigError, match=r"data\.train, which is not set"):
        _to_jarl(["trainer.total_epochs=3"], **{"data.train": ""})
    both = ["trainer.total_epochs=3", "trainer.total_training_steps=2"]
    assert _to_jarl(both) == {"trainer.steps": "2"}
    # micro-batches per GPU over every data-parallel device; the rollout's tensor parallelism
    # is vLLM's, each engine's, and leaves the learner's mesh alone
    got = _to_jarl(
        [
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ]
    )
    assert got == {
        "mesh.fsdp": "8",
        "engine.vllm.tensor_parallel_size": "2",
        "learner.micro_batch_size": "32",
    }
    # verl ignores kl_loss_coef without use_kl_loss
    assert _to_jarl(["actor_rollout_ref.actor.use_kl_loss=False"]) == {"algorithm.kl_coef": "0.0"}
    with pytest.raises(ConfigError, match="use_kl_loss=True"):
        _to_jarl(["actor_rollout_ref.actor.kl_loss_coef=0.1"])
    assert _to_jarl(
        ["custom_reward_function.path=my/score.py", "custom_reward_function.name=score"]
    ) == {"data.reward": '"my/score.py:score"'}
    assert _to_jarl(["data.train_files=[a.parquet]"]) == {"data.train": '"a.parquet"'}
    with pytest.raises(ConfigError, match="without extra keyword arguments: give them defaults"):
        _to_jarl(["custom_reward_function.reward_kwargs.scale=2"])
    with pytest.raises(ConfigError, match="jarl reads one file here, got 2"):
        _to_jarl(["data.train_files=[a.parquet,b.parquet]"])
    for empty in ("null", "", "[]", "[null]"):  # no path: never "got 1 file"
        with pytest.raises(ConfigError, match="expected a file path, got "):
            _to_jarl([f"data.train_files={empty}"])


def test_optimizer_and_common_script_keys() -> None:
    assert _to_jarl(["actor_rollout_ref.actor.optim.betas=[0.9,0.95]"]) == {
        "optim.b1": "0.9",
        "optim.b2": "0.95",
    }
    with pytest.raises(ConfigError, match=r"betas=\[0.9\]: expected \[b1, b2\]"):
        _to_jarl(["actor_rollout_ref.actor.optim.betas=[0.9]"])
    assert _to_jarl(["actor_rollout_ref.actor.optim.lr_warmup_steps=-1"]) == {
        "optim.warmup_steps": "0"  # verl's default: the ratio, 0 by default
    }
    assert _to_jarl(["actor_rollout_ref.actor.optim.lr_warmup_steps=10"]) == {
        "optim.warmup_steps": "10"
    }
    dapo = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]
    dapo.append("algorithm.filter_groups.max_num_gen_batches=10")
    assert _to_jarl(dapo) == {"group.dynamic_sampling": "true", "group.max_refills": "9"}
    refused = {
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1": "set optim.warmup_steps, a COUNT",
        "actor_rollout_ref.rollout.prompt_length=1024": "data.max_prompt_length, which verl",
        "actor_rollout_ref.rollout.response_length=1024": "data.max_response_length, which",
        "data.custom_cls.path=my.py": "with no dataset class",
        "data.seed=1": "data order comes from trainer.seed",
        "data.gen_batch_size=512": "refills dropped groups",
        "algorithm.filter_groups.max_num_gen_batches=0": "0 \\(unbounded\\) has no equivalent",
        "algorithm.filter_groups.metric=seq_len": "jarl compares a group's rewards",
    }
    for override, why in refused.items():
        with pytest.raises(ConfigError, match=re.escape(f"verl key {override}: ") + ".*" + why):
            _to_jarl([override])
    # an engine or layout detail of verl's workers: accepted, any value, named in the note
    not_needed = {
        "actor_rollout_ref.actor.strategy=fsdp2": "jarl shards over the mesh",
        "actor_rollout_ref.rollout.agent.num_workers=8": "as a coroutine in one process",
        "trainer.device=cuda": "JAX uses the accelerator it finds",
        "trainer.balance_batch=True": "packs episodes into rows",
        "ray_init.num_cpus=4": "engine.ray",
        "hydra.run.dir=/tmp/x": "jarl has no Hydra",
    }
    told: list[str] = []
    assert to_jarl(list(not_needed), {}.get, told.append) == []
    (note,) = told
    head, *lines = note.splitlines()
    assert head.startswith("6 verl keys accepted with nothing to set")
    for (override, why), line in zip(not_needed.items(), lines, strict=True):
        assert line.startswith(f"  {override}: not needed: ") and why in line, line


def test_max_parallel_calls_is_the_per_turn_cap() -> None:
    """verl's multi_turn.max_parallel_calls is how many of a turn's calls run (verl drops the
    rest), so it sets jarl's per-turn cap, not how many calls run at once."""
    key = "actor_rollout_ref.rollout.multi_turn.max_parallel_calls"
    assert _to_jarl([f"{key}=2"]) == {"agent.max_tool_calls_per_turn": "2"}
    entry = find(key)
    assert entry is not None and entry.jarl == "agent.max_tool_calls_per_turn"
    assert "verl drops" in entry.how and "error observation" in entry.how
    cfg = load_config(None, ["model.path=/a", "data.train=t", f"{key}=3"])
    assert cfg.agent.max_tool_calls_per_turn == 3


def test_a_jarl_key_set_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"group\.n is set directly and by verl key"):
        _to_jarl(["group.n=4", "actor_rollout_ref.rollout.n=8"])


def test_jarl_overrides_pass_untouched() -> None:
    overrides = ["env.classes={a: b}", "env.classes.a=c", "group.n=4"]
    assert to_jarl(overrides, {}.get, lambda _line: None) == overrides


def test_the_table_is_docs_verl_md() -> None:
    """Every key of the table, with its jarl key and how, is in docs/verl.md as generated."""
    assert markdown_table() in (ROOT / "docs/verl.md").read_text(encoding="utf-8")


def test_no_verl_key_of_the_table_is_a_jarl_key() -> None:
    """A verl spelling that is also jarl's would be read as jarl's; only identical keys may."""

    def keys(cls: type, prefix: str = "") -> set[str]:
        out = set()
        for f in dataclasses.fields(cls):
            inner = f.default_factory
            if inner is not dataclasses.MISSING and dataclasses.is_dataclass(inner):
                out |= keys(inner, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            out.add(f"{prefix}{f.name}")
        return out

    jarl = keys(JarlConfig)
    for entry in TABLE:
        assert (entry.verl in jarl) == (entry.verl == entry.jarl), entry.verl
        for target in filter(None, entry.jarl.split(", ")):
            assert target in jarl, target
        assert find(entry.verl) is entry


def test_verl_lora_keys_map_to_model_lora() -> None:
    """verl's LoRA keys: rank and alpha as they are, target_modules from PEFT's module names
    (``all-linear``, verl's default, is every projection); the result loads as a config."""
    verl = [
        "actor_rollout_ref.model.lora_rank=32",
        "actor_rollout_ref.model.lora_alpha=64",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]",
    ]
    got = _to_jarl(verl)
    assert got == {
        "model.lora.rank": "32",
        "model.lora.alpha": "64",
        "model.lora.targets": '["q", "v", "down"]',
    }
    lora = load_config(
        None, ["model.path=/a", "data.train=t", *(f"{k}={v}" for k, v in got.items())]
    ).model.lora
    assert (lora.rank, lora.alpha, lora.targets) == (32, 64.0, ["q", "v", "down"])
    assert _to_jarl(["actor_rollout_ref.model.target_modules=all-linear"]) == {
        "model.lora.targets": '["q", "k", "v", "o", "gate", "up", "down"]'
    }
    with pytest.raises(ConfigError, match=r"target_modules=\[qkv\]: expected all-linear or a"):
        _to_jarl(["actor_rollout_ref.model.target_modules=[qkv]"])
    assert _to_jarl(["actor_rollout_ref.model.lora_adapter_path=/a"]) == {
        "model.lora.adapter_path": '"/a"'
    }


def test_a_response_budget_leaves_an_interaction_its_turns() -> None:
    """data.max_response_length is verl's budget of the whole conversation, and jarl's per-turn
    cap too unless one is given (then it stands: it was refused as "keep one"). With an
    interaction and no per-turn cap, one model turn could take the whole budget and leave the
    interaction none (the run trained on nothing and exited 0): refused, naming the key."""
    key = "data.max_response_length=64"
    assert _to_jarl([key]) == {
        "agent.max_response_tokens": "64",
        "agent.max_tokens_per_turn": "64",
    }
    both = _to_jarl([key, "agent.max_tokens_per_turn=16"])
    assert both == {"agent.max_response_tokens": "64", "agent.max_tokens_per_turn": "16"}
    interaction = {"env.interaction_config": "interaction.yaml"}
    with pytest.raises(ConfigError, match=r"set agent\.max_tokens_per_turn beside it .*=16\)"):
        _to_jarl([key], **interaction)
    given = _to_jarl([key, "agent.max_tokens_per_turn=16"], **interaction)
    assert given == both
    cfg = load_config(None, ["model.path=/a", "data.train=t", key, "agent.max_tokens_per_turn=16"])
    assert (cfg.agent.max_response_tokens, cfg.agent.max_tokens_per_turn) == (64, 16)
