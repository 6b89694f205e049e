"""The ``jarl`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console


def _demo(args: argparse.Namespace) -> int:
    from jax_agent_rl import demo

    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    demo.run(run_dir, Console())
    return 0


def _config(args: argparse.Namespace) -> int:
    from jax_agent_rl.config import ConfigError, JarlConfig, load_config, to_yaml

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no file given: the first word is an override
        config, overrides = None, [config, *overrides]
    try:
        cfg: JarlConfig = load_config(config, overrides)
    except ConfigError as e:
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from jax_agent_rl.models import ModelConfig, UnsupportedConfigError

    try:
        cfg = ModelConfig.from_pretrained(args.checkpoint)
    except (UnsupportedConfigError, FileNotFoundError) as e:
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    for field, value in vars(cfg).items():
        print(f"{field:>24}: {value}")
    print(f"{'parameters':>24}: {cfg.num_params:,}")
    return 0


def _serve_tools(args: argparse.Namespace) -> int:
    from jax_agent_rl.tools.registry import ToolRegistry
    from jax_agent_rl.tools.server import serve

    registry = ToolRegistry.from_yaml(args.tools)
    print(f"serving {registry.names} on http://{args.host}:{args.port}", flush=True)
    try:
        serve(registry, args.host, args.port, args.token, args.max_concurrency, args.timeout)
    except ValueError as e:
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jarl",
        description="jax_agent_rl: agentic reinforcement learning of language models in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo",
        help="write a small checkpoint, load it in JAX, check it against transformers",
        description="Writes a random-init Qwen2 checkpoint and tokenizer with transformers, loads "
        "it into the JAX decoder, compares logits and greedy KV-cache decoding with transformers, "
        "and exports it back. (Becomes the CPU training demo once the trainer lands.)",
    )
    p.add_argument("--run-dir", help="where to write the run (default: runs/demo-<time>)")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "config",
        help="print a resolved run config",
        description="Loads a YAML config, applies dotted overrides (model.dtype=bfloat16) and "
        "prints the result; an unknown key or a bad value is an error naming it.",
    )
    p.add_argument("config", nargs="?", help="YAML file (optional: defaults only)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    p.set_defaults(func=_config)

    p = sub.add_parser(
        "inspect",
        help="show how a local HF checkpoint maps onto the JAX decoder",
        description="Reads config.json of a local HF checkpoint folder and prints the decoder "
        "config it maps to, or the field that is not supported.",
    )
    p.add_argument("checkpoint", help="a local HF checkpoint folder")
    p.set_defaults(func=_inspect)

    p = sub.add_parser(
        "serve-tools",
        help="serve a tools YAML over HTTP for agent rollouts",
        description="Runs the tool server: GET /health, GET /tools, POST /execute, POST /release, "
        "GET /metrics. State is sticky per trajectory. A non-loopback --host needs --token.",
    )
    p.add_argument("--tools", default="configs/tools_default.yaml", help="tools YAML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token", default=None, help="bearer token clients must send")
    p.add_argument("--max-concurrency", type=int, default=64, help="calls running at once")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    p.set_defaults(func=_serve_tools)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
