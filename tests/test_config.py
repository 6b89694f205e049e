"""Run configs: YAML + dotted overrides into frozen dataclasses; every mistake names its key."""

import dataclasses
import os
import re
import types
import typing
from pathlib import Path

import pytest

import jax_agent_rl
from jax_agent_rl.agent.context import AgentConfig
from jax_agent_rl.config import (
    ConfigError,
    JarlConfig,
    absolute_paths,
    field_ranges,
    load_config,
    missing_paths,
    to_yaml,
)

PACKAGE = Path(jax_agent_rl.__file__).parent


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "model:\n  path: /ckpt\n  dtype: float32\nmesh:\n  fsdp: 2\ndata:\n  train: t.jsonl\n",
    )
    cfg = load_config(path, ["model.dtype=bfloat16", "mesh.tensor=4"])
    assert isinstance(cfg, JarlConfig)
    assert cfg.model.path == "/ckpt" and cfg.model.dtype == "bfloat16"
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.path = "x"  # type: ignore[misc]
    assert load_config(None, ["model.path=/a", "data.train=t"]).model.path == "/a"
    assert "dtype: bfloat16" in to_yaml(cfg)


def test_misspelled_key_names_it_and_the_allowed_keys(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'model\.dtpye'; allowed here: "
        r"\['dtype', 'exact_logprobs', 'lora', 'module', 'path', 'tokenizer'\]",
    ):
        load_config(None, ["model.path=/a", "model.dtpye=bfloat16"])
    path = _yaml(tmp_path, "modle:\n  path: /x\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'modle'; allowed here: \['agent', 'algorithm', 'data', "
        r"'engine', 'env', 'group', 'learner', 'mesh', 'model', 'optim', 'policies', 'sampling', "
        r"'sft', 'tools', 'trainer'\]",
    ):
        load_config(path)


