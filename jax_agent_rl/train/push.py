"""The learner's weights to the rollout backend, after each update: the inference layout
they travel to (`Serving`: this process's share of the run's mesh, in the serving dtype; a
LoRA policy's adapters alone), the delta encoding where the backend takes deltas
(`rollout.delta.DeltaPusher`), and what a push moved and cost (`push_weights`' metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from jax.sharding import Mesh

from jax_agent_rl.cluster import distributed
from jax_agent_rl.models import Policy, Sharder, inference_mesh, policy_shardings
from jax_agent_rl.protocol import PushStats
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.update import LearnerState, trainable
from jax_agent_rl.rollout.delta import DeltaPusher, WeightDelta, push_bytes
from jax_agent_rl.rollout.metered import MeteredBackend


@dataclasses.dataclass(frozen=True)
class Serving:
    """Where this process's embedded engine serves: ``sharder``, the inference mesh
    (`models.inference_mesh`) of its devices of the run's mesh. With several processes, the
    params travel from the learner's layout to ``global_layout`` (the inference layout over
    every process's devices) and are then taken as ``local_layout`` arrays
    (`distributed.local_replica`)."""

    sharder: Sharder
    global_layout: Any
    local_layout: Any
    dtype: str
    policy: Policy

    @classmethod
    def of(cls, policy: Policy, mesh: Mesh, dtype: str) -> Serving:
        local = Sharder(inference_mesh(distributed.process_mesh(mesh)))
        return cls(
            local,
            policy_shardings(policy, Sharder(inference_mesh(mesh))),
            policy_shardings(policy, local),
            dtype,
            policy,
        )

    def params(self, learner: Learner, state: LearnerState) -> Any:
        return distributed.local_replica(
            learner.rollout_params(state, self.dtype), self.global_layout, self.local_layout
        )

    def pushed(self, learner: Learner, state: LearnerState) -> Any:
        m = self.policy
        return distributed.local_replica(
            learner.pushed_params(state, self.dtype),
            trainable(m, self.global_layout),
            trainable(m, self.local_layout),
        )


async def push_weights(
    serving: Serving,
    learner: Learner,
    state: LearnerState,
    pusher: DeltaPusher,
    backend: MeteredBackend,
    version: int,
) -> dict[str, float]:
    """Pushes the policy of ``state`` to ``backend`` as weight ``version`` (laid out as
    ``serving`` says, in a worker thread: the event loop goes on) and returns the push's
    metrics: its time and `push_metrics`."""
    t0 = time.perf_counter()
    params = await asyncio.to_thread(serving.pushed, learner, state)
    await pusher.push(backend, params, version)
    return {
        "time/weight_push_s": time.perf_counter() - t0,
        **push_metrics(backend.last_push, pusher.last),
    }


def push_metrics(stats: PushStats | None, sent: Any) -> dict[str, float]:
    """What a push moved (the backend's figures: a delta's bytes, `rollout.delta`, or the whole
    weights'; from what was sent where the backend says nothing) and how long it held
    generation up (`PushStats.stall_s`; -1: the backend does not say)."""
    if stats is None:
        return {
            "push/bytes": float(push_bytes(sent)),
            "push/delta": float(isinstance(sent, WeightDelta)),
            "push/stall_s": -1.0,
        }
    return {
        "push/bytes": float(stats.bytes),
        "push/delta": float(stats.delta),
        "push/stall_s": stats.stall_s,
    }
