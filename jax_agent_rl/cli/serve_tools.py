"""``jarl serve-tools``: its arguments, read with nothing of the tool server imported (it is
imported when the command runs, so ``jarl --help`` stays quick)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jax_agent_rl.cli.flags import PORT, number
from jax_agent_rl.config.ranges import COUNT, TIMEOUT
from jax_agent_rl.config.sections import ToolServerSection, ToolsSection

if TYPE_CHECKING:
    from jax_agent_rl.tokenization import Tokenizer
    from jax_agent_rl.tools.registry import ToolRegistry


def _serve_tools(args: argparse.Namespace) -> int:
    """``jarl serve-tools``: a bad input is one ``jarl:`` line on stderr, exit code 2."""
    from jax_agent_rl.config import ConfigError, package_file
    from jax_agent_rl.tokenization.tool_calls import PARSERS
    from jax_agent_rl.tools.protocol import RequestCaps
    from jax_agent_rl.tools.registry import ToolRegistry
    from jax_agent_rl.tools.server import serve
    from jax_agent_rl.usercode.threads import error_text

    try:
        tools = package_file(args.tools, "--tools")
        tokenizer = _tokenizer(args.tokenizer)  # (before the tools start: a sandbox pool)
    except (ConfigError, ValueError) as e:
        return _refuse(str(e))
    if args.action_parser not in PARSERS:
        names = sorted(PARSERS)
        return _refuse(
            f"--action-parser={args.action_parser!r} is not a parser: use one of {names}"
        )
    if not Path(tools).is_file():
        return _refuse(f"--tools {tools!r} does not exist: expected a tools YAML")
    try:
        registry = ToolRegistry.from_yaml(tools)
    except Exception as e:  # the file names any class with any arguments: its failure is ours
        first = (error_text(e).splitlines() or [type(e).__name__])[0]
        return _refuse(f"--tools {tools!r}: {first}")
    where = f"http://{args.host}:{args.port}" + (f" and unix:{args.socket}" if args.socket else "")
    try:
        serve(
            registry,
            args.host,
            args.port,
            token=args.token,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout,
            idle_timeout_s=args.idle_timeout,
            max_trajectories=args.max_trajectories,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            caps=RequestCaps(
                max_id_bytes=args.max_id_bytes,
                max_batch_calls=args.max_batch_calls,
                max_action_calls=args.max_action_calls,
            ),
            max_connections=args.max_connections,
            action_parser=args.action_parser,
            tokenizer=tokenizer,
            socket_path=args.socket,
            announce=lambda: print(announcement(registry, where), flush=True),
        )
    except ValueError as e:
        return _refuse(str(e))
    return 0


def _tokenizer(folder: str) -> Tokenizer | None:
    """The tokenizer of ``--tokenizer`` (None: not given); raises `ValueError` in one line."""
    from jax_agent_rl.tokenization import Tokenizer
    from jax_agent_rl.usercode.threads import error_text

    if not folder:
        return None
    try:
        return Tokenizer.from_pretrained(Path(folder))
    except Exception as e:  # a missing folder, a file no tokenizer reads: one line
        first = (error_text(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"--tokenizer {folder!r}: {first}") from e


def announcement(registry: ToolRegistry, where: str) -> str:
    """What the server says as it starts: its tools and address, and for each python tool
    what bounds an execution's memory (a cgroup per execution, or the fallback's accounting
    where no cgroup can be made), so that an operator sees which bound is in force."""
    from jax_agent_rl.tools.sandbox import PythonTool

    lines = [f"serving {registry.names} on {where}"]
    for name in registry.names:
        tool = registry.get(name)
        if isinstance(tool, PythonTool):
            lines.append(f"{name}: memory bounded by {tool.sandbox.memory_bound}")
    return "\n".join(lines)


def _refuse(problem: str) -> int:
    print(f"jarl: {problem}", file=sys.stderr)
    return 2


def add_serve_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``jarl serve-tools`` to the subcommands ``sub``."""
    p = sub.add_parser(
        "serve-tools",
        help="serve a tools YAML over HTTP for agent rollouts",
        description="Runs the tool server: GET /health, GET /tools, POST /execute, POST /release, "
        "GET /metrics, and verl-tool's POST /get_observation (actions read by --action-parser). "
        "State is sticky per trajectory, in the client's namespace (the X-Tool-Namespace "
        "header; each HttpTools client has its own). A non-loopback --host needs --token; only "
        "GET /health (which says ok, nothing more) answers without it. What clients can hold "
        "is bounded: trajectory state, ids, calls per request, request bodies, connections.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--tools",
        default=ToolsSection.config,
        help="tools YAML file (pkg://<package>/<path>: a file inside an installed package)",
    )
    p.add_argument("--host", default=ToolServerSection.host, help="address to listen on")
    p.add_argument(
        "--port", type=number(int, PORT), default=ToolServerSection.port, help="port to listen on"
    )
    p.add_argument("--token", default=None, help="bearer token clients must send")
    p.add_argument(
        "--max-concurrency",
        type=number(int, COUNT),
        default=ToolServerSection.max_concurrency,
        help="calls running at once",
    )
    p.add_argument(
        "--timeout",
        type=number(float, TIMEOUT),
        default=ToolServerSection.timeout_s,
        help="seconds per call",
    )
    p.add_argument(
        "--idle-timeout",
        type=number(float, TIMEOUT),
        default=ToolServerSection.idle_timeout_s,
        help="seconds after a trajectory's last call ends before its tool state is released "
        "(clients that crash or never call /release); a later call starts fresh state",
    )
    p.add_argument(
        "--max-trajectories",
        type=number(int, COUNT),
        default=ToolServerSection.max_trajectories,
        help="trajectories holding tool state at once; a call that would open one more gets "
        "an error result. Set it above the number of trajectories a rollout runs at once",
    )
    p.add_argument(
        "--max-body-bytes",
        type=number(int, COUNT),
        default=ToolServerSection.max_body_bytes,
        help="largest request body (an /execute_batch of all its calls); larger gets 413",
    )
    p.add_argument(
        "--body-timeout",
        type=number(float, TIMEOUT),
        default=ToolServerSection.body_timeout_s,
        help="seconds to receive a whole request body; a slower client gets 408",
    )
    p.add_argument(
        "--max-id-bytes",
        type=number(int, COUNT),
        default=ToolServerSection.max_id_bytes,
        help="largest trajectory id (UTF-8 bytes); a request with a longer one gets 422",
    )
    p.add_argument(
        "--max-batch-calls",
        type=number(int, COUNT),
        default=ToolServerSection.max_batch_calls,
        help="calls in one /execute_batch, and trajectories in one /get_observation; more get "
        "422. Keep it at or above the clients' batch (HttpTools batches 32)",
    )
    p.add_argument(
        "--max-action-calls",
        type=number(int, COUNT),
        default=ToolServerSection.max_action_calls,
        help="tool calls in one verl-tool action; an action with more runs none of them and "
        "its observation is an error naming this cap",
    )
    p.add_argument(
        "--max-connections",
        type=number(int, COUNT),
        default=ToolServerSection.max_connections,
        help="open connections (idle keep-alive ones included) at which a new request gets "
        "503; bounds the request bodies held in memory to this times --max-body-bytes",
    )
    p.add_argument(
        "--action-parser",
        default=ToolServerSection.action_parser,
        help="how /get_observation reads the tool calls in verl-tool's actions, and writes "
        "the observation (the agent.parser your model was trained with): hermes, llama3_json, "
        "python_tag, tool_tag or fenced_python",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="the policy's tokenizer folder, which verl-tool's POST /get_observation needs "
        "(refused without it): its special tokens' text in an observation is written with a "
        "word joiner (U+2060), since verl-tool's client reads such text as special tokens",
    )
    p.add_argument(
        "--socket",
        default=None,
        help="also serve the calls on this Unix socket (mode 0600; its directory must be "
        "yours and closed to others), for clients on this machine: HttpTools('unix:PATH'). "
        "Much cheaper per call than HTTP; the same token and bounds apply",
    )
    p.set_defaults(func=_serve_tools)
