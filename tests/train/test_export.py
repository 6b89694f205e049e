"""A run as its user sees it after training: a log file with one line per step, and HF
checkpoint folders (the trainer's ``RUN/hf`` and ``jarl export RUN --step N``) on which
transformers' ``generate`` stops at the end of a turn and reproduces our engine's greedy tokens.

transformers 5 loads ``Qwen2Tokenizer`` for every ``model_type: qwen2`` folder, whatever its
``tokenizer_class``, and that class rebuilds the pre-tokenizer its own way: the demo model's
tokenizer (digit groups, merges across words) then mis-tokenizes through ``AutoTokenizer``. So
``AutoTokenizer`` is checked on Llama and Qwen3 exports; the qwen2 demo export is read with
``PreTrainedTokenizerFast``, the class its tokenizer_config.json names.
"""

import asyncio
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import TaskFiles
from jax_agent_rl.config import PATH_KEYS, JarlConfig, ModelSection, load_config, to_yaml
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.adapters import adapters_of, with_adapters
from jax_agent_rl.models.hf_local import TINY, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl.update import TrainState
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.tokenization.tokenizer import render_template
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train import export as export_module
from jax_agent_rl.train.checkpoints import RunCheckpoints
from jax_agent_rl.train.export import export_policy
from jax_agent_rl.train.learners import with_run_lora
from jax_agent_rl.train.metrics import INCLUDES_COMPILE, read_metrics
from tests.train.conftest import STEPS

MAX_NEW = 40


def test_a_log_file_gets_one_line_per_step(run: tuple[Path, str]) -> None:
    run_dir, log = run
    records = read_metrics(run_dir / "metrics.jsonl", "train")
    lines = [line for line in log.splitlines() if line.startswith("step ")]
    assert len(lines) == len(records) == STEPS
    for line, r in zip(lines, records, strict=True):
        assert line.startswith(
            f"step {r['step']}/{STEPS}  reward {r['reward']:.3f}  success {r['success']:.3f}  "
            f"rollout {r['time/rollout_tokens_per_s']:.0f} tok/s  {r['time/step_s']:.1f} s/step"
        )
        assert 0 <= r["batch/groups_all_equal"] <= r["batch/groups"] <= 4  # 4 prompts a step
        warning = f"WARNING: rewards equal within all {r['batch/groups']:.0f} groups"
        all_equal = r["batch/groups_all_equal"] == r["batch/groups"]
        assert line.endswith(f"{warning}, zero GRPO advantage") == all_equal
    # the first step of the process compiles; it is marked so and kept out of throughput plots
    assert [r[INCLUDES_COMPILE] for r in records] == [1.0, 0.0]
    assert "(compiling)" in lines[0] and "(compiling)" not in lines[1]
    # with the format reward, the warm-started model gets every episode of step 2 right
    assert records[1]["reward"] == 1.0 and "WARNING" in lines[1]


def test_a_log_file_hears_of_every_long_phase_with_its_count(run: tuple[Path, str]) -> None:
    """Loading the run's parts, SFT, the learner's state, the engine's start (its compilation),
    the held-out evaluations, checkpoints, the RL steps and the export each say when they start
    and end; the counted ones give their counts. The first line is the loading's (the run was
    silent for ~20 s before its first checkpoint)."""
    _, log = run
    lines = log.splitlines()
    assert lines[0] == "loading the model, the data and the tools: started"
    for start, end in (
        ("loading the model, the data and the tools: started", None),
        ("building the learner's state: started", None),
        ("sft step 0/60: started", "sft step 60/60  loss "),
        ("starting the embedded rollout backend (compiling its programs): started", None),
        ("held-out @ step 0, episode 0/16: started", "held-out @ step 0, episode 16/16  ("),
        (
            f"held-out @ step {STEPS}, episode 0/16: started",
            f"held-out @ step {STEPS}, episode 16/16",
        ),
        ("saving the checkpoint of step 0: started", "saving the checkpoint of step 0  ("),
        (f"rl step 0/{STEPS}: started", f"rl step {STEPS}/{STEPS}  reward "),
        ("exporting the policy to ", None),
    ):
        at = next(i for i, line in enumerate(lines) if line.startswith(start))
        prefix = end or start.removesuffix(": started")
        assert any(line.startswith(prefix) and line.endswith(": done") for line in lines[at:])


