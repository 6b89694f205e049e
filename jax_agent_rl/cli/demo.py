"""`make demo`: a small model learns, on the CPU, to use a calculator tool over several turns.

Everything is made here, nothing is downloaded:

1. the task (`jax_agent_rl.data.arithmetic`): sums, products and chained product-then-sum
   problems, a training file and a held-out file in verl's column layout, and imperfect
   demonstrations (the demonstrator answers most sums from memory, often wrongly);
2. a byte-level BPE tokenizer trained on the task's chat transcripts (digits apart), with the
   ChatML tool template;
3. a random-init Qwen2-architecture model (~0.8M parameters), written as an HF checkpoint;
4. `jarl train configs/demo_calculator_cpu.yaml`: a short SFT warm start on the
   demonstrations, then GRPO over multi-turn rollouts against the real calculator tool, with a
   held-out evaluation (greedy) before and during RL.

The run folder holds metrics.jsonl, TensorBoard events, reward.png / throughput.png, traces
(`jarl traces RUN`), orbax checkpoints and the final policy as an HF checkpoint (``hf/``); the
summary at the end lists what the run wrote and where to look.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.table import Table

from jax_agent_rl.config import ConfigError, JarlConfig, load_config
from jax_agent_rl.config.paths import made_folder
from jax_agent_rl.console import progress
from jax_agent_rl.data.arithmetic import NUMBERS, ArithmeticTask
from jax_agent_rl.data.compaction import CompactionTask
from jax_agent_rl.data.datasets import write_jsonl
from jax_agent_rl.models import (
    ModelConfig,
    init_params,
    one_device_sharder,
    request_cpu_devices,
    save_hf,
)
from jax_agent_rl.models.hf_local import DEMO_GEMMA3
from jax_agent_rl.tokenization import chat_template, save_tokenizer, train_bpe
from jax_agent_rl.tokenization.tokenizer import render_template
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics
from jax_agent_rl.train.sft import write_demonstrations

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_calculator_cpu.yaml"
LORA_CONFIG = DEMO_CONFIG.with_name("demo_calculator_lora_cpu.yaml")
COMPACTION_CONFIG = DEMO_CONFIG.with_name("demo_compaction_cpu.yaml")
# `jarl demo --task compaction` trains from this SFT policy (scripts/learning_checkpoints.py
# made it; tests/train/test_learning.py trains from it too). An SFT of the tiny model on the
# compaction task lands on a policy that copies the product's first operand well or badly by
# the rounding of its run: of four 2000- and 3000-step runs, one ended where 95 % of the
# episodes whose summary keeps the total end right (this one), three where 9-25 % do
# (docs/agents.md)
COMPACTION_WARM_START = (
    DEMO_CONFIG.parents[1] / "tests" / "train" / "warm_starts" / "tiny-compaction"
)
CALCULATOR = Path(__file__).resolve().parents[1] / "configs" / "tools_calculator.yaml"


@dataclasses.dataclass(frozen=True)
class Measured:
    """A demo's wall time, in minutes, measured with its config's default steps on 2 CPU cores
    (``loaded``: while other jobs loaded them; ``idle``), and the shares of the loaded run
    its SFT steps and its RL steps took (the rest, making the task and starting the engine,
    does not depend on the steps)."""

    loaded: float
    idle: float
    sft_share: float
    rl_share: float
    sft_steps: int = 1200  # configs/demo_calculator_cpu.yaml's and moe_calculator_cpu.yaml's
    rl_steps: int = 32

    def minutes(self, total: float, sft_steps: int, rl_steps: int) -> float:
        """``total`` (a default run's) scaled to ``sft_steps`` and ``rl_steps``."""
        rest = 1.0 - self.sft_share - self.rl_share
        return total * (
            rest
            + (self.sft_share * sft_steps / self.sft_steps if self.sft_steps else 0.0)
            + self.rl_share * rl_steps / self.rl_steps
        )


# tiny: 16.9 min loaded (SFT 12.5, the engine's start 1, RL 2.7), 7.4 on idle cores (README);
# tiny-moe: 16.0 loaded (SFT 11.9, the engine's start 0.5, RL 3.0), 8.9 idle (SFT 5.5, RL 2.6;
# its expert matmuls as padded blocks off TPU)
MEASURED = {
    "tiny": Measured(16.9, 7.4, sft_share=12.5 / 16.9, rl_share=2.7 / 16.9),
    "tiny-moe": Measured(16.0, 8.9, sft_share=11.9 / 16.0, rl_share=3.0 / 16.0),
    # --task compaction: RL alone (configs/demo_compaction_cpu.yaml) from the warm start: 2.5 min
    # on idle cores (RL 140 s of 152); loaded: not measured, the tiny demo's ratio (x2.3)
    "compaction": Measured(5.7, 2.5, sft_share=0, rl_share=140 / 152, sft_steps=0),
}


def expected_duration(demo: str, sft_steps: int, rl_steps: int) -> str:
    """What the demo tells a user it will take, for its ``sft_steps`` and ``rl_steps``."""
    m = MEASURED[demo]
    loaded, idle = (m.minutes(t, sft_steps, rl_steps) for t in (m.loaded, m.idle))
    sft = m.loaded * m.sft_share * sft_steps / m.sft_steps if m.sft_steps else 0.0
    most = " (SFT most of it)" if sft > loaded / 2 else ""
    scaled = (sft_steps, rl_steps) != (m.sft_steps, m.rl_steps)
    how = f" ({sft_steps} SFT and {rl_steps} RL steps)" if scaled else ""
    if not m.sft_steps:  # measured without SFT: RL alone
        uncounted = f"; {sft_steps} SFT steps not counted" if sft_steps else ""
        how = f" ({rl_steps} RL steps{uncounted})" if scaled else ""
    return (
        f"about {loaded:.0f} minutes on 2 CPU cores shared with other jobs{most}, "
        f"{idle:.1f} on idle ones{how}"
    )


LORA_DURATION = "; with --lora the RL phase trains adapters (rank 16) on the SFT policy"

# The model: Qwen2 layout (q/k/v bias, tied embeddings), head_dim 64 as vLLM's CPU kernels need.
MODEL = dict(
    model_type="qwen2",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    hidden_act="silu",
)


@dataclasses.dataclass(frozen=True)
class TaskFiles:
    model: Path
    train: Path
    val: Path
    sft: Path
    tools: Path


def task_files(folder: Path) -> TaskFiles:
    """Where `prepare` writes the task into ``folder``."""
    return TaskFiles(
        model=folder / "model",
        train=folder / "train.jsonl",
        val=folder / "val.jsonl",
        sft=folder / "sft.jsonl",
        tools=CALCULATOR,
    )


Task = ArithmeticTask | CompactionTask


def _demonstrations(task: Task, n: int, seed: int) -> list[list[dict]]:
    """The demonstrated conversations of ``n`` of the task's problems (imperfect: see the
    task's module; a compacted episode is two)."""
    rng = random.Random(f"demonstrations/{seed}")
    return [c for s in task.samples(n, seed, "sft") for c in task.conversations(s, rng)]


def prepare(
    folder: Path,
    task: Task | None = None,
    *,
    n_train: int = 4000,
    n_val: int = 200,
    n_sft: int = 3000,
    vocab_size: int = 2048,
    seed: int = 0,
    model: dict[str, Any] = MODEL,
) -> TaskFiles:
    """Writes the task data, demonstrations, tokenizer and initial checkpoint (``model``'s HF
    fields) into ``folder``."""
    task = task or ArithmeticTask()
    folder.mkdir(parents=True, exist_ok=True)
    conversations = _demonstrations(task, n_sft, seed)
    files = task_files(folder)
    write_model(files.model, conversations, model, vocab_size, seed)
    write_jsonl(files.train, task.samples(n_train, seed, "train"))
    write_jsonl(files.val, task.samples(n_val, seed, "val"))
    write_demonstrations(files.sft, conversations)
    return files


def write_model(
    folder: Path,
    conversations: list[list[dict]],
    model: dict[str, Any],
    vocab_size: int,
    seed: int = 0,
) -> None:
    """Writes into ``folder`` a byte-level BPE tokenizer trained on ``conversations`` as the
    ChatML tool template renders them (with the calculator's tool schemas), that template,
    and a random-init model of ``model``'s HF fields sized to the tokenizer, as an HF
    checkpoint."""
    schemas = ToolRegistry.from_yaml(CALCULATOR).schemas()
    template = chat_template("chatml_tools")
    texts = [render_template(template, c, schemas) for c in conversations] + NUMBERS * 4
    backend = train_bpe(texts, vocab_size, digit_groups=3, merge_across_words=True)
    save_tokenizer(folder, backend, template)
    cfg = ModelConfig.from_hf({**model, "vocab_size": backend.get_vocab_size()})
    save_hf(folder, cfg, init_params(jax.random.key(seed), cfg, one_device_sharder()))


# `jarl checkpoint make`'s models: the demo's, a larger one of the same layout (~25M
# parameters with its 4k-token vocabulary) and a Qwen3-MoE of each size, all reading
# contexts as long as a real checkpoint's (configs/gsm8k_tools_qwen2.5.yaml's
# engine.max_model_len is 4096); bench/learner.py and bench/decode.py time the MoE ones
SMALL = {
    **MODEL,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}
PRESETS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (HF fields, vocabulary to train)
    "tiny": ({**MODEL, "max_position_embeddings": 8192}, 2048),
    "small": (SMALL, 4096),
    # the tiny model's size as a Qwen3-MoE: 8 experts, 2 per token; layer 1 a dense MLP
    "tiny-moe": (
        {
            **MODEL,
            "model_type": "qwen3_moe",
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "max_position_embeddings": 8192,
        },
        2048,
    ),
    # small's size as a Qwen3-MoE laid out as the released ones (every layer sparse): 8
    # experts of a quarter of small's MLP width, 2 per token; ~46M parameters, ~17M active
    "small-moe": (
        {
            **SMALL,
            "model_type": "qwen3_moe",
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 384,
            "norm_topk_prob": True,
            "mlp_only_layers": [],
        },
        4096,
    ),
    # the tiny model's size as Gemma 3: two local layers of a 16-position window, a global one
    "tiny-gemma3": ({**DEMO_GEMMA3, "max_position_embeddings": 8192}, 2048),
}


