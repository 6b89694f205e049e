"""One process of the learner-parity test (`test_multihost.py`): joins the run's processes
as ``jarl train`` does, builds the run from a config (SFT warm start included), then trains
two RL steps with `learn` on fixed trajectories (the SFT demonstrations with made-up rewards:
no rollout randomness), each process on its own share of the groups, and has process 0 save
the parameters before and after. Every process also checks that the params its engine
would serve are the learner's, whole on its own devices.

    python tests/multihost/learner_worker.py OUT.npz --num-processes N --process-id I
        [--coordinator HOST:PORT] -- OVERRIDES...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import load_config
from jax_agent_rl.models import request_cpu_devices

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_calculator_cpu.yaml"
GROUPS, N = 4, 4  # the test's config: data.prompts_per_step=4, group.n=4


def as_laid_out(trajs: list, processes: int, micro_batch_size: int) -> list:
    """``trajs`` in the row order ``processes`` processes give them, process ``p`` holding the
    ``p``-th slice: each micro-batch takes ``micro_batch_size / processes`` rows from each
    process in turn (`Learner.device_batch`)."""
    share, part = len(trajs) // processes, micro_batch_size // processes
    return [
        t
        for m in range(share // part)
        for p in range(processes)
        for t in trajs[p * share + m * part : p * share + (m + 1) * part]
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument(
        "--rows-as-processes",
        type=int,
        default=None,
        help="one process: order the rows as this many processes would lay them out",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()
    cfg = load_config(CONFIG, args.overrides)
    group = distributed.ProcessGroup(args.coordinator, args.num_processes, args.process_id)
    request_cpu_devices(cfg.mesh.data * cfg.mesh.fsdp // args.num_processes)
    distributed.initialize(group)

    import jax
    from rich.console import Console

    from jax_agent_rl.agent.episode import Episode
    from jax_agent_rl.tokenization.turns import TurnBuilder
    from jax_agent_rl.train import build_run
    from jax_agent_rl.train.learn import learn
    from jax_agent_rl.train.sft import load_demonstrations

    run, state = build_run(cfg, Console(quiet=True))
    start = distributed.host_copy(state.policy.params)
    demos = load_demonstrations(cfg.sft.data, TurnBuilder(run.tokenizer, run.registry.schemas()))
    share = GROUPS * N // jax.process_count()
    for step in range(2):
        trajs = [
            Episode(
                dataclasses.replace(
                    demos[(step * GROUPS * N + i) % len(demos)],
                    uid=f"t{step}/{i}",
                    group_id=f"g{step}/{i // N}",
                ),
                reward=float((i * 7 + step) % 5) / 4,
            )
            for i in range(GROUPS * N)
        ]
        if args.rows_as_processes:
            trajs = as_laid_out(trajs, args.rows_as_processes, cfg.learner.micro_batch_size)
        mine = trajs[jax.process_index() * share : (jax.process_index() + 1) * share]
        state, *_ = learn(run.learner, state, run.cfg, mine, mine)
    end = distributed.host_copy(state.policy.params)
    # what this process's engine would be given: the new params, whole, on its own devices
    served = run.serving_params(state)
    want = distributed.host_copy(run.learner.rollout_params(state, cfg.model.dtype))
    for got, ref in zip(jax.tree.leaves(served), jax.tree.leaves(want), strict=True):
        assert {d.process_index for d in got.sharding.device_set} == {jax.process_index()}
        assert np.array_equal(np.asarray(got), ref), "served params differ from the learner's"
    if distributed.is_primary():
        flat = {
            f"{kind}/{jax.tree_util.keystr(path)}": np.asarray(leaf)
            for kind, tree in (("start", start), ("end", end))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        }
        np.savez(args.out, **flat)
    run.checkpoints.close()
    run.metrics.close()


if __name__ == "__main__":
    sys.exit(main())
