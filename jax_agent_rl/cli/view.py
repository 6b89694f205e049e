"""``jarl view``: its arguments, read with nothing of the view imported (it is imported when
the command runs, so ``jarl --help`` stays quick)."""

from __future__ import annotations

import argparse

from jax_agent_rl.cli.flags import PORT, number
from jax_agent_rl.config.ranges import COUNT


def _view(args: argparse.Namespace) -> int:
    from jax_agent_rl.view.command import view_command

    return view_command(args)


def add_view_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``jarl view`` on the CLI's subcommands."""
    p = sub.add_parser(
        "view",
        help="see a run's traces token by token in a browser",
        description="A static HTML view of RUN (traces.jsonl, metrics.jsonl, plots): steps, "
        "trajectories filterable by data source, stop reason, reward, filter and staleness; "
        "each token coloured by role or by rollout logprob, learner/sampler ratio, advantage "
        "or staleness; groups side by side; tree rollouts as trees. Served on 127.0.0.1, or "
        "written with --out.",
    )
    p.add_argument("run_dir", help="a run folder")
    p.add_argument("--out", default=None, help="write the page (index.html) into this folder")
    p.add_argument(
        "--port", type=number(int, PORT), default=0, help="port to serve on (default: a free one)"
    )
    p.add_argument(
        "--steps",
        default=None,
        help="the steps whose traces to show: N, A:B (both included), A: or :B "
        "(default: the --last latest)",
    )
    p.add_argument(
        "--last",
        type=number(int, COUNT),
        default=50,
        help="without --steps, how many of the latest traced steps to show, at least 1 "
        "(default 50: a long run's every trace would make a page too large to open)",
    )
    p.set_defaults(func=_view)