def test_bad_values_name_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"^model\.dtype='float16': expected one of \['float32', 'bfloat16'\]$"
    ):
        load_config(None, ["model.path=/a", "model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"^algorithm\.loss_agg_mode='mean': expected one of"):
        load_config(None, ["algorithm.loss_agg_mode=mean"])
    with pytest.raises(ConfigError, match=r"^mesh\.fsdp='two': expected a whole number$"):
        load_config(None, ["model.path=/a", "mesh.fsdp=two"])
    with pytest.raises(
        ConfigError, match=r"required config keys not set: \['data\.train', 'model\.path'\]"
    ):
        load_config(None, [])
    with pytest.raises(ConfigError, match=r"not of the form key\.sub=value"):
        load_config(None, ["model.path"])
    with pytest.raises(
        ConfigError, match=r"^override '~trainer\.run_dir': Hydra's ~key \(delete\)"
    ):
        load_config(None, ["model.path=/a", "~trainer.run_dir"])


def test_a_verl_config_file_is_told_where_verl_keys_go(tmp_path: Path) -> None:
    for text in ("defaults:\n- ppo_trainer\n", "actor_rollout_ref:\n  rollout:\n    n: 4\n"):
        path = tmp_path / "verl.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"a verl \(Hydra\) config file\? .*docs/verl\.md"):
            load_config(path, ["model.path=/a", "data.train=t"])


def test_an_unknown_key_in_a_section_verl_shares_points_to_docs_verl_md() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'data\.prompt_key'; .*; a verl key"):
        load_config(None, ["model.path=/a", "data.train=t", "data.prompt_key=prompt"])


def test_a_shipped_config_named_from_another_folder_is_pointed_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shipped = Path(jax_agent_rl.__file__).parents[1] / "configs/gsm8k_tools_qwen2.5.yaml"
    meant = "does not exist: did you mean " + re.escape(str(shipped))
    with pytest.raises(ConfigError, match=meant):
        load_config("configs/gsm8k_tools_qwen2.5.yaml")
    with pytest.raises(ConfigError, match=r"does not exist$"):
        load_config("configs/no_such.yaml")


def test_hydras_add_and_force_prefixes_set_a_key() -> None:
    plain = load_config(None, ["model.path=/a", "data.train=t", "group.n=4"])
    for prefix in ("+", "++"):
        cfg = load_config(None, [f"{prefix}model.path=/a", "data.train=t", f"{prefix}group.n=4"])
        assert cfg == plain
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")
    with pytest.raises(ConfigError, match="is a folder: name a YAML file"):
        load_config(Path(__file__).parent)


def test_a_config_file_that_is_a_fifo_is_named_as_not_a_regular_file(tmp_path: Path) -> None:
    """A named pipe (or a device) exists but is no file: it was reported as missing."""
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=re.escape("run.yaml is not a regular file: name a")):
        load_config(fifo)


def _numeric_keys(cls: type, prefix: str = "") -> set[str]:
    """Dotted keys of every int / float (optional or not) field under ``cls``."""
    keys: set[str] = set()
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            keys |= _numeric_keys(hint, f"{prefix}{name}.")
        elif {a for a in typing.get_args(hint) if a is not type(None)} <= {int, float} and (
            hint in (int, float) or typing.get_origin(hint) in (typing.Union, types.UnionType)
        ):
            keys.add(f"{prefix}{name}")
    return keys


def test_every_number_has_a_range() -> None:
    """A numeric field added to a section must say which values it accepts."""
    assert set(field_ranges(JarlConfig)) == _numeric_keys(JarlConfig)


def test_values_out_of_range_are_all_reported_one_line_each() -> None:
    bad = [
        "sampling.top_p=0", "sampling.top_k=0", "algorithm.clip_c=1.0", "optim.lr=nan",
        "optim.b2=1.0", "trainer.save_every=0", "trainer.steps=-3",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/a", "data.train=t", *bad])
    assert str(e.value).splitlines() == [
        "sampling.top_p=0.0: expected in (0, 1]",
        "sampling.top_k=0: expected -1 or >= 1",
        "algorithm.clip_c=1.0: expected null or > 1",
        "optim.lr=nan: expected a finite number > 0",
        "optim.b2=1.0: expected in [0, 1)",
        "trainer.steps=-3: expected >= 0",
        "trainer.save_every=0: expected >= 1",
    ]
    ok = ["algorithm.clip_c=null", "sampling.top_k=-1", "sampling.temperature=0", "trainer.steps=0"]
    assert load_config(None, ["model.path=/a", "data.train=t", *ok]).algorithm.clip_c is None


def test_max_tool_calls_per_turn_is_a_count_the_loop_reads() -> None:
    base = ["model.path=/a", "data.train=t"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "agent.max_tool_calls_per_turn=0"])
    assert str(e.value) == "agent.max_tool_calls_per_turn=0: expected >= 1"
    agent = load_config(None, [*base, "agent.max_tool_calls_per_turn=3"]).agent
    assert AgentConfig.of(agent).max_tool_calls_per_turn == 3


def test_a_moved_key_names_its_new_name() -> None:
    base = ["model.path=/a", "data.train=t"]
    with pytest.raises(ConfigError, match=r"'algorithm.dynamic_sampling' is now 'group.dynamic"):
        load_config(None, [*base, "algorithm.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match=r"'algorithm.overlong_buffer' is now 'data.overlong_buf"):
        load_config(None, [*base, "algorithm.overlong_buffer=4"])
    assert load_config(None, [*base, "data.overlong_buffer=4"]).data.overlong_buffer == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_loop_s_mode_is_one_key_the_staleness(tmp_path: Path, mode: str) -> None:
    """trainer.mode (sync / async) and trainer.max_staleness described one setting: the loop
    at staleness 0 is the synchronous one. A config that still sets the mode, as an override
    or in its YAML, is told the one key; the default is the synchronous loop."""
    base = ["model.path=/a", "data.train=t"]
    told = "config key 'trainer.mode' is now 'trainer.max_staleness'"
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"trainer.mode={mode}"])
    assert str(e.value) == told
    path = tmp_path / "run.yaml"
    path.write_text(f"trainer:\n  mode: {mode}\n  max_staleness: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, base)
    assert str(e.value) == told
    assert load_config(None, base).trainer.max_staleness == 0


def test_a_backend_option_moved_into_its_section_names_its_new_key(tmp_path: Path) -> None:
    """The vllm and jetstream backends' options live in engine.vllm / engine.jetstream; the
    old flat spellings, as an override or in a YAML file, are told the new key."""
    base = ["model.path=/a", "data.train=t"]
    for old, new in [
        ("rollout.vllm_python", "engine.vllm.python"),
        ("rollout.vllm_devices", "engine.vllm.devices"),
        ("rollout.vllm.kv_cache_mb", "engine.kv_cache_gib"),  # (read by every backend)
        ("rollout.jetstream_python", "engine.jetstream.python"),
        ("rollout.replicas", "engine.vllm.replicas"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*base, f"{old}=1"])
        assert str(e.value) == f"config key {old!r} is now {new!r}"
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "rollout:\n  replicas: 2\n"), base)
    assert str(e.value) == "config key 'rollout.replicas' is now 'engine.vllm.replicas'"
    cfg = load_config(None, [*base, "engine.vllm.python=x", "engine.vllm.replicas=2"])
    assert (cfg.engine.vllm.python, cfg.engine.vllm.replicas) == ("x", 2)