# `jarl demo --model NAME`: the model it makes (HF fields) and the config it trains it with
DEMOS: dict[str, tuple[dict[str, Any], Path]] = {
    "tiny": (MODEL, DEMO_CONFIG),
    "tiny-moe": (
        {**PRESETS["tiny-moe"][0], "max_position_embeddings": MODEL["max_position_embeddings"]},
        DEMO_CONFIG.with_name("moe_calculator_cpu.yaml"),
    ),
}


def make_checkpoint(out: Path, preset: str = "tiny", seed: int = 0) -> ModelConfig:
    """A random-init checkpoint folder ``out`` of the ``preset`` model, with a tokenizer and
    the ChatML tool template (Qwen2.5's ``<tool_call>`` format: agent.parser hermes) beside
    it, to try a config with: nothing is downloaded. The tokenizer is trained on the demo's
    calculator transcripts; any text encodes (byte-level)."""
    model, vocab_size = PRESETS[preset]
    write_model(out, _demonstrations(ArithmeticTask(), 300, seed), model, vocab_size, seed)
    return ModelConfig.from_pretrained(out)


def demo_config(
    run_dir: Path, files: TaskFiles, overrides: Sequence[str] = (), config: Path = DEMO_CONFIG
) -> JarlConfig:
    paths = [
        f"model.path={files.model}",
        f"data.train={files.train}",
        f"data.val={files.val}",
        f"sft.data={files.sft}",
        f"tools.config={files.tools}",
        f"trainer.run_dir={run_dir}",
    ]
    return load_config(config, [*paths, *overrides])


