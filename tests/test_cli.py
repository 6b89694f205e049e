"""The jarl command line: help that explains, errors that name the problem."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import expected_duration
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.hf_local import TINY, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jax_agent_rl.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for command in ("demo", "config", "inspect"):
        assert command in out


def test_parsing_imports_no_command() -> None:
    """Building the parser (``jarl --help``) imports none of what the commands run: the tool
    server, the view, the trainer, jax."""
    code = (
        "import sys; from jax_agent_rl.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'fastapi') "
        "or m.startswith(('jax_agent_rl.tools', 'jax_agent_rl.view', 'jax_agent_rl.train'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"


def test_hydras_config_flags_from_a_verl_script_are_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "c.yaml", "--config-path=/x", "--config-name", "ppo", "model.path=/m"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("jarl: --config-path=/x: Hydra's flag (verl's config files); jarl ")
    assert line.endswith("(docs/verl.md)")


def test_config_reports_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "model.path=/x", "model.dtyp=bfloat16"]) == 2
    assert "unknown config key 'model.dtyp'" in capsys.readouterr().err
    assert main(["config", "model.path=/x", "data.train=t.jsonl"]) == 0
    assert "path: /x" in capsys.readouterr().out


def test_inspect_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_hf_checkpoint(tmp_path / "q3", TINY["qwen3"])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "qk_norm: True" in out
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    # a config.json that is no regular file, or no JSON: a message, not a traceback
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    assert main(["inspect", str(tmp_path / "dir")]) == 2
    assert "config.json is not a regular file" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path / "bad")]) == 2
    assert "jarl: " in capsys.readouterr().err


@pytest.mark.parametrize("task", ["calculator", "compaction"])
def test_demo_wiring_on_a_short_run(
    task: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`jarl demo` with tiny budgets: every artefact the demo promises is written (its
    learning is asserted in tests/train/test_learning.py); ``--task compaction`` writes its
    own task and trains with its config (episodes compacted)."""
    overrides = [
        "sft.steps=4", "sft.batch_size=8", "trainer.steps=1", "data.val_size=4",
        "data.prompts_per_step=2", "group.n=2", "learner.micro_batch_size=4",
    ]  # fmt: skip
    assert main(["demo", "--run-dir", str(tmp_path), "--task", task, *overrides]) == 0
    rows = [json.loads(line) for line in (tmp_path / "task" / "val.jsonl").open()]
    kinds = {row["data_source"] for row in rows}
    assert kinds == {"arithmetic/long_chain"} if task == "compaction" else "arithmetic/add" in kinds
    config = (tmp_path / "config.yaml").read_text()
    assert ("compact: 80" in config) == (task == "compaction")
    if task == "compaction":  # from the warm start, no SFT: every episode compacted
        (step,) = read_metrics(tmp_path / "metrics.jsonl", "train")
        assert step["batch/samples"] > step["batch/trajectories"]
        assert not read_metrics(tmp_path / "metrics.jsonl", "sft")
    for name in ("metrics.jsonl", "reward.png", "throughput.png", "traces.jsonl", "config.yaml"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert list((tmp_path / "tensorboard").iterdir())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"sft_success", "rl_success"}
    out = capsys.readouterr().out
    said = (
        expected_duration("compaction", 0, 1)
        if task == "compaction"
        else expected_duration("tiny", 4, 1)
    )
    assert out.startswith(f"jarl demo: {said}\n")
    assert "jarl traces" in out and f"\n  {tmp_path / 'hf'}/ " in out  # the closing list
    assert main(["traces", str(tmp_path), "--limit", "1"]) == 0
    assert main(["demo", "--run-dir", str(tmp_path / "x"), "algorithm.clip_hihg=1"]) == 2
    refused = ["demo", "--run-dir", str(tmp_path / "y"), "--task", "compaction", "--lora"]
    assert main(refused) == 2
    assert "jarl: jarl demo --task compaction: the tiny model only, without --lora" in (
        capsys.readouterr().err
    )


def test_every_command_refuses_values_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    """Ranges are checked when a config loads, so `jarl config` refuses them as `jarl train`
    does: every problem on its own line, exit code 2."""
    bad = ["sampling.temperature=-1", "trainer.steps=-1"]
    assert main(["config", "model.path=/x", "data.train=t", *bad]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err
        == "jarl: sampling.temperature=-1.0: expected >= 0\njarl: trainer.steps=-1: expected >= 0\n"
    )