def test_the_rollout_section_split_into_engine_sampling_and_group(tmp_path: Path) -> None:
    """The rollout section's keys live in engine (the backend and its memory), sampling and
    group (with agent.strategy and agent.tree); each old key, a moved section's included, as an
    override or in a YAML file, is told the new key."""
    base = ["model.path=/a", "data.train=t"]
    for old, new in [
        ("rollout.backend", "engine.backend"),
        ("rollout.page_size", "engine.page_size"),
        ("rollout.ray.address", "engine.ray.address"),
        ("rollout.vllm.tensor_parallel_size", "engine.vllm.tensor_parallel_size"),
        ("rollout.temperature", "sampling.temperature"),
        ("rollout.top_k", "sampling.top_k"),
        ("rollout.n", "group.n"),
        ("rollout.max_refills", "group.max_refills"),
        ("rollout.tool_failure_reruns", "group.tool_failure_reruns"),
        ("agent.strategy", "group.strategy"),
        ("agent.tree.n_roots", "group.tree.n_roots"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*base, f"{old}=1"])
        assert str(e.value) == f"config key {old!r} is now {new!r}"
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "rollout:\n  ray:\n    replicas: 2\n"), base)
    assert str(e.value) == "config key 'rollout.ray.replicas' is now 'engine.ray.replicas'"
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "agent:\n  tree: {}\n"), base)
    assert str(e.value) == "config key 'agent.tree' is now 'group.tree'"
    new_keys = ["engine.ray.replicas=3", "sampling.temperature=0.5", "group.tree.branch=4"]
    cfg = load_config(None, [*base, *new_keys])
    assert (cfg.engine.ray.replicas, cfg.sampling.temperature, cfg.group.tree.branch) == (3, 0.5, 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["mesh.data=2", "mesh.fsdp=2", "learner.packing=false", "learner.micro_batch_size=6"],
            "learner.micro_batch_size=6 does not split over mesh.data x mesh.fsdp = 4 devices: "
            "use a multiple of 4",
        ),
        (
            [
                "mesh.data=2",
                "mesh.fsdp=2",
                "learner.micro_batch_size=8",
                "engine.max_concurrent=6",
            ],
            "engine.max_concurrent=6 does not split over mesh.data x mesh.fsdp = 4 devices (the "
            "embedded engine's decode slots): use a multiple of 4",
        ),
        (
            ["engine.max_concurrent=256", "engine.max_step_tokens=128"],
            "engine.max_step_tokens=128 is fewer than the 256 decode slots of a shard "
            "(engine.max_concurrent=256 over 1): an engine step computes every one of them; "
            "use at least 256",
        ),
        (
            ["sft.data=d.jsonl", "sft.steps=5", "sft.batch_size=12", "learner.micro_batch_size=8"],
            "sft.batch_size=12 does not split into micro-batches of learner.micro_batch_size=8 "
            "over mesh.data x mesh.fsdp = 1 devices: use a multiple of 8, or a multiple of 1 "
            "below 8",
        ),
        (
            ["group.n=1"],
            "group.n=1: a GRPO group of one sample has zero advantage, nothing is learned; "
            "use group.n >= 2 (or algorithm.adv_estimator=gae)",
        ),
        (
            ["data.overlong_buffer=800", "agent.max_response_tokens=768"],
            "data.overlong_buffer=800 is longer than agent.max_response_tokens=768: use 0 "
            "(off) to 768",
        ),
        (
            ["algorithm.rollout_mask=icepop"],
            "algorithm.rollout_mask=icepop weights each kept token by its ratio itself; "
            "algorithm.tis_cap=2.0 would truncate that weight: set algorithm.tis_cap=null",
        ),
        (
            ["algorithm.rollout_mask=geometric", "algorithm.geo_mask_low=1.02"],
            "algorithm.geo_mask_low=1.02, algorithm.geo_mask_high=1.01: the band must hold 1 (a "
            "sampler that agrees with the learner), low <= 1 <= high",
        ),
        (
            ["algorithm.adv_estimator=gigpo"],
            "algorithm.adv_estimator=gigpo gives each turn its own advantage: it needs "
            "algorithm.turn_mode=per_turn (one training row per model turn)",
        ),
        (
            ["algorithm.gigpo_gamma=0.9", "algorithm.adv_estimator=tree_grpo"],
            "algorithm.gigpo_gamma=0.9 has no effect with algorithm.adv_estimator=tree_grpo: "
            "it is read by adv_estimator=gigpo\n"
            "algorithm.adv_estimator=tree_grpo gives each turn its own advantage: it needs "
            "algorithm.turn_mode=per_turn (one training row per model turn)",
        ),
        (
            ["agent.context.compact=1024"],
            "agent.context.compact=1024 is not below engine.max_model_len=1024: the context "
            "would end the episode before it compacts",
        ),
        (
            ["agent.sub_agent_tool=delegate", "group.strategy=tree"],
            "agent.context.compact, agent.context.strip_thinking and agent.sub_agent_tool "
            "start new samples of a chain episode (tool_agent); group.strategy=tree branches "
            "episodes that only append",
        ),
        (
            ["algorithm.cispo_clip_high=4"],
            "algorithm.cispo_clip_high=4.0 has no effect with algorithm.policy_loss=ppo: it is "
            "read by policy_loss=cispo",
        ),
        (
            ["algorithm.policy_loss=cispo", "algorithm.clip_high=0.28"],
            "algorithm.clip_high=0.28 has no effect with algorithm.policy_loss=cispo: it is read "
            "by policy_loss=ppo",
        ),
        (
            [
                "algorithm.kpop_threshold=0.2",
                "algorithm.rollout_mask=icepop",
                "algorithm.tis_cap=null",
            ],
            "algorithm.kpop_threshold=0.2 has no effect with algorithm.rollout_mask=icepop: it "
            "is read by rollout_mask=kpop",
        ),
        (
            ["engine.backend=vllm", "engine.vllm.replicas=2", "engine.vllm.devices=0,1,2"],
            "engine.vllm.devices='0,1,2' names 3 devices for engine.vllm.replicas=2 of "
            "engine.vllm.tensor_parallel_size=1: give 1 per replica, or none",
        ),
        (
            [
                "engine.backend=vllm",
                "engine.vllm.replicas=2",
                "engine.vllm.tensor_parallel_size=2",
                "engine.vllm.devices=0,1,2",
            ],
            "engine.vllm.devices='0,1,2' names 3 devices for engine.vllm.replicas=2 of "
            "engine.vllm.tensor_parallel_size=2: give 2 per replica, or none",
        ),
    ],
)
def test_values_that_must_fit_each_other(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/a", "data.train=t", *overrides])
    assert str(e.value) == message


def test_packed_micro_batches_are_a_row_per_device() -> None:
    """With packing, an RL micro-batch is one row per data-parallel device (what the learner
    is built with), so learner.micro_batch_size need not split over them; without packing it
    is that many rows, split over them."""
    from jax_agent_rl.train.learners import micro_batch_rows

    mesh = ["mesh.data=2", "mesh.fsdp=8", "engine.max_concurrent=16"]
    cfg = load_config(None, ["model.path=/a", "data.train=t", *mesh, "learner.micro_batch_size=8"])
    assert micro_batch_rows(cfg) == 16
    unpacked = ["learner.packing=false", "learner.micro_batch_size=8"]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/a", "data.train=t", *mesh, *unpacked])
    assert str(e.value) == (
        "learner.micro_batch_size=8 does not split over mesh.data x mesh.fsdp = 16 devices: "
        "use a multiple of 16"
    )


def test_unread_required_keys_load_empty() -> None:
    """A command that reads no data (jarl plan) may leave data.train unset; any other
    required key still has to be set."""
    cfg = load_config(None, ["model.path=/a"], unread=("data.train",))
    assert cfg.data.train == ""
    with pytest.raises(ConfigError, match=r"required config keys not set: \['model.path'\]"):
        load_config(None, [], unread=("data.train",))


def test_shipped_files_resolve_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pkg://`` names a file inside the package, wherever jarl runs; the default tools file
    is one. Other relative paths stay relative to the current directory."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.path=ckpt", "data.train=t.jsonl"])
    assert cfg.tools.config == str(PACKAGE / "configs" / "tools_default.yaml")
    assert Path(cfg.tools.config).is_file()
    assert (cfg.model.path, cfg.data.train) == ("ckpt", "t.jsonl")
    for config in sorted((PACKAGE.parent / "configs").glob("*.yaml")):
        shipped = load_config(config, ["model.path=m", "data.train=t", "data.val=", "sft.data="])
        assert Path(shipped.tools.config).is_file(), config.name
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=m", "data.train=t", "tools.config=pkg://no_such_pkg/t.yaml"])
    assert str(e.value) == (
        "tools.config='pkg://no_such_pkg/t.yaml': no installed package 'no_such_pkg'; expected "
        "pkg://<package>/<path inside it>"
    )


