"""What recording the traced trajectories' per-token learner logprobs, entropies and advantages
costs.

The learner half of a step (`jax_agent_rl.train.learn.learn`) on the demo's config and model
(`jarl demo`'s task, prepared small): 16 prompts x 8 episodes of the demo's shape (a 48-token
prompt, then turns of sampled tokens and tool results up to 128 response tokens), once
without traces and once with ``trainer.traces_per_step`` (4) traced, alternating, the first
compiling (not timed). Both run the one update program, which leaves every token's values on
the devices; the traced step then copies them off and reads the traced trajectories' tokens
out of them on the host (`UpdateTokens.signals`, what the trace hook does). ``overhead`` is
(traced - untraced) / untraced of the median step times: an upper bound on the share of a demo
step (the rollout, which tracing does not touch, is left out of the denominator).

    .venv/bin/python bench/traces.py [--steps N] [--smoke]

``--smoke``: the smallest run that goes through every part (2 prompts x 2 episodes, one
traced, one timed step of each kind): it checks the bench works, its figures mean nothing.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import DEMO_CONFIG, prepare
from jax_agent_rl.config import JarlConfig, load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.models import request_cpu_devices
from jax_agent_rl.train.build import build_run
from jax_agent_rl.train.learn import learn
from jax_agent_rl.train.traces import trace_picks


def episodes(rng: np.random.Generator, prompts: int, n: int, vocab: int) -> list[Episode]:
    """Demo-shaped episodes: turns of up to 40 sampled tokens, each but the last followed
    by a 12-token tool result, 128 response tokens at most; rewards 0 / 1 at random."""
    out = []
    for p in range(prompts):
        for i in range(n):
            t = Trajectory(uid=f"p{p}/{i}", group_id=f"p{p}", prompt_ids=list(range(1, 49)))
            for turn in range(int(rng.integers(1, 4))):
                if turn:
                    t.append(rng.integers(3, vocab, 12).tolist(), model=False)
                k = int(rng.integers(8, 41))
                t.append(rng.integers(3, vocab, k).tolist(), model=True, logprobs=[-1.0] * k)
            out.append(Episode(t, reward=float(rng.integers(0, 2))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each kind")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = parser.parse_args()
    smoke = ["data.prompts_per_step=2", "group.n=2", "trainer.traces_per_step=1"]
    if args.smoke:
        args.steps = 1
    demo: JarlConfig = load_config(DEMO_CONFIG, ["model.path=unset", "data.train=unset"])
    mesh = demo.mesh
    request_cpu_devices(mesh.data * mesh.fsdp * mesh.tensor)  # as `jarl demo` does on CPUs
    with tempfile.TemporaryDirectory() as tmp:
        task = prepare(Path(tmp) / "task", ArithmeticTask(), n_train=16, n_val=4, n_sft=16)
        cfg: JarlConfig = load_config(
            DEMO_CONFIG,
            [
                f"model.path={task.model}", f"data.train={task.train}", "data.val=",
                "sft.data=", f"tools.config={task.tools}", f"trainer.run_dir={tmp}/run",
                "trainer.tensorboard=false", *(smoke if args.smoke else []),
            ],
        )  # fmt: skip
        run, state = build_run(cfg, Console(file=io.StringIO()))
        rng = np.random.default_rng(0)
        trajs = episodes(rng, cfg.data.prompts_per_step, cfg.group.n, run.tokenizer.vocab_size)
        picks = trace_picks(trajs, cfg.trainer.traces_per_step)
        times: dict[str, list[float]] = {"untraced": [], "traced": []}
        for i in range(args.steps + 1):
            for kind, chosen in (("untraced", []), ("traced", picks)):
                t0 = time.perf_counter()
                state, _, _, tokens = learn(run.learner, state, run.cfg, trajs, trajs)
                if chosen:
                    assert tokens is not None
                    signals = tokens.signals([e.traj for e in chosen])
                if i:  # the first of each compiles
                    times[kind].append(time.perf_counter() - t0)
        assert all(signals.get(t.uid) for t in picks)
        run.checkpoints.close()
        run.metrics.close()
    untraced, traced = (statistics.median(times[k]) for k in ("untraced", "traced"))
    print(
        json.dumps(
            {
                "bench": "traces",
                "traced_trajectories": len(picks),
                "episodes": len(trajs),
                "untraced_step_s": round(untraced, 4),
                "traced_step_s": round(traced, 4),
                "overhead": round((traced - untraced) / untraced, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