def test_config_previews_a_shipped_config_with_required_keys_unset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`jarl config` shows the GSM8K config as shipped: every value resolved, the keys a run
    still needs marked, and a last line listing them; `jarl train --dry-run` refuses it."""
    config = str(ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml")
    assert main(["config", config]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "  path: ???  # required: set model.path=..." in lines
    assert "  train: ???  # required: set data.train=..." in lines
    assert lines[-1] == "# set before jarl train runs: data.train=... model.path=..."
    shown = yaml.safe_load(out)  # still YAML, the unset keys as OmegaConf writes them
    assert shown["model"]["path"] == "???" and shown["engine"]["max_model_len"] == 4096
    assert shown["tools"]["config"].endswith("jax_agent_rl/configs/tools_default.yaml")
    # set, nothing is marked; a bad value is still refused
    assert main(["config", config, "model.path=/ckpt", "data.train=t.jsonl"]) == 0
    assert "???" not in capsys.readouterr().out
    assert main(["config", config, "group.n=0"]) == 2
    assert capsys.readouterr().err == "jarl: group.n=0: expected >= 1\n"


def test_checkpoint_make_writes_a_checkpoint_a_shipped_config_runs_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`jarl checkpoint make` writes a model and tokenizer that `jarl inspect` and the loaders
    accept and that the GSM8K config's --dry-run checks pass on (tool template, parser stop
    tokens, mesh, memory), as its comment promises."""
    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "make", "--out", str(ckpt)]) == 0
    assert f"jarl train CONFIG model.path={ckpt}" in capsys.readouterr().out
    assert main(["inspect", str(ckpt)]) == 0
    assert "qwen2" in capsys.readouterr().out
    model, params = load_hf(ckpt, "float32", sharder=one_device_sharder())
    assert model.max_position_embeddings >= 4096 and params.embed.shape[0] == model.vocab_size
    tokenizer = Tokenizer.from_pretrained(ckpt)
    assert tokenizer.decode(tokenizer.encode("Natalia sold 48 clips.")) == "Natalia sold 48 clips."
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    config = str(ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml")
    argv = ["train", config, f"model.path={ckpt}", f"data.train={tmp_path / 't.jsonl'}"]
    assert main([*argv, "--dry-run"]) == 0
    assert "nothing was run" in capsys.readouterr().err
    # an existing folder is not written over
    assert main(["checkpoint", "make", "--out", str(ckpt)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_checkpoint_make_writes_a_gemma3_the_demo_config_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--preset tiny-gemma3``: a Gemma 3 checkpoint (`models.gemma3`) that `jarl inspect`
    reads with its windows and that the demo config's --dry-run checks pass on."""
    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "make", "--out", str(ckpt), "--preset", "tiny-gemma3"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text" in out and "sliding_window=16" in out, out
    model, params = load_hf(ckpt, "float32", sharder=one_device_sharder())
    assert model.family == "gemma3_text" and params.layers.post_mlp_norm.shape[0] == 3
    config = str(ROOT / "configs" / "demo_calculator_cpu.yaml")
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["train", config, f"model.path={ckpt}", f"data.train={tmp_path / 't.jsonl'}"]
    assert main([*argv, "sft.steps=0", "data.val=", "--dry-run"]) == 0
    assert "nothing was run" in capsys.readouterr().err


TUTOR = """
class TutorInteraction:
    def __init__(self, config):
        self.config = config

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "Done.", 1.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None
"""


def test_modules_of_the_working_directory_load_as_under_python_m(tmp_path: Path) -> None:
    """verl runs ``python -m verl.trainer.main_ppo`` from the user's folder, which puts that
    folder on sys.path: an interaction YAML's ``class_name: tutor_interaction.TutorInteraction``
    and a reward ``my_reward:score`` name modules there. The ``jarl`` entry point, run from a
    folder outside the repository, finds them too (its own sys.path[0] is its bin folder)."""
    assert main(["checkpoint", "make", "--out", str(tmp_path / "ckpt")]) == 0
    (tmp_path / "tutor_interaction.py").write_text(TUTOR)
    (tmp_path / "my_reward.py").write_text("def score(text, ground_truth):\n    return 1.0\n")
    (tmp_path / "interaction.yaml").write_text(
        "interaction:\n  - name: tutor\n    class_name: tutor_interaction.TutorInteraction\n"
    )
    row = {
        "prompt": [{"role": "user", "content": "2+3?"}],
        "reward_model": {"ground_truth": "5"},
        "extra_info": {"interaction_kwargs": {"name": "tutor"}},
    }
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    jarl = Path(sys.executable).parent / "jarl"  # the console script pyproject.toml declares
    command = [str(jarl), "train", str(ROOT / "configs" / "gsm8k_tools_qwen2.5.yaml")]
    command += ["model.path=ckpt", "data.train=t.jsonl", "env.interaction_config=interaction.yaml"]
    command += ["data.reward=my_reward:score", "--dry-run"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("nothing was run\n")


def test_the_demo_says_how_long_its_own_steps_take() -> None:
    """The demo's announced time follows its steps (it said "about 17 minutes" whatever they
    were): the default steps give the measured figures, fewer steps less, more steps more."""
    default = expected_duration("tiny", 1200, 32)
    assert default == (
        "about 17 minutes on 2 CPU cores shared with other jobs (SFT most of it), 7.4 on idle ones"
    )
    short = expected_duration("tiny", 4, 1)
    assert short == (
        "about 2 minutes on 2 CPU cores shared with other jobs, 0.8 on idle ones "
        "(4 SFT and 1 RL steps)"
    )
    assert expected_duration("tiny", 2400, 64).startswith("about 32 minutes")