def test_a_run_folder_config_holds_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths are relative to the directory jarl runs in; `absolute_paths` writes them
    out against it, Python files of function specs included (modules stay names), so the run
    folder's config.yaml reads the same from any other directory."""
    started = tmp_path / "project"
    started.mkdir()
    monkeypatch.chdir(started)
    overrides = [
        "model.path=ckpt", "data.train=data/train.jsonl", "data.val=/abs/val.jsonl",
        "data.reward=rewards/mine.py:score", "data.rewards_by_source.src=my_pkg.rewards:score",
        "data.rewards_by_source.openai/gsm8k=verl_gsm8k",
        "env.classes.guess=envs/guess.py:Guess", "env.interaction_config=interaction.yaml",
        "agent.graph=graphs.py:graph", "trainer.run_dir=runs/x", "model.module=nets/lm.py:make",
    ]  # fmt: skip
    cfg = absolute_paths(load_config(None, overrides), Path.cwd())
    assert cfg.model.module == f"{started / 'nets/lm.py'}:make"
    assert cfg.model.path == str(started / "ckpt") and cfg.model.tokenizer == ""
    assert cfg.data.train == str(started / "data/train.jsonl") and cfg.data.val == "/abs/val.jsonl"
    assert cfg.data.reward == f"{started / 'rewards/mine.py'}:score"
    assert cfg.data.rewards_by_source["src"] == "my_pkg.rewards:score"
    assert cfg.data.rewards_by_source["openai/gsm8k"] == "verl_gsm8k"  # a built-in name
    assert cfg.env.classes == {"guess": f"{started / 'envs/guess.py'}:Guess"}
    assert cfg.env.interaction_config == str(started / "interaction.yaml")
    assert cfg.agent.graph == f"{started / 'graphs.py'}:graph" and cfg.agent.harness == ""
    assert cfg.trainer.run_dir == str(started / "runs/x")
    assert cfg.tools.config == str(PACKAGE / "configs" / "tools_default.yaml")
    run_config = _yaml(tmp_path, to_yaml(cfg))
    monkeypatch.chdir(tmp_path)
    assert load_config(run_config) == cfg
    assert missing_paths(cfg, ["model.path", "model.tokenizer", "data.val"]) == [
        f"model.path={str(started / 'ckpt')!r} does not exist",
        "data.val='/abs/val.jsonl' does not exist",
    ]