def summarize(run_dir: Path, console: Console) -> dict[str, float]:
    """The held-out success before RL (after SFT) and at the end, from metrics.jsonl, as a
    table on ``console``."""
    val = read_metrics(run_dir / "metrics.jsonl", "val")
    first, last = val[0], val[-1]
    table = Table(title="held-out (greedy)")
    for col in ("", "success", "tool calls", "turns", "malformed-call rate"):
        table.add_column(col)
    for name, r in (
        (f"after SFT (step {first['step']})", first),
        (f"after RL (step {last['step']})", last),
    ):
        table.add_row(
            name,
            f"{r['success']:.3f}",
            f"{r['tool_calls']:.2f}",
            f"{r['turns']:.2f}",
            f"{r['malformed_call_rate']:.3f}",
        )
    console.print(table)
    return {"sft_success": first["success"], "rl_success": last["success"]}


# The learning test's smaller task (tests/train/test_learning.py, and bench/async.py and
# bench/strategies.py that train on it): sums and products, one calculator call each, held out
# on 100 problems; updates of 8 prompts x 8 samples.
SMALL_OVERRIDES = [
    "data.val_size=100",
    "data.prompts_per_step=8",
    "group.n=8",
    "engine.max_model_len=128",
    "agent.max_turns=3",
    "agent.max_response_tokens=64",
    "learner.micro_batch_size=32",
    "trainer.tensorboard=false",
]