def test_jarl_export_writes_any_saved_step(
    run: tuple[Path, str], task: TaskFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    assert main(["export", str(run_dir), "--step", "1", "--out", str(tmp_path / "s1")]) == 0
    assert main(["export", str(run_dir)]) == 0  # the latest checkpoint, step 2
    assert f"exported to {run_dir / 'hf-step-2'}" in capsys.readouterr().out
    final = load_file(run_dir / "hf" / "model.safetensors")  # the trainer's in-memory policy
    latest = load_file(run_dir / "hf-step-2" / "model.safetensors")
    first = load_file(tmp_path / "s1" / "model.safetensors")
    assert final.keys() == latest.keys() == first.keys()
    for name in final:
        np.testing.assert_array_equal(latest[name], final[name], err_msg=name)
    assert any(not np.array_equal(first[name], final[name]) for name in final)

    tok = Tokenizer.from_pretrained(task.model)
    im_end, pad = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    for folder in (run_dir / "hf", run_dir / "hf-step-2", tmp_path / "s1"):
        config = json.loads((folder / "config.json").read_text())
        assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (
            im_end,
            pad,
            None,
        )
        assert json.loads((folder / "generation_config.json").read_text()) == {
            "bos_token_id": None,
            "eos_token_id": im_end,
            "pad_token_id": pad,
            "do_sample": True,  # as the rollouts sampled (configs/demo_calculator_cpu.yaml)
            "temperature": 0.7,
            "top_p": 1.0,
            "top_k": 0,  # HF's "off"
        }
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).read_bytes() == (task.model / name).read_bytes()

    assert main(["export", str(run_dir), "--step", "7"]) == 2
    assert "has no checkpoint of step 7; saved steps: [1, 2]" in capsys.readouterr().err
    assert main(["export", str(tmp_path)]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_jarl_export_refuses_nan_weights_and_the_base_folder(
    run: tuple[Path, str],
    task: TaskFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A checkpoint holding NaN or inf was exported with exit 0 (what loaded it gave NaN
    logits); ``--out`` naming the run's model folder overwrote the base's weights, then
    failed (exit 2) copying the tokenizer files onto themselves."""
    run_dir, _ = run
    base = {p.name: p.read_bytes() for p in task.model.iterdir() if p.is_file()}
    assert main(["export", str(run_dir), "--out", str(task.model)]) == 2
    assert "is the run's model or tokenizer folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in task.model.iterdir() if p.is_file()} == base

    real = export_module.saved_policy

    def diverged(*args: Any) -> Any:
        model, params = real(*args)
        leaves, tree = jax.tree_util.tree_flatten(params)
        leaves[-1] = np.full_like(np.asarray(leaves[-1]), np.inf)
        return model, jax.tree_util.tree_unflatten(tree, leaves)

    monkeypatch.setattr(export_module, "saved_policy", diverged)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "nan")]) == 2
    assert "the checkpoint of step 2 holds NaN or inf in " in capsys.readouterr().err
    assert not (tmp_path / "nan").exists()


def test_a_run_folder_is_read_from_any_directory(
    run: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The run's config.yaml holds absolute paths (the run was given data.val relative to the
    task's folder): `jarl export` works from another directory; a path that is really gone is
    one line naming the key and the absolute path."""
    run_dir, _ = run
    saved = load_config(run_dir / "config.yaml")
    assert Path(saved.data.val).is_file()
    for key in PATH_KEYS:
        value = functools.reduce(getattr, key.split("."), saved)
        assert value == "" or Path(value).is_absolute(), (key, value)
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run_dir), "--out", "out"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    capsys.readouterr()

    moved = tmp_path / "moved"
    moved.mkdir()
    gone = tmp_path / "gone"
    (moved / "config.yaml").write_text(
        to_yaml(dataclasses.replace(saved, model=dataclasses.replace(saved.model, path=str(gone))))
    )
    expected = f"{moved / 'config.yaml'}: model.path={str(gone)!r} does not exist"
    for command in (["export", str(moved)], ["eval", str(moved)]):
        assert main(command) == 2
        assert capsys.readouterr().err == f"jarl: {expected}\n"


def _engine_greedy(folder: Path, prompts: list[list[int]], stops: tuple[int, ...]) -> list:
    cfg, weights = load_hf(folder, sharder=one_device_sharder())
    engine = Engine(
        cfg,
        max_concurrent_decodes=4,
        max_len=cfg.max_position_embeddings,
        sharder=one_device_sharder(),
    )
    backend = EmbeddedBackend(engine, weights)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=stops)

    async def all_prompts() -> list:
        try:
            return list(
                await asyncio.gather(
                    *(
                        backend.generate(GenerateRequest(f"p{i}", tuple(p), greedy))
                        for i, p in enumerate(prompts)
                    )
                )
            )
        finally:
            await backend.close()

    return asyncio.run(all_prompts())


