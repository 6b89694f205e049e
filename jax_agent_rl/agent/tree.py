"""Tree rollouts (``group.strategy=tree``): episodes that branch at turn boundaries.

A prompt's tree starts ``n_roots`` episodes. Whenever one of them ends a turn with a tool
observation (a turn boundary) and has branched fewer than ``depth`` times, ``branch - 1``
copies of it go on from there beside it, each sampling its own continuation: siblings share
every token up to the boundary. A branch asks the backend for its first turn with
``prefix_session`` set to the episode it was copied from, so the shared prefix comes from the
backend's prefix cache instead of being prefilled again (`GenerateRequest`).

Each leaf is a whole trajectory (its ``prompt_ids + response_ids`` is what the model saw, as
for a chain episode), the leaves of one prompt form its GRPO group, and the tree draws on one
`Budget` of model tokens and tool calls per prompt: an episode that finds it spent stops
(stop reason ``budget``), so the budget is never exceeded. A leaf records what it shares with
the episode it was copied from (``forked_from``, ``forked_tokens``, ``forked_calls``), so the
leaves' own tokens and calls (`Trajectory.own_model_tokens`, ``own_tool_calls``) add up to
exactly what the tree used.

A branch's tools start afresh (tool state is per trajectory, and a tool's state cannot be
copied): the tree suits tools whose results do not depend on the episode's earlier calls
(a calculator, search, a sandbox that runs each call in a fresh interpreter).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback

from jax_agent_rl.agent.context import AgentContext, Budget
from jax_agent_rl.agent.loop import take_turn
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import TreeSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool


def tree_budget(tree: TreeSection, n: int, max_response_tokens: int, max_turns: int) -> Budget:
    """A prompt's budget: the section's, or (0) that of ``n`` chain episodes at their limits."""
    return Budget(
        model_tokens=tree.model_tokens or n * max_response_tokens,
        tool_calls=tree.tool_calls or n * max_turns,
    )


async def run_tree(
    sample: Sample, ctx: AgentContext, tree: TreeSection, budget: Budget
) -> list[Trajectory]:
    """The leaves of ``sample``'s tree (see the module docstring), roots ``<uid>/<i>``, the
    ``j``-th copy at an episode's ``b``-th branching ``<its uid>.<b>.<j>``, in depth-first
    order; ``ctx``'s agent loop
    settings apply to each. The tree's episodes run concurrently (the backend batches them)."""
    ctx = dataclasses.replace(ctx, budget=budget)
    create_kwargs = create_kwargs_by_tool(sample.extra)
    leaves: dict[tuple[int, ...], Trajectory] = {}

    async def grow(traj: Trajectory, path: tuple[int, ...], group: asyncio.TaskGroup) -> None:
        t_start = time.perf_counter()
        branched = 0
        try:
            while (stop := await take_turn(ctx, traj, create_kwargs)) is None:
                if branched < tree.depth and not budget.spent:
                    branched += 1
                    for j in range(1, tree.branch):
                        child = traj.fork(f"{traj.uid}.{branched}.{j}")
                        group.create_task(grow(child, (*path, branched, j), group))
            traj.end(stop)
        except Exception:  # this episode's failure only, as in `run_tool_agent`
            traj.end("agent_error", traceback.format_exc())
        finally:
            traj.add_time("total_s", time.perf_counter() - t_start)
            await ctx.tools.release(traj.uid)
            leaves[path] = traj

    async with asyncio.TaskGroup() as group:
        for i in range(tree.n_roots):
            root = Trajectory(
                uid=f"{sample.uid}/{i}",
                group_id=sample.group_id,
                prompt_ids=ctx.builder.prompt_ids(sample.messages),
                messages=[dict(m) for m in sample.messages],
                timings={"tools_s": 0.0},
            )
            group.create_task(grow(root, (i,), group))
    return [leaves[path] for path in sorted(leaves)]