def test_lora_section_refuses_bad_values_naming_the_key() -> None:
    """``model.lora``: rank 0 is off; targets are names of the decoder's projections (the same
    list as the model's, `models.lora.TARGETS`); dropout, not implemented, is refused."""
    from jax_agent_rl.config.model import LORA_TARGETS
    from jax_agent_rl.models.lora import TARGETS

    assert LORA_TARGETS == TARGETS
    base = ["model.path=/a", "data.train=t", "model.lora.rank=8"]
    lora = load_config(None, [*base, "model.lora.targets=[q,v]"]).model.lora
    assert (lora.rank, lora.alpha, lora.targets) == (8, 16.0, ["q", "v"])
    for bad, message in (
        ("model.lora.dropout=0.05", "model.lora.dropout=0.05: expected 0 (LoRA dropout is not"),
        ("model.lora.targets=[q,qkv]", "model.lora.targets=['q', 'qkv']: expected distinct"),
        ("model.lora.targets=[q,q]", "model.lora.targets=['q', 'q']: expected distinct"),
        ("model.lora.alpha=0", "model.lora.alpha=0.0: expected > 0"),
        ("model.lora.rnk=8", "unknown config key 'model.lora.rnk'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [*base, bad])


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.backend=vllm"],
        ["engine.backend=jetstream"],
        ["engine.ray.address=auto"],
        ["engine.backend=vllm", "engine.ray.address=auto"],
        ["engine.backend=jetstream", "engine.ray.address=auto"],
    ],
)
def test_every_built_in_backend_takes_a_lora_run(overrides: list[str]) -> None:
    """Each built-in backend serves a LoRA policy's adapters (vLLM through its own LoRA
    support, JetStream's server and Ray's replicas as the embedded engine does), so a LoRA
    config loads with any of them; a backend that does not declare it is refused once built
    (`rollout.registry.lora_problem`)."""
    cfg = load_config(None, ["model.path=/a", "data.train=t", "model.lora.rank=8", *overrides])
    assert cfg.model.lora.rank == 8


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        (["engine.backend=vllm"], "engine.backend=vllm"),
        (["engine.ray.address=auto"], "engine.backend=embedded on Ray replicas"),
    ],
)
def test_only_the_embedded_engine_keeps_its_kv_over_a_push(
    overrides: list[str], where: str
) -> None:
    """engine.keep_kv_on_update on a backend that drains before a push is refused when the
    config loads, in one line naming the key and the backend; the embedded engine takes it."""
    base = ["model.path=/a", "data.train=t"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "engine.keep_kv_on_update=true", *overrides])
    assert str(e.value) == (
        f"engine.keep_kv_on_update=true: {where} drains its requests before a weight push "
        "and keeps no KV over it; use engine.backend=embedded without engine.ray.address, "
        "or keep_kv_on_update=false"
    )
    assert load_config(None, [*base, "engine.keep_kv_on_update=true"]).engine.keep_kv_on_update
