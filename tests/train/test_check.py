"""`jarl train` checks a config and everything it names before a run starts (`check_run`): each
bad input is one line naming the key, the value and what would be accepted, exit code 2, no
traceback; ``--dry-run`` stops after the checks. Shipped configs work from any directory."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from jax_agent_rl.cli import main
from jax_agent_rl.config import (
    AlgorithmSection,
    ConfigError,
    DataSection,
    LoraSection,
    MeshSection,
    PushSection,
    load_config,
    package_file,
)
from jax_agent_rl.models import (
    DecoderPolicy,
    ModelConfig,
    Sharder,
    inference_mesh,
    init_params,
    make_mesh,
    page_shardings,
    save_hf,
)
from jax_agent_rl.models.decoder import is_spec, param_specs
from jax_agent_rl.models.hf_local import SMALL_QWEN2, TINY
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rewards import REWARDS
from jax_agent_rl.rewards.registry import scored_by_fallback
from jax_agent_rl.rl.batch import TrainBatch
from jax_agent_rl.rl.objectives import SamplingSpec, StepSpec, token_stats
from jax_agent_rl.tokenization import chat_template, save_tokenizer, train_bpe
from jax_agent_rl.tokenization.tokenizer import render_template
from jax_agent_rl.tokenization.tool_calls import PARSERS
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train.build import build_run
from jax_agent_rl.train.check import check_run
from jax_agent_rl.train.check_mesh import mesh_problems
from jax_agent_rl.train.memory import activation_bytes, plan_memory

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = "pkg://jax_agent_rl/configs/tools_calculator.yaml"
# two KV heads (so tensor=4 cannot shard them); every other dimension divides by 4
MODEL = {**TINY["qwen2"], "vocab_size": 1024, "max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True)
class Files:
    root: Path
    model: Path
    train: Path
    sft: Path
    config: Path  # a valid run config over the files above
    bad_columns: Path  # a row without a prompt column
    string_prompt: Path  # parquet, prompt given as a string
    verl_tool_rows: Path  # create kwargs (extra_info.tools_kwargs) for verl's GSM8K tool


def _row(i: int) -> dict:
    return {
        "data_source": "toy",
        "prompt": [
            {"role": "system", "content": "Use the calculator, then answer in <answer></answer>."},
            {"role": "user", "content": f"What is {i} + {i}?"},
        ],
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i},
    }


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """A tiny checkpoint whose tokenizer learnt the rendered prompts (so they are short), its
    data, demonstrations and a run config, all written here."""
    root = tmp_path_factory.mktemp("check")
    rows = [_row(i) for i in range(4)]
    template = chat_template("chatml_tools")
    schemas = ToolRegistry.from_yaml(package_file(CALCULATOR, "tools.config")).schemas()
    corpus = [render_template(template, r["prompt"], schemas, True) for r in rows] * 4
    model = root / "model"
    save_tokenizer(model, train_bpe(corpus, 1000, merge_across_words=True), template)
    cfg = ModelConfig.from_hf(MODEL)
    save_hf(model, cfg, init_params(jax.random.key(0), cfg, sharder=one_device_sharder()))
    train = _write_jsonl(root / "train.jsonl", rows)
    answer = {"role": "assistant", "content": "<answer>2</answer>"}
    sft = _write_jsonl(root / "sft.jsonl", [{"messages": [*r["prompt"], answer]} for r in rows])
    config = root / "run.yaml"
    config.write_text(
        f"model:\n  path: {model}\ndata:\n  train: {train}\n"
        f"tools:\n  config: {CALCULATOR}\nengine:\n  max_model_len: 1024\n"
    )
    bad_columns = _write_jsonl(
        root / "bad_columns.jsonl",
        [{"question": "What is 1 + 1?", "reward_model": {"style": "rule", "ground_truth": "2"}}],
    )
    string_prompt = root / "string_prompt.parquet"
    pq.write_table(pa.Table.from_pylist([{**_row(0), "prompt": "What is 0 + 0?"}]), string_prompt)
    (root / "empty").mkdir()
    create = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "0"}}}
    verl_tool_rows = _write_jsonl(
        root / "verl_tool_rows.jsonl", [{**_row(0), "extra_info": {"tools_kwargs": create}}]
    )
    return Files(root, model, train, sft, config, bad_columns, string_prompt, verl_tool_rows)


def test_a_valid_config_passes_and_nothing_runs(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = files.root / "run"
    assert main(["train", str(files.config), f"trainer.run_dir={run_dir}", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert f"path: {files.model}" in out
    assert err.endswith("nothing was run\n")
    assert not run_dir.exists()


Case = tuple[Callable[[Files], list[str]], Callable[[Files], str]]

# failure class -> (overrides, the one line expected); each line is what `jarl` prints
CASES: dict[str, Case] = {
    "tools_kwargs for a tool the run lacks": (
        lambda f: [f"data.train={f.verl_tool_rows}", "agent.default_agent_loop=tool_agent"],
        lambda _f: (
            "data.train: row 0's extra_info.tools_kwargs names ['calc_gsm8k_reward'], which "
            f"tools.config={str(package_file(CALCULATOR, 'tools.config'))!r} lacks (it has "
            "['calculator']): set tools.config to "
            "the YAML of those tools"
        ),
    ),
    "tools_kwargs of the wrong shape": (  # before: passed, and every episode failed
        lambda f: [
            "data.train="
            + str(
                _write_jsonl(
                    f.root / "create_kwargs_not_a_dict.jsonl",
                    [
                        {
                            **_row(0),
                            "extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": 5}}},
                        }
                    ],
                )
            ),
            "agent.default_agent_loop=tool_agent",
        ],
        lambda _f: (
            "data.train: row 0: extra_info.tools_kwargs['calculator']['create_kwargs'] must be "
            "a dict, got int"
        ),
    ),
    "bad data columns": (
        lambda f: [f"data.train={f.bad_columns}"],
        lambda f: (
            f"data.train='{f.bad_columns}': row 0 (line 1): no 'prompt' column "
            "(columns: ['question', 'reward_model'])"
        ),
    ),
    "prompt as a string": (
        lambda f: [f"data.train={f.string_prompt}"],
        lambda f: (
            f"data.train='{f.string_prompt}': row 0: prompt must be a non-empty list of "
            "messages, got str"
        ),
    ),
    "empty model folder": (
        lambda f: [f"model.path={f.root / 'empty'}"],
        lambda f: (
            f"model.path='{f.root / 'empty'}' has no config.json: expected an HF "
            "checkpoint folder (config.json, model.safetensors or its index, the tokenizer)"
        ),
    ),
    "model.path a device": (  # before: "does not exist"
        lambda _f: ["model.path=/dev/null"],
        lambda _f: "model.path='/dev/null' is not a folder: expected an HF checkpoint folder",
    ),
    "run folder a file": (  # before: the dry run said ok; the run stopped when it began
        lambda f: [f"trainer.run_dir={f.config}"],
        lambda f: f"trainer.run_dir={str(f.config)!r} is a file, not a folder",
    ),
    "run folder under a file": (
        lambda f: [f"trainer.run_dir={f.config / 'run'}"],
        lambda f: (
            f"trainer.run_dir={str(f.config / 'run')!r} is under {str(f.config)!r}, a file, "
            "not a folder"
        ),
    ),
    "unknown parser": (
        lambda _f: ["agent.parser=hermez"],
        lambda _f: (
            "agent.parser='hermez' is not a registered tool-call parser: use one of "
            f"{sorted(PARSERS)}"
        ),
    ),
    "unknown reward": (
        lambda _f: ["data.reward=maths"],
        lambda _f: (
            f"data.reward='maths' is not a reward; built in: "
            f"{', '.join(sorted([*REWARDS, 'reasoning_gym']))}, judge (a model, data.judge); or a "
            "user function as module:function or path/to/file.py:function (docs/rewards.md)"
        ),
    ),
    "empty reward entry": (  # ambiguous: data.reward, or the source's default?
        lambda _f: ["data.reward=format", "data.rewards_by_source.openai/gsm8k="],
        lambda _f: (
            "data.rewards_by_source.openai/gsm8k is empty: name its reward, or remove the entry "
            "to score the source by data.reward (or, with data.reward unset, by source)"
        ),
    ),
    "negative steps": (
        lambda _f: ["trainer.steps=-1"],
        lambda _f: "trainer.steps=-1: expected >= 0",
    ),
    "negative temperature": (
        lambda _f: ["sampling.temperature=-0.5"],
        lambda _f: "sampling.temperature=-0.5: expected >= 0",
    ),
    "max_model_len above the model's": (
        lambda _f: ["engine.max_model_len=8192"],
        lambda _f: (
            "engine.max_model_len=8192 exceeds the model's max_position_embeddings=4096: "
            "use engine.max_model_len <= 4096"
        ),
    ),
    "missing vllm.python": (
        lambda f: ["engine.backend=vllm", f"engine.vllm.python={f.root / 'no' / 'python'}"],
        lambda f: (
            f"engine.vllm.python='{f.root / 'no' / 'python'}' does not exist: expected "
            "the python of a venv with vLLM (scripts/setup.sh vllm makes .venv-vllm)"
        ),
    ),
    "vllm.python without the engine's distribution": (
        # this process's interpreter: a real Python without jarl-gpu-backend (gpu_backend/)
        lambda _f: ["engine.backend=vllm", f"engine.vllm.python={sys.executable}"],
        lambda _f: (
            f"engine.vllm.python: the vLLM interpreter {sys.executable} has no "
            "jarl-gpu-backend (jarl_gpu_backend) installed; build it with `scripts/setup.sh "
            "vllm` (a venv of your own, e.g. with vLLM's CUDA build: `pip install --no-deps -e "
            "gpu_backend` into it)"
        ),
    ),
    "missing jetstream.python": (
        lambda f: [
            "engine.backend=jetstream",
            f"engine.jetstream.python={f.root / 'no' / 'python'}",
        ],
        lambda f: (
            f"engine.jetstream.python='{f.root / 'no' / 'python'}' does not exist: expected "
            "the python of a venv with JetStream (scripts/setup.sh jetstream makes "
            ".venv-jetstream)"
        ),
    ),
    "router loss of a dense model": (
        lambda _f: ["algorithm.router_aux_loss_coef=0.001"],
        lambda _f: (
            "algorithm.router_aux_loss_coef=0.001: the qwen2 model has no mixture-of-experts "
            "layers, so no router to balance: use 0"
        ),
    ),
    "negative router loss": (
        lambda _f: ["algorithm.router_aux_loss_coef=-0.01"],
        lambda _f: "algorithm.router_aux_loss_coef=-0.01: expected >= 0",
    ),
    "mesh tensor axis vs KV heads": (
        lambda _f: ["mesh.tensor=4"],
        lambda _f: (
            "mesh.tensor=4 does not divide model num_kv_heads=2: use mesh.tensor in "
            "{1, 2} (and more fsdp)"
        ),
    ),
    "parser stop token not one token": (
        lambda _f: ["agent.parser=python_tag"],
        lambda _f: (
            "agent.parser='python_tag' stops generation at '</python>', which is not one "
            "token of the tokenizer: use one of ['hermes', 'llama3_json']"
        ),
    ),
    "prompt longer than max_model_len": (
        lambda _f: ["engine.max_model_len=4"],
        lambda f: (
            "engine.max_model_len=4 leaves no room for a response: a prompt of "
            f"data.train is {_prompt_tokens(f)} tokens with the tool schemas; use "
            f"engine.max_model_len > {_prompt_tokens(f)}"
        ),
    ),
}


def _prompt_tokens(f: Files) -> int:
    from jax_agent_rl.tokenization import Tokenizer
    from jax_agent_rl.tokenization.turns import TurnBuilder

    schemas = ToolRegistry.from_yaml(package_file(CALCULATOR, "tools.config")).schemas()
    builder = TurnBuilder(Tokenizer.from_pretrained(f.model), schemas)
    return max(len(builder.prompt_ids(_row(i)["prompt"])) for i in range(4))


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_code_2(
    case: str, files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides, expected = CASES[case]
    assert main(["train", str(files.config), *overrides(files), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"jarl: {expected(files)}\n"


def test_tools_kwargs_of_single_turn_rows_are_not_checked(files: Files) -> None:
    overrides = [f"data.train={files.verl_tool_rows}"]  # rows without agent_name: single turn
    assert main(["train", str(files.config), *overrides, "--dry-run"]) == 0


def test_every_problem_is_reported(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    """Independent problems are all reported, one line each, not only the first."""
    overrides = ["engine.backend=vlm", "data.reward=maths", f"data.train={files.bad_columns}"]
    assert main(["train", str(files.config), *overrides, "mesh.tensor=4", "--dry-run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "jarl: engine.backend",
        "jarl: data.reward",
        "jarl: mesh.tensor",
        "jarl: data.train",
    ]
    assert main(["train", str(files.config), "trainer.steps=-1", "sampling.top_p=0"]) == 2
    assert capsys.readouterr().err == (
        "jarl: sampling.top_p=0.0: expected in (0, 1]\njarl: trainer.steps=-1: expected >= 0\n"
    )


def test_engine_settings_a_backend_cannot_honour_are_refused(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine setting the backend does not read, set away from its default, is one line
    naming the key and the backend; vLLM's block size takes its own sizes; the speed settings
    vLLM tunes itself are noted, not refused (a config written for the embedded engine runs
    on it), as is the path its weight pushes take. The jetstream backend reads them all."""
    engine = ["engine.steps_per_call=8", "engine.prefill_chunk=64", "engine.page_size=48"]
    engine += ["engine.batch_buckets=false", "engine.warmup=false"]
    argv = ["train", str(files.config), *engine]
    assert main([*argv, "engine.backend=vllm", "--dry-run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    for line in [
        "jarl: engine.batch_buckets=False: the vllm backend cannot honour it (vLLM batches "
        "whatever requests are running; no setting makes its numbers independent of that); "
        "drop it",
        "jarl: engine.page_size=48: the vllm backend's KV cache blocks (vLLM's block_size) "
        "take 8, 16, 32, 64, 128",
    ]:
        assert line in lines  # (beside the missing vLLM interpreter's)
    assert not any(
        key in line for key in ("steps_per_call", "prefill_chunk", "warmup") for line in lines
    )
    tuned = ["engine.steps_per_call=8", "engine.prefill_chunk=64", "engine.warmup=false"]
    assert main(["train", str(files.config), *tuned, "engine.backend=vllm", "--dry-run"]) == 0
    err = capsys.readouterr().err
    for line in [
        "# note: engine.steps_per_call=8 is not read by the vllm backend (vLLM's scheduler "
        "decides the decode steps between its calls)",
        "# note: engine.prefill_chunk=64 is not read by the vllm backend (vLLM's scheduler "
        "sizes its prefill chunks (on CPU it prefills whole prompts))",
        "# note: engine.warmup=False is not read by the vllm backend (vLLM compiles and "
        "profiles its programs when it starts)",
        # how pushes reach the engines, said before the run (decided as at each push)
        "# note: vllm weight push: the learner's weights are not on a CUDA device: pushes go "
        "through /dev/shm (a LoRA run's adapters go as PEFT folders)",
    ]:
        assert line in err.splitlines(), err
    main([*argv, "engine.backend=jetstream", "--dry-run"])
    assert "honour" not in capsys.readouterr().err
    # a separate judge on vLLM runs engine.*'s settings too
    judge = ["data.judge.backend=vllm", f"data.judge.model_path={files.config.parent}"]
    assert main([*argv, *judge, "--dry-run"]) == 2
    assert (
        "jarl: data.judge.backend=vllm: engine.batch_buckets=False: the vllm backend cannot "
        "honour it (vLLM batches whatever requests are running; no setting makes its numbers "
        "independent of that); drop it"
    ) in capsys.readouterr().err.splitlines()


def test_a_harness_is_resolved_before_the_run(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """agent.harness is loaded as the run loads it: a function that does not exist, a module
    that does not import, a function that is not async or not of one argument, or none for
    openai_agent rows is one line, not a traceback once an episode starts."""
    (tmp_path / "harness.py").write_text(
        "async def drive(task):\n    return None\n\ndef plain(task):\n    return None\n"
        "async def bare():\n    return None\n\nasync def pair(task, more):\n    return None\n"
    )
    rows = _write_jsonl(tmp_path / "agent.jsonl", [{**_row(0), "agent_name": "openai_agent"}])
    argv = ["train", str(files.config), f"data.train={rows}", "data.reward=math"]
    harness = tmp_path / "harness.py"
    for setting, line in [
        (f"{harness}:drvie", f"agent.harness='{harness}:drvie': {harness} has no function 'drvie'"),
        (f"{harness}:plain", f"agent.harness='{harness}:plain' is not an async function"),
        ("no_such_module:drive", "agent.harness='no_such_module:drive': cannot import module"),
        # each episode calls it with its HarnessTask: these failed every episode of the run
        (f"{harness}:bare", f"agent.harness='{harness}:bare' cannot be called with one argument"),
        (f"{harness}:pair", f"agent.harness='{harness}:pair' cannot be called with one argument"),
        ("", "data.train row 'toy-0' runs agent_name openai_agent, which needs agent.harness"),
    ]:
        assert main([*argv, f"agent.harness={setting}", "--dry-run"]) == 2
        (got,) = capsys.readouterr().err.splitlines()
        assert got.startswith(f"jarl: {line}"), got
    assert main([*argv, f"agent.harness={harness}:drive", "--dry-run"]) == 0


def test_every_row_names_an_interaction_of_the_yaml(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row's extra_info.interaction_kwargs.name missing from the interaction YAML is one
    line naming the row, the names the YAML has and how many rows the check read."""
    (tmp_path / "tutor.py").write_text(
        "class Tutor:\n    def __init__(self, config):\n        pass\n"
        "    async def start_interaction(self, instance_id=None, **kw):\n        pass\n"
        "    async def generate_response(self, instance_id, messages, **kw):\n"
        "        return True, '', 0.0, {}\n"
        "    async def finalize_interaction(self, instance_id=None, **kw):\n        pass\n"
    )
    (tmp_path / "interaction.yaml").write_text(
        f"interaction:\n  - name: tutor\n    class_name: {tmp_path / 'tutor.py'}:Tutor\n"
    )
    named = [
        {**_row(i), "extra_info": {"index": i, "interaction_kwargs": {"name": name}}}
        for i, name in enumerate(["tutor", "tutor", "tutr"])
    ]
    rows = _write_jsonl(tmp_path / "rows.jsonl", named)
    argv = ["train", str(files.config), f"data.train={rows}", "data.reward=math"]
    argv.append(f"env.interaction_config={tmp_path / 'interaction.yaml'}")
    assert main([*argv, "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "jarl: data.train: row toy-2: extra_info.interaction_kwargs.name is 'tutr'; configured "
        "interactions: ['tutor'] (the check reads the first 16 rows of each file)\n"
    )
    _write_jsonl(rows, named[:2])
    assert main([*argv, "--dry-run"]) == 0


def test_sources_scored_by_the_math_fallback_are_noted(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows of a source no reward is chosen for (data.reward unset, no rewards_by_source
    entry, no verl rule) are scored by the math fallback: the check says so, and the run goes
    on; naming a reward for them silences it."""
    assert main(["train", str(files.config), "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if "# note:" in line]
    assert err[-2:] == [
        notes[-1],
        f"# ok: {files.config} and everything it names load; nothing was run",
    ]
    assert notes == [
        "# note: data sources ['toy'] (in the first 16 rows of the data files) have no reward "
        "of their own and data.reward is unset: they are scored by the math fallback (the last "
        "<answer> or \\boxed{} against the ground truth); set data.reward or "
        "data.rewards_by_source to choose"
    ]
    for chosen in ("data.reward=math", "data.rewards_by_source.toy=gsm8k_lenient"):
        assert main(["train", str(files.config), chosen, "--dry-run"]) == 0
        assert "# note:" not in capsys.readouterr().err
    # the demo's own rows are math's by design: no note for them
    assert scored_by_fallback(DataSection(), ["arithmetic/chain", "toy"]) == ["toy"]


def test_shipped_configs_work_from_another_directory(
    files: Files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user runs them, from a folder that is not the repository: the tools files they
    name ship inside the package (pkg://), and relative paths are relative to where jarl runs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    paths = [
        f"model.path={files.model}",
        f"data.train={files.train}",
        f"data.val={files.train}",
        f"sft.data={files.sft}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "jax_agent_rl.cli", "train",
         str(ROOT / "configs" / "demo_calculator_cpu.yaml"), *paths, "--dry-run"],
        cwd=elsewhere, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "nothing was run" in done.stderr

    monkeypatch.chdir(files.root)  # the GSM8K config's default tools (python sandbox included)
    gsm8k = str(ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml")
    assert main(["train", gsm8k, "model.path=model", "data.train=train.jsonl", "--dry-run"]) == 0


def test_mesh_problems_name_the_sizes_that_fit() -> None:
    """The fsdp axis shards hidden_size (64 here), the tensor axis the heads, MLP and vocab."""
    model = ModelConfig.from_hf(MODEL)
    assert mesh_problems(MeshSection(fsdp=2, tensor=2), model, devices=8) == []
    assert mesh_problems(MeshSection(fsdp=3), model, devices=8) == [
        "mesh.fsdp=3 does not divide model hidden_size=64: use mesh.fsdp in "
        "{1, 2, 4, 8, 16, 32, 64} (and more data)"
    ]
    assert mesh_problems(MeshSection(data=4, tensor=4), model, devices=8) == [
        "mesh.data=4 x mesh.fsdp=1 x mesh.tensor=4 needs 16 devices, the run has 8: make "
        "the product at most 8",
        "mesh.tensor=4 does not divide model num_kv_heads=2: use mesh.tensor in {1, 2} "
        "(and more fsdp)",
    ]


# Qwen2.5-1.5B-Instruct's config.json (the model configs/gsm8k_tools_qwen2.5.yaml names)
QWEN25_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def _sharders(mesh: MeshSection) -> tuple[Sharder, Sharder]:
    """The learner's mesh over fake CPU devices, and the engine's inference mesh on them."""
    n = mesh.data * mesh.fsdp * mesh.tensor
    learner = Sharder(make_mesh(mesh.data, mesh.fsdp, mesh.tensor, jax.devices()[:n]))
    return learner, Sharder(inference_mesh(learner.mesh))


def _sharded_bytes(model: ModelConfig, sharder: Sharder, width: int) -> float:
    """The largest per-device share of the parameters, from JAX's own shard shapes on a mesh of
    fake CPU devices (an independent path to what plan_memory computes by hand)."""
    total = 0
    for spec in jax.tree.leaves(param_specs(model), is_leaf=is_spec):
        shard = sharder.sharding(spec.logical_axes, spec.shape).shard_shape(spec.shape)
        total += math.prod(shard) * width
    return total


@pytest.mark.parametrize("mesh", [MeshSection(), MeshSection(fsdp=4, tensor=2)], ids=str)
def test_the_memory_plan_matches_the_sharded_layout(mesh: MeshSection) -> None:
    """For the GSM8K config on Qwen2.5-1.5B: fp32 weights, two AdamW moments, the gradient
    accumulator and the KL reference as JAX lays them out on the mesh; the engine's bf16
    weights and its KV cache (2 x 28 layers x 128 slots x 4096 positions x 2 kv heads x 128 x
    2 bytes = 14 GiB in all) as JAX lays them out on the inference mesh (the serving layout:
    each layer a buffer, the tied embedding's head a [D, V] copy)."""
    cfg = load_config(
        ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml", ["model.path=m", "data.train=t"]
    )
    cfg = dataclasses.replace(cfg, mesh=mesh)
    model = ModelConfig.from_hf(QWEN25_1_5B)
    gib = 2**30
    learner, serving = _sharders(mesh)
    fp32 = _sharded_bytes(model, learner, 4) / gib
    pages = page_shardings(dataclasses.replace(model, dtype="bfloat16"), serving, 128 * 128, 32)
    shape = (28, 2, 128 * 128, 32, 128)  # [L, G, pages (128 slots x 4096 / 32), 32, K]
    assert 2 * math.prod(shape) * 2 / gib == 14.0  # keys and values, 2 bytes each
    assert len(pages.k) == 28  # a buffer per layer
    kv = 2 * 28 * math.prod(pages.k[0].shard_shape(shape[1:])) * 2 / gib
    # the serving layout's head: the tied embedding transposed, [D, V], a buffer of its own
    head_shape = (model.hidden_size, model.vocab_size)
    head = serving.sharding(("embed", "vocab"), head_shape).shard_shape(head_shape)
    weights = (_sharded_bytes(model, serving, 2) + math.prod(head) * 2) / gib
    lines = plan_memory(cfg, model).lines(cfg.learner.remat)
    n = mesh.data * mesh.fsdp * mesh.tensor
    assert lines[0] == (
        f"memory per device, mesh data={mesh.data} x fsdp={mesh.fsdp} x tensor={mesh.tensor} ({n}):"
    )
    parsed = [re.fullmatch(r"  (\w+) +(.+?) +([\d.]+) GiB", line) for line in lines[1:]]
    figures = {f"{m[1]} {m[2]}": float(m[3]) for m in parsed if m}
    assert figures == pytest.approx(
        {
            "learner policy weights (fp32 master)": fp32,
            "learner AdamW moments (2 x fp32)": 2 * fp32,
            "learner KL reference (fp32)": fp32,
            "engine weights (bfloat16)": weights,
            "engine KV cache (16384 pages x 32)": kv,
            "update gradient accumulator (fp32)": fp32,
            "update micro-batch gradient (fp32)": fp32,
            "update weights in bfloat16 (a copy)": fp32 / 2,
            "update activations (remat)": activation_bytes(model, 8192, 2, True, mesh.tensor) / gib,
            "push weights gathered for serving": _sharded_bytes(model, serving, 2) / gib,
            # placed beside the old ones while the engine decodes, then swapped in
            "push new weights staged beside the old (engine.push.staged)": weights,
        },
        abs=0.006,  # the plan prints two decimals
    )
    in_place = dataclasses.replace(
        cfg, engine=dataclasses.replace(cfg.engine, push=PushSection(staged=False))
    )
    # unstaged, the new serving weights take the old ones' place: the engine drops them first
    assert not any("staged" in line for line in plan_memory(in_place, model).lines(False))
    assert model.num_params * 4 / gib == pytest.approx(5.75, abs=0.01)  # 1.54B parameters
    total_line = next(line for line in lines if "total per device" in line)
    total = float(total_line.split("GiB")[0].split()[-1])
    engine = weights + kv
    assert total == pytest.approx(4 * fp32 + engine, abs=0.01)


def test_the_memory_plan_of_a_lora_run_trains_the_adapters_only() -> None:
    """GSM8K's config with rank-16 adapters on every projection of Qwen2.5-1.5B (18.5M
    parameters, 1.2% of its 1.54B): the base frozen (in bf16, as the run computes), AdamW
    moments and the gradient accumulator of the adapters only, no KL reference copy; the line
    of what it saves is the difference to the same run training every weight."""
    mesh = MeshSection(fsdp=4, tensor=2)
    cfg = load_config(
        ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml",
        ["model.path=m", "data.train=t", "model.lora.rank=16"],
    )
    cfg = dataclasses.replace(cfg, mesh=mesh)
    model = ModelConfig.from_hf(QWEN25_1_5B)
    lora_model = dataclasses.replace(model, lora=Lora(16, 16.0))
    learner, serving = _sharders(mesh)
    base = _sharded_bytes(model, learner, 4)
    adapters = _sharded_bytes(lora_model, learner, 4) - base
    n_adapters = sum(
        math.prod(s.shape)
        for s in jax.tree.leaves(param_specs(lora_model).layers.lora, is_leaf=is_spec)  # type: ignore[union-attr]
    )
    assert n_adapters == 28 * 16 * (2 * 3072 + 2 * 1792 + 2 * 10496 + 10496)
    plan, full = (
        plan_memory(cfg, model),
        plan_memory(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraSection())),
            model,
        ),
    )
    assert dict(plan.learner) == pytest.approx(
        {
            "base weights (bf16, frozen)": base / 2,  # the config computes in bf16
            "LoRA adapters (fp32)": adapters,
            "AdamW moments (2 x fp32)": 2 * adapters,
        }
    )
    assert dict(plan.update)["gradient accumulator (fp32)"] == pytest.approx(adapters)
    assert dict(plan.update)["weights in bfloat16 (a copy)"] == pytest.approx(adapters / 2)
    # a push sends the adapters alone (bf16, as the engine serves them)
    served = _sharded_bytes(lora_model, serving, 2) - _sharded_bytes(model, serving, 2)
    assert plan.push == [("adapters gathered for serving", pytest.approx(served))]
    held = lambda p: p.learner_bytes + sum(b for name, b in p.update if "activations" not in name)  # noqa: E731
    assert plan.lora_saved == pytest.approx(held(full) - held(plan))
    assert plan.lora_saved > 3.5 * base  # moments, accumulator, micro-batch gradient, KL copy
    (line,) = (x for x in plan.lines(cfg.learner.remat) if "LoRA saves" in x)
    assert f"LoRA saves {plan.lora_saved / 2**30:.2f} GiB per device" in line


def test_dry_run_prints_the_memory_plan(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(files.config), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "# memory per device, mesh data=1 x fsdp=1 x tensor=1 (1):" in err
    assert "# total per device" not in err  # indented under it
    assert "#   total per device: " in err
    assert err.splitlines()[-1].endswith("load; nothing was run")  # it fits: no verdict after


def test_a_dry_run_that_cannot_fit_this_host_says_so(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows of 2^62 tokens (a lower bound of 10^14 GiB of activations): the dry run said ok
    and printed the figure; it now ends saying the run does not fit this host's memory."""
    assert (
        main(["train", str(files.config), "learner.row_tokens=4611686018427387904", "--dry-run"])
        == 0
    )
    last = capsys.readouterr().err.splitlines()[-1]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    devices = len(jax.local_devices())
    assert re.fullmatch(
        r"# ok: .* load; nothing was run; it does not fit here: a peak of [\d.e+]+ GiB per device, "
        rf"and this host's {host:.1f} GiB over {devices} CPU devices leave each [\d.e+]+ GiB "
        r"\(`jarl plan` compiles a run for a TPU slice\)",
        last,
    ), last


def test_a_multi_process_run_is_checked_over_every_process(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dry-run`` with the multi-process flags joins no one, and counts the devices of
    every process as this one's; the prompts and the mesh's data x fsdp rows must split over
    the processes, and delta pushes are one process's; a process group missing a flag is
    refused before anything loads."""
    two = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"]
    base = ["train", str(files.config), "trainer.run_dir=/nonexistent/run"]
    # this test process has 8 devices, so 2 such processes have 16
    fits = ["mesh.data=2", "mesh.fsdp=8", "data.prompts_per_step=4", "engine.max_concurrent=16"]
    assert main([*base, *fits, "learner.micro_batch_size=16", "--dry-run", *two]) == 0
    capsys.readouterr()
    odd = ["mesh.fsdp=3", "learner.micro_batch_size=3", "engine.max_concurrent=3"]
    odd += ["engine.push.full_every=4"]
    assert main([*base, *odd, "data.prompts_per_step=3", "--dry-run", *two]) == 2
    err = capsys.readouterr().err
    assert "jarl: engine.push.full_every=4: delta pushes run in one process" in err
    assert "jarl: data.prompts_per_step=3 does not split over 2 processes" in err
    assert "jarl: mesh.data x mesh.fsdp = 3 devices do not split over 2 processes" in err
    assert "= 3 devices, but the 2 processes have 16: a multi-process mesh spans every" in err
    assert main([*base, "--dry-run", "--num-processes", "2"]) == 2
    assert "--num-processes > 1 needs --coordinator" in capsys.readouterr().err
    assert main([*base, "--dry-run", *two[:4], "--process-id", "2"]) == 2
    assert "--process-id=2 must be in [0, 2)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override",
    [
        lambda f: f"data.train={f.root / 'missing.jsonl'}",
        lambda f: f"tools.config={f.root / 'missing.yaml'}",
        lambda f: f"model.tokenizer={f.root}",  # a folder without tokenizer.json
    ],
    ids=["data.train", "tools.config", "model.tokenizer"],
)
def test_build_run_stops_at_the_line_the_check_reports(
    files: Files, override: Callable[[Files], str]
) -> None:
    """`build_run` makes the run's parts with the functions the check calls: a config with one
    problem stops it with the very line `check_run` lists."""
    run_dir = files.root / f"run-{override(files).split('=')[0]}"
    cfg = load_config(files.config, [f"trainer.run_dir={run_dir}", override(files)])
    problems = check_run(cfg)
    assert len(problems) == 1
    with pytest.raises(ConfigError) as stopped:
        build_run(cfg, Console(quiet=True))
    assert str(stopped.value) == problems[0]


@pytest.mark.parametrize("remat", [False, True])
def test_the_activation_estimate_is_within_2x_of_xlas_plan(remat: bool) -> None:
    """`activation_bytes` (what ``--dry-run`` prints per micro-batch) against the memory XLA
    plans for the gradient of one packed row of the 40M-parameter model (fp32, compiled,
    never run; its temporaries and the gradient it returns), at 1024 and 4096 tokens: within a
    factor of 2 either way."""
    cfg = ModelConfig.from_hf(SMALL_QWEN2)
    params = jax.eval_shape(
        lambda: init_params(jax.random.key(0), cfg, sharder=one_device_sharder())
    )
    spec = StepSpec(
        DecoderPolicy(cfg),
        "float32",
        SamplingSpec(),
        AlgorithmSection(),
        remat,
        one_device_sharder(),
    )
    for T in (1024, 4096):
        z = jnp.zeros((1, T), jnp.int32)
        row = TrainBatch(z, z + jnp.arange(T), z + 1, z, z, z + 1.0, z + 0.0, T)
        grad = jax.jit(jax.grad(lambda w, b: token_stats(spec, w, b)[0].sum()))
        analysis = grad.lower(params, row).compile().memory_analysis()
        assert analysis is not None
        planned = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
        estimate = activation_bytes(cfg, T, 4, remat) + 4 * cfg.num_params  # + the gradient
        assert planned / 2 <= estimate <= planned * 2, (T, estimate / planned)
