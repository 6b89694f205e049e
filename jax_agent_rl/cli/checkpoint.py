"""``jarl checkpoint make`` and ``jarl inspect``: local checkpoints made and read, with nothing
of the models imported until a command runs (``jarl --help`` stays quick)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jax_agent_rl.cli.flags import number
from jax_agent_rl.config.ranges import interval


def _checkpoint_make(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        problem = f"--out {out} exists and is not an empty folder: name a new one"
        print(f"jarl: {problem}", file=sys.stderr)
        return 2
    from jax_agent_rl.cli.demo import make_checkpoint
    from jax_agent_rl.config.paths import made_folder

    try:
        made_folder(out, f"--out {out}")
    except ValueError as e:
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    model = make_checkpoint(out, args.preset, args.seed)
    print(
        f"wrote a random-init {model.num_params:,}-parameter {model.family} checkpoint with its "
        f"tokenizer to {out}\ntry a config with it: jarl train CONFIG model.path={out} ..."
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from jax_agent_rl.models import ModelConfig

    try:
        cfg = ModelConfig.from_pretrained(args.checkpoint)
    except (ValueError, OSError) as e:  # a config it cannot use, invalid JSON, no regular file
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    for field, value in vars(cfg).items():
        print(f"{field:>24}: {value}")
    print(f"{'parameters':>24}: {cfg.num_params:,}")
    return 0


def add_checkpoint_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``jarl checkpoint make`` and ``jarl inspect`` on the CLI's subcommands."""
    p = sub.add_parser(
        "checkpoint",
        help="make a small local checkpoint to try a config with",
        description="Checkpoint folders made here, nothing downloaded.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    p = actions.add_parser(
        "make",
        help="write a random-init model and its tokenizer as an HF checkpoint folder",
        description="Writes a random-init model (config.json, model.safetensors; Qwen2's "
        "layout, Qwen3-MoE's for *-moe, Gemma 3's for tiny-gemma3), a byte-level BPE "
        "tokenizer trained on the demo's calculator transcripts and the ChatML tool template "
        "(agent.parser=hermes) into --out, so any config can be tried before a real "
        "checkpoint is at hand: jarl checkpoint make --out ckpt && jarl train CONFIG "
        "model.path=ckpt ... Its answers are noise.",
    )
    p.add_argument("--out", required=True, help="a new (or empty) folder to write")
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "tiny-moe", "small-moe", "tiny-gemma3"],
        default="tiny",
        help="tiny: the demo's model (~0.8M parameters); small: ~25M; tiny-moe / small-moe: a "
        "Qwen3-MoE of their size (8 experts, 2 per token; tiny-moe has one dense layer); "
        "tiny-gemma3: the tiny one as Gemma 3 (local layers of a 16-position window)",
    )
    p.add_argument(
        "--seed",
        type=number(int, interval(0, 2**63 - 1)),  # (jax.random.key takes an int64)
        default=0,
        help="of the weights and the tokenizer's corpus",
    )
    p.set_defaults(func=_checkpoint_make)

    p = sub.add_parser(
        "inspect",
        help="show how a local HF checkpoint maps onto the JAX decoder",
        description="Reads config.json of a local HF checkpoint folder and prints the decoder "
        "config it maps to, or the field that is not supported.",
    )
    p.add_argument("checkpoint", help="a local HF checkpoint folder")
    p.set_defaults(func=_inspect)