# after SMALL_OVERRIDES: the smallest run of the benchmarks that train on the smaller task
# (their --smoke: every part runs, the figures mean nothing, so no program is compiled before
# it is needed)
SMOKE_OVERRIDES = [
    "data.val_size=4",
    "engine.warmup=false",
    "data.prompts_per_step=1",
    "group.n=2",
    "learner.micro_batch_size=2",
    "sft.batch_size=2",  # one micro-batch a warm-start step (16: 8 of them)
    "learner.row_tokens=128",  # a row holds one whole episode (max_model_len): not 2048
]


def small_task_sft(
    folder: Path, sft_steps: int = 600, overrides: Sequence[str] = (), demo: str = "tiny"
) -> TaskFiles:
    """The smaller task's files in ``folder/task`` and an SFT-only run of it in ``folder/sft``
    with the ``demo`` model (`DEMOS`; its policy exported to ``folder/sft/hf``, its held-out
    success in its metrics); ``overrides`` come after `SMALL_OVERRIDES` (a benchmark's smoke
    run shrinks it)."""
    files = small_task(folder / "task", demo)
    sft = [*SMALL_OVERRIDES, *overrides, f"sft.steps={sft_steps}", "trainer.steps=0"]
    train(demo_config(folder / "sft", files, sft, DEMOS[demo][1]))
    return files


def small_task(folder: Path, demo: str = "tiny") -> TaskFiles:
    """The smaller task's files in ``folder``: sums and products, one call each, with the
    ``demo`` model's random-init checkpoint and tokenizer (`DEMOS`)."""
    return prepare(
        folder,
        ArithmeticTask(mix=(0.5, 0.5, 0.0)),
        n_train=400,
        n_val=100,
        n_sft=1500,
        model=DEMOS[demo][0],
    )


# what each thing a run folder may hold is, by name; `run_outputs` lists what is there
OUTPUTS = {
    "reward.png": "reward curve",
    "throughput.png": "throughput",
    "metrics.jsonl": "metrics",
    "tensorboard": "TensorBoard: tensorboard --logdir {path}",
    "traces.jsonl": "rollout traces: jarl traces {run}",
    "checkpoints": "checkpoints: jarl eval {run} --n 8 (pass@k of 8 samples per prompt)",
    "hf": "final policy, HF checkpoint (transformers, vLLM)",
    "hf-adapter": "a LoRA run's final adapters, a PEFT folder (peft, vLLM's LoRARequest)",
    "config.yaml": "the run's config, every key as it ran",
    "summary.json": "held-out success after SFT and after RL",
    "sft": "--lora: the SFT phase's run (every weight): its hf/ is the base the adapters train on",
    "task": "the task: data, demonstrations, tokenizer, initial model",
}


def run_outputs(run_dir: Path) -> list[str]:
    """One line per file or folder ``run_dir`` holds (what it is, then where), read from the
    folder itself: anything a run wrote appears, described by `OUTPUTS` if it is known."""
    order = list(OUTPUTS)
    lines = []
    for path in sorted(
        run_dir.iterdir(),
        key=lambda p: (order.index(p.name) if p.name in OUTPUTS else len(order), p.name),
    ):
        what = OUTPUTS.get(path.name, "")
        shown = f"{path}/" if path.is_dir() else str(path)
        lines.append(f"  {shown:<{len(str(run_dir)) + 16}}{what.format(path=path, run=run_dir)}")
    return lines