def _hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """``generate`` as a user calls it: the stopping ids come from the folder, not from us."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            new = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW
            )
        out.append(new[0, len(prompt) :].tolist())
    return out


def test_transformers_generate_on_the_trained_export_stops_like_the_engine(
    run: tuple[Path, str], task: TaskFiles
) -> None:
    run_dir, _ = run
    out = run_dir / "hf"
    tok = Tokenizer.from_pretrained(out)
    schemas = ToolRegistry.from_yaml(task.tools).schemas()
    builder = TurnBuilder(tok, schemas)
    conversations = [json.loads(line)["prompt"] for line in task.val.read_text().splitlines()[:8]]
    prompts = [builder.prompt_ids(messages) for messages in conversations]
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    for messages, prompt in zip(conversations, prompts, strict=True):
        rendered = hf_tok.apply_chat_template(
            messages, tools=schemas, add_generation_prompt=True, tokenize=True
        )
        assert list(rendered["input_ids"]) == prompt
    results = _engine_greedy(out, prompts, (tok.eos_token_id,))
    # What the two-step policy writes is not the point (on some CPUs it rambles past MAX_NEW on
    # some prompts): HF must stop exactly where the engine stops, and run on where it runs on.
    # A folder without eos in its generation config would run past every end of turn.
    assert any(r.finish_reason == "stop" for r in results)
    for hf, result in zip(_hf_greedy(out, prompts), results, strict=True):
        assert hf == list(result.token_ids)
        if result.finish_reason == "stop":  # the policy ended its turn, and HF stopped there
            assert result.token_ids[-1] == tok.token_id("<|im_end|>")
        else:
            assert result.finish_reason == "length" and len(hf) == MAX_NEW


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Answer in <answer></answer> tags."},
    {"role": "user", "content": "What is 12 + 30? Zürich, 1234567"},
]
CORPUS = [  # transcripts as the template renders them (tool schemas included), as the demo's
    render_template(
        chat_template("chatml_tools"),
        [*MESSAGES, {"role": "assistant", "content": "The sum is <answer>42</answer>."}],
        TOOLS,
    ),
    "Zürich, naïve café: unicode survives byte-level BPE. 日本語も。 12 + 30 = 42\n",
] * 30


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_auto_tokenizer_and_generate_on_an_export(family: str, tmp_path: Path) -> None:
    """A random-init policy whose source checkpoint also stops at ``<|endoftext|>`` (as
    Qwen2.5-Instruct's generation config does): the export stops at both, end of turn first."""
    source = tmp_path / "source"
    backend = train_bpe(CORPUS, vocab_size=512, digit_groups=3, merge_across_words=True)
    save_tokenizer(source, backend, chat_template("chatml_tools"))
    write_hf_checkpoint(source, {**TINY[family], "vocab_size": backend.get_vocab_size()})
    tok = Tokenizer.from_pretrained(source)
    im_end, endoftext = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext]}))
    cfg = dataclasses.replace(JarlConfig(), model=ModelSection(path=str(source)))
    model, params = load_hf(source, sharder=one_device_sharder())
    out = export_policy(tmp_path / "export", cfg, model, params)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(hf_tok, transformers.PreTrainedTokenizerFast)
    assert (hf_tok.eos_token, hf_tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    prompt = TurnBuilder(tok, TOOLS).prompt_ids(MESSAGES)
    rendered = hf_tok.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True
    )
    assert list(rendered["input_ids"]) == prompt
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [im_end, endoftext]
    assert (generation.pad_token_id, generation.do_sample, generation.top_k) == (endoftext, True, 0)

    (result,) = _engine_greedy(out, [prompt], (im_end, endoftext))
    assert _hf_greedy(out, [prompt]) == [list(result.token_ids)]


def test_jarl_export_of_a_lora_run_writes_a_peft_adapter_and_with_merge_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA run's saved checkpoint (base + trained adapters): ``jarl export`` writes a PEFT
    adapter folder that PEFT loads on the base, ``--merge`` an HF checkpoint transformers loads
    alone; the two give the same logits within 1e-5 (fp32, the same function reassociated:
    `tests/models/test_lora.py`)."""
    source = tmp_path / "source"
    backend = train_bpe(CORPUS, vocab_size=512, digit_groups=3, merge_across_words=True)
    save_tokenizer(source, backend, chat_template("chatml_tools"))
    write_hf_checkpoint(source, {**TINY["qwen3"], "vocab_size": backend.get_vocab_size()})
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *(f"model.path={source}", "data.train=t", f"trainer.run_dir={run_dir}"),
            *("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,o,down]"),
        ],
    )
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    base_cfg, base = load_hf(source, sharder=one_device_sharder())
    _, params = with_run_lora(cfg, base_cfg, base)
    trained = jax.tree.map(lambda x: x + 0.05, adapters_of(params))  # B nonzero
    params = with_adapters(base, trained)
    checkpoints = RunCheckpoints(run_dir / "checkpoints", 2)
    step0 = jnp.zeros((), jnp.int32)
    checkpoints.save(3, {"policy": TrainState(params, {}, step0)}, {"step": 3})
    checkpoints.close()
    assert main(["export", str(run_dir)]) == 0
    assert main(["export", str(run_dir), "--merge"]) == 0
    out = capsys.readouterr().out
    adapter, merged = run_dir / "hf-step-3", run_dir / "hf-step-3-merged"
    assert f"exported to {adapter}\n" in out and f"exported to {merged}\n" in out
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == [
        "q_proj", "o_proj", "down_proj"
    ]  # fmt: skip
    assert not (merged / "adapter_config.json").exists()
    tokens = torch.tensor(np.random.default_rng(0).integers(0, 512, (2, 12)))

    def logits(model: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            return model(input_ids=tokens).logits.numpy()

    load = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, dtype=torch.float32)
    with_adapter = logits(peft.PeftModel.from_pretrained(load(source), adapter).eval())
    assert np.abs(with_adapter - logits(load(source).eval())).max() > 1e-2
    assert np.abs(logits(load(merged).eval()) - with_adapter).max() <= 1e-5
    # --merge of a run without adapters is refused, naming the setting
    (run_dir / "config.yaml").write_text(
        to_yaml(load_config(run_dir / "config.yaml", ["model.lora.rank=0"]))
    )
    assert main(["export", str(run_dir), "--merge"]) == 2
    assert "this run has none (model.lora.rank=0)" in capsys.readouterr().err