def run(
    run_dir: Path,
    console: Console,
    overrides: Sequence[str] = (),
    demo: str = "tiny",
    lora: bool = False,
    task: str = "calculator",
) -> dict[str, float]:
    """The demo with the ``demo`` model of `DEMOS` (its config) in ``run_dir``. With ``lora``
    (the tiny model only), SFT trains every weight of the random-init model in
    ``run_dir/sft``, as the demo does (adapters on a random base learn nothing: the base is
    what a real run's pretrained model is), and RL then trains LoRA adapters on that policy
    with configs/demo_calculator_lora_cpu.yaml, its base frozen; ``overrides`` apply to both
    phases (the SFT phase keeps ``model.lora.rank=0``). The ``compaction`` task
    (`jax_agent_rl.data.compaction`) trains RL alone with configs/demo_compaction_cpu.yaml, from
    the committed warm start `COMPACTION_WARM_START` (its SFT from scratch is a lottery: see
    the constant)."""
    model, config = DEMOS[demo]
    if lora and demo != "tiny":
        raise ConfigError(f"jarl demo --lora: the tiny model only (not --model {demo})")
    compaction = task == "compaction"
    if compaction:
        if lora or demo != "tiny":
            raise ConfigError("jarl demo --task compaction: the tiny model only, without --lora")
        own_model = any(o.startswith("model.path=") for o in overrides)
        if not own_model and not (COMPACTION_WARM_START / "model.safetensors").is_file():
            raise ConfigError(
                f"jarl demo --task compaction trains from the committed warm start "
                f"{COMPACTION_WARM_START}, which is not here: run it from a checkout of the "
                "repository, or give model.path= an SFT policy of the task "
                "(scripts/learning_checkpoints.py tiny-compaction makes one; an SFT of this "
                "task lands well about one time in four: docs/agents.md)"
            )
        config = COMPACTION_CONFIG
        overrides = [f"model.path={COMPACTION_WARM_START}", "sft.data=", "sft.steps=0", *overrides]
    files = task_files(run_dir / "task")
    phases = (  # bad keys first
        lora_phases(run_dir, files, overrides)
        if lora
        else [demo_config(run_dir, files, overrides, config)]
    )
    sft_cfg = phases[0]
    measured = "compaction" if compaction else demo
    sft_steps = sft_cfg.sft.steps if sft_cfg.sft.data else 0  # (no demonstrations: no SFT)
    console.print(
        f"jarl demo: {expected_duration(measured, sft_steps, phases[-1].trainer.steps)}"
        f"{LORA_DURATION if lora else ''}",
        highlight=False,
        soft_wrap=True,
    )
    request_cpu_devices(sft_cfg.mesh.data * sft_cfg.mesh.fsdp * sft_cfg.mesh.tensor)
    made_folder(run_dir / "task", f"--run-dir {run_dir}")
    with progress.phase(console, "writing the task, a tokenizer and the initial model"):
        folder = run_dir / "task"
        files = compaction_task(folder) if compaction else prepare(folder, model=model)
    start = phases[0].model.path
    console.print(
        f"the task in {run_dir / 'task'}; RL from the SFT policy {start}"
        if compaction
        else f"task, tokenizer and a {_params(files.model):,}-parameter model in {run_dir / 'task'}"
    )
    for phase in phases:
        if phase.model.lora.rank:
            console.print(f"RL with LoRA adapters on the SFT policy ({phase.model.path})")
        train(phase, console)
    result = summarize(run_dir, console)
    (run_dir / "summary.json").write_text(json.dumps(result) + "\n")
    console.print("\nrun folder:", *run_outputs(run_dir), sep="\n", highlight=False, soft_wrap=True)
    return result


def lora_phases(run_dir: Path, files: TaskFiles, overrides: Sequence[str]) -> list[JarlConfig]:
    """`jarl demo --lora`'s two runs (`run`): the demo's SFT of every weight in ``run_dir/sft``
    (no RL), then RL of LoRA adapters on its exported policy in ``run_dir`` (no SFT)."""
    sft = [*overrides, f"trainer.run_dir={run_dir / 'sft'}", "model.lora.rank=0"]
    rl = [*overrides, f"model.path={run_dir / 'sft' / 'hf'}", "sft.data=", "sft.steps=0"]
    return [
        demo_config(run_dir, files, [*sft, "trainer.steps=0"]),
        demo_config(run_dir, files, rl, LORA_CONFIG),
    ]


def _params(model_dir: Path) -> int:
    return ModelConfig.from_pretrained(model_dir).num_params


# The compaction example's learning test (tests/train/test_learning.py): its config's budgets
# and compaction with the smaller task's held-out set and update size.
COMPACTION_OVERRIDES = [
    "data.prompts_per_step=8",
    "group.n=8",
    "learner.micro_batch_size=32",
    "trainer.tensorboard=false",
]


def compaction_task(folder: Path, demo: str = "tiny") -> TaskFiles:
    """The compaction example's files in ``folder`` (`jax_agent_rl.data.compaction`), with the
    ``demo`` model's random-init checkpoint and tokenizer (`DEMOS`)."""
    return prepare(
        folder, CompactionTask(), n_train=400, n_val=100, n_sft=1500, model=DEMOS[demo][0]
    )


def compaction_task_sft(folder: Path, sft_steps: int, demo: str = "tiny") -> TaskFiles:
    """The compaction example's files in ``folder/task`` and an SFT-only run of them in
    ``folder/sft`` (its policy exported to ``folder/sft/hf``)."""
    files = compaction_task(folder / "task", demo)
    sft = [*COMPACTION_OVERRIDES, f"sft.steps={sft_steps}", "trainer.steps=0"]
    train(demo_config(folder / "sft", files, sft, COMPACTION_CONFIG))
    return files
