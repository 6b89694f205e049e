"""Rollout replicas on a Ray cluster: `RayPool`, one `RolloutBackend` in front of many.

With ``engine.ray.address`` set, each of ``engine.ray.replicas`` replicas is a Ray actor
(`Replica`) holding one engine of ``engine.backend`` (embedded, vllm, ...: built by the
backend registry inside the actor), placed through a placement group of one bundle per
replica (``num_cpus``, ``num_gpus``, ``resources``; ``strategy`` spreads or packs them over
the nodes). The pool is the router:

- a session's turns go to the replica that served its last turn (its prefix cache holds the
  conversation); a new session goes to the live replica with the fewest requests in flight
  (`jax_agent_rl.rollout.router`);
- a weight push goes through the `WeightGate` every backend shares (requests in flight
  finish, new ones wait, so none is sampled under weights it did not start with): it is put
  into the object store once and loaded by every replica, with its version; a replica
  restarted meanwhile loads the newest. A LoRA policy's push is its adapters alone
  (`LayerAdapters`, to replicas serving a LoRA model: `Capabilities.lora`): a restarted
  replica starts from the base it started with and the newest adapters. Where the replicas
  take deltas (`Capabilities.delta_push`: embedded ones), a `WeightDelta` goes to each as it
  is, on the host (its indices and values: the bytes that cross the network); the pool keeps
  the last whole weights and the deltas since, and a restarted replica loads those whole
  weights and applies the deltas in order, so it serves bitwise what the others serve;
- a replica that dies (its process killed, its node lost) has its requests sent again to a
  live replica and counted (``rollout/requests_requeued``). A request is token ids in, so
  running it again loses nothing: the trajectory goes on from the same prompt, and its
  earlier turns and tool calls are not repeated. The replica is restarted in its bundle with
  the current weights, up to ``max_restarts`` times; after that it stays down, and the pool
  fails only when no replica is left.

Placement is Ray's own: `plan_placement` reserves the bundles, reads which node took each,
and releases them (``launch/gpu.sh --ray ADDRESS --dry-run`` prints it), so a plan that
cannot fit is reported before anything starts instead of waiting on Ray forever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

import jax

from jax_agent_rl.cluster.ray import connect, disconnect
from jax_agent_rl.models.adapters import base_of, check_adapters, with_adapters
from jax_agent_rl.models.lora import LayerAdapters
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import (
    Capabilities,
    GenerateRequest,
    GenerateResult,
    PushStats,
    RolloutBackend,
)
from jax_agent_rl.rollout.delta import WeightDelta, on_host, push_bytes, refuse_delta
from jax_agent_rl.rollout.gate import Ticket, WeightGate
from jax_agent_rl.rollout.router import Router

if TYPE_CHECKING:
    from jax_agent_rl.config import RaySection
    from jax_agent_rl.rollout.registry import BackendBuild


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What of a `BackendBuild` travels to a replica: the weights go apart (the object store),
    and the sharder (its devices are the pool's process's), the progress callback and the
    tokenizer stay behind."""

    build: dict[str, Any]  # the BackendBuild's other fields, by name

    @classmethod
    def of(cls, spec: BackendBuild) -> ReplicaSpec:
        kept = ("params", "sharder", "on_program", "decode")
        return cls(
            {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in kept}
        )


class Replica:
    """One rollout backend inside a Ray actor (``ray.remote(Replica)``; async methods run on
    the actor's event loop, so its requests are served concurrently), serving ``params``, or
    their base with ``adapters`` (a LoRA policy's, pushed since ``params``)."""

    def __init__(self, spec: ReplicaSpec, params: Any, adapters: Any = None) -> None:
        import ray

        from jax_agent_rl.rollout.registry import BackendBuild, make_backend

        if adapters is not None:
            params = with_adapters(base_of(params), adapters)
        # the replica's engine on a mesh of its own first device (the pool's stays behind)
        build = BackendBuild(**spec.build, params=params, sharder=one_device_sharder())
        self.backend: RolloutBackend = make_backend(build)
        self.node = ray.get_runtime_context().get_node_id()
        self.requests = 0  # in flight here

    def describe(self) -> tuple[Capabilities, str]:
        return self.backend.capabilities, self.node

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests += 1
        try:
            return await self.backend.generate(request)
        finally:
            self.requests -= 1

    async def update_weights(self, params: Any, version: int) -> float:
        """Seconds this replica took to load ``params``."""
        t0 = time.perf_counter()
        await self.backend.update_weights(params, version)
        return time.perf_counter() - t0

    async def abort(self, request_id: str) -> None:
        await self.backend.abort(request_id)

    async def close(self) -> None:
        await self.backend.close()


@dataclasses.dataclass
class _Slot:
    """Bundle ``index`` of the placement group and the replica serving in it (``None`` while
    it restarts, or for good once its restarts are spent)."""

    index: int
    actor: Any = None
    node: str = ""
    generation: int = 0  # bumped at each restart: a death is handled once per generation
    in_flight: int = 0
    restarts: int = 0
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    down: bool = False  # restarts spent
    starting: Any = None  # the replica being started in its place


def bundle_of(ray_cfg: RaySection) -> dict[str, float]:
    """One replica's resources, as a placement group bundle."""
    bundle = {"CPU": float(ray_cfg.num_cpus), **ray_cfg.resources}
    if ray_cfg.num_gpus:
        bundle["GPU"] = float(ray_cfg.num_gpus)
    return {k: v for k, v in bundle.items() if v}


def plan_placement(ray_cfg: RaySection, *, keep: bool = False) -> tuple[Any, list[str]]:
    """Reserves ``ray_cfg.replicas`` bundles on the connected cluster with Ray's placement
    group, and returns it with the node id that took each bundle. A plan the cluster cannot
    hold (too few resources, or too few nodes for STRICT_SPREAD) raises ``RuntimeError``
    naming what is missing; ``keep=False`` releases the reservation."""
    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group

    bundle = bundle_of(ray_cfg)
    _check_fits(ray_cfg, bundle, [n["Resources"] for n in ray.nodes() if n["Alive"]])
    pg = placement_group([dict(bundle) for _ in range(ray_cfg.replicas)], ray_cfg.strategy)
    try:
        ray.get(pg.ready(), timeout=ray_cfg.start_timeout_s)
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        placed = [nodes[i] for i in range(ray_cfg.replicas)]
    except BaseException:
        remove_placement_group(pg)
        raise
    if not keep:
        remove_placement_group(pg)
    return pg, placed


def _check_fits(ray_cfg: RaySection, bundle: dict[str, float], nodes: list[dict]) -> None:
    """Raises when no placement of the bundles on these nodes' resources exists."""
    fits = [min(int(n.get(k, 0.0) // v) for k, v in bundle.items()) for n in nodes]
    need, strategy = ray_cfg.replicas, ray_cfg.strategy
    room = {
        "STRICT_SPREAD": sum(f > 0 for f in fits),
        "STRICT_PACK": max(fits, default=0),
    }.get(strategy, sum(fits))
    if room < need:
        where = "nodes with room for one" if strategy == "STRICT_SPREAD" else "room for"
        raise RuntimeError(
            f"engine.ray: {need} replicas of {bundle} ({strategy}) do not fit the cluster: "
            f"{where} {room} on {len(nodes)} live nodes "
            f"(resources per node: {[{k: n.get(k, 0.0) for k in bundle} for n in nodes]})"
        )


class RayPool:
    """`RolloutBackend` over Ray actor replicas (see the module docstring). Built through
    `make_pool`; ``counters`` feed each step's ``rollout/*`` metrics."""

    def __init__(self, spec: BackendBuild) -> None:
        import ray

        self._ray = ray
        self._cfg = spec.engine.ray
        self._owns_ray = connect(self._cfg.address)
        self._spec = ReplicaSpec.of(spec)
        self._version = spec.version  # of the newest weights (a restarted replica loads them)
        self._adapters: Any = None  # the newest LoRA adapters pushed (on `_weights`' base)
        # the last whole weights' version (`_weights`), and the deltas pushed on it since,
        # (version, object ref) in order: what a restarted replica loads and applies
        self._whole_version = spec.version
        self._deltas: list[tuple[int, Any]] = []
        self._gate = WeightGate(spec.version)
        # the last push: its bytes (a LoRA policy's adapters alone), the seconds to put them
        # into the object store, the slowest replica's to load them, the whole push's
        self.last_push: PushStats | None = None
        # an engine process of its own (vLLM, JetStream) owns the replica's accelerators: JAX
        # there stays on the CPU rather than take their memory
        self._env = {} if spec.engine.backend == "embedded" else {"JAX_PLATFORMS": "cpu"}
        try:
            self._weights = ray.put(jax.device_get(spec.params))
            self._pg, self.nodes = plan_placement(self._cfg, keep=True)
        except BaseException:
            disconnect(self._owns_ray)
            raise
        self._slots = [_Slot(i) for i in range(self._cfg.replicas)]
        self._sessions = Router()
        self._where: dict[str, _Slot] = {}
        self._aborted: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._counts = {"replica_deaths": 0, "requests_requeued": 0, "replica_restarts": 0}
        try:
            actors = [self._start(slot) for slot in self._slots]
            described = ray.get(
                [a.describe.remote() for a in actors], timeout=self._cfg.start_timeout_s
            )
        except BaseException:
            self._release()
            raise
        for slot, actor, (_caps, node) in zip(self._slots, actors, described, strict=True):
            slot.actor, slot.node = actor, node
            slot.ready.set()
        self.capabilities: Capabilities = described[0][0]  # the replicas' own

    def _start(self, slot: _Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self._cfg
        actor_cls = self._ray.remote(Replica).options(
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            resources=dict(cfg.resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=slot.index
            ),
            name=f"jarl-replica-{slot.index}.{slot.generation}",
            runtime_env={"env_vars": self._env},
        )
        # the last whole weights (and the newest adapters on them): `_catch_up` applies the
        # deltas pushed since
        version = self._whole_version if self._deltas else self._version
        return actor_cls.remote(
            ReplicaSpec({**self._spec.build, "version": version}),
            self._weights,
            self._adapters,
        )

    def counters(self) -> dict[str, float]:
        """Totals so far: replica deaths, requests run again elsewhere, restarts."""
        return {f"rollout/{k}": float(v) for k, v in self._counts.items()}

    def live_nodes(self) -> list[str]:
        return [s.node for s in self._slots if s.actor is not None]

    def in_flight(self) -> list[int]:
        """Requests in flight per replica, as the router counts them."""
        return [s.in_flight for s in self._slots]

    async def _pick(self, request: GenerateRequest) -> _Slot:
        """The replica of the request's session (or of the session it continues), else the
        live one with the fewest requests in flight (waiting for a restart if none is live)."""
        while True:
            live = [s.index for s in self._slots if s.actor is not None]
            index = self._sessions.pick(request, live, lambda i: self._slots[i].in_flight)
            if index is not None:
                return self._slots[index]
            waiting = [s for s in self._slots if not s.down]
            if not waiting:
                raise RuntimeError(
                    f"every rollout replica died and spent its {self._cfg.max_restarts} "
                    "restarts (engine.ray.max_restarts)"
                )
            waits = [asyncio.ensure_future(s.ready.wait()) for s in waiting]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.request_id
        ticket = self._gate.enter(rid)
        try:
            # a request sent after `update_weights` began waits for its weights: Ray starts a
            # call that carries them only once they have reached the replica, so a request
            # sent meanwhile could overtake it
            if not await self._gate.admit(ticket):
                return GenerateResult((), None, "abort", self._gate.version)
            return await self._serve(request, ticket)
        finally:
            self._gate.done(ticket)

    async def _serve(self, request: GenerateRequest, ticket: Ticket) -> GenerateResult:
        """``request`` on a live replica, again on another while its replica dies under it."""
        rid, resent = request.request_id, 0
        while True:
            slot = await self._pick(request)
            if ticket.aborted:  # while no replica was live
                return GenerateResult((), None, "abort", self._gate.version)
            actor, generation = slot.actor, slot.generation
            slot.in_flight += 1
            self._where[rid] = slot
            try:
                result: GenerateResult = await actor.generate.remote(request)
            except self._ray.exceptions.RayTaskError as e:  # the replica's backend raised
                cause = e.cause
                raise (cause if isinstance(cause, Exception) else e) from None
            except self._ray.exceptions.RayActorError:
                self._lost(slot, generation)
                if rid in self._aborted:
                    self._aborted.discard(rid)
                    return GenerateResult((), None, "abort", self._gate.version)
                self._counts["requests_requeued"] += 1
                resent += 1
                continue
            finally:
                slot.in_flight -= 1
                self._where.pop(rid, None)
            self._aborted.discard(rid)
            self._sessions.remember(request.session_id, slot.index)
            return dataclasses.replace(result, resent=resent) if resent else result

    def _lost(self, slot: _Slot, generation: int) -> None:
        """The replica of ``slot`` (its ``generation``) died: count it once, restart it."""
        if slot.generation != generation or slot.actor is None:
            return
        self._counts["replica_deaths"] += 1
        slot.actor = None
        slot.ready.clear()
        if slot.restarts >= self._cfg.max_restarts:
            slot.down = True
            slot.ready.set()  # wakes waiters, who find it down
            return
        slot.restarts += 1
        slot.generation += 1
        task = asyncio.get_running_loop().create_task(self._restart(slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, slot: _Slot) -> None:
        """Starts a new replica in ``slot``'s bundle with the newest weights; one that dies
        while starting counts as a death and is tried again, within the restart budget."""
        while True:
            try:
                version = self._whole_version if self._deltas else self._version
                actor = slot.starting = self._start(slot)  # with the weights of `version`
                _, node = await actor.describe.remote()
                await self._catch_up(actor, version)
            except self._ray.exceptions.RayActorError:
                self._counts["replica_deaths"] += 1
                if slot.restarts >= self._cfg.max_restarts:
                    slot.down = True
                    slot.ready.set()
                    return
                slot.restarts += 1
                slot.generation += 1
                continue
            slot.actor, slot.node, slot.starting = actor, node, None
            self._counts["replica_restarts"] += 1
            slot.ready.set()
            return

    async def _catch_up(self, actor: Any, version: int) -> None:
        """Brings a replica started on ``version`` to the newest: the whole weights pushed
        since (or the newest adapters), then each delta on them in order; again while pushes
        land meanwhile."""
        while version != self._version:
            if self._deltas and version >= self._whole_version:
                for v, ref in [d for d in self._deltas if d[0] > version]:
                    await actor.update_weights.remote(ref, v)
                    version = v
                continue
            version = self._whole_version if self._deltas else self._version
            newest = self._weights if self._adapters is None else self._adapters
            await actor.update_weights.remote(newest, version)

    async def update_weights(self, params: Any, version: int) -> None:
        """``params``: the policy's weights, a LoRA policy's adapters alone (`LayerAdapters`),
        which replicas serving no LoRA model refuse, as here, or a `WeightDelta` on the last
        push, where the replicas take deltas."""
        delta = isinstance(params, WeightDelta)
        if not self.capabilities.delta_push:
            refuse_delta(params, "Ray replicas")
        lora = isinstance(params, LayerAdapters)
        if lora:
            if not self.capabilities.lora:
                raise ValueError(
                    "a push of LoRA adapters (LayerAdapters) to Ray replicas whose model has "
                    "none: push the whole model's weights"
                )
            check_adapters(self._spec.build["policy"].cfg, params)

        async def push() -> None:
            t0 = time.perf_counter()
            host = on_host(params) if delta else jax.device_get(params)
            ref = self._ray.put(host)
            if delta:
                self._deltas.append((version, ref))
            elif lora:
                self._adapters = ref
            else:
                self._weights, self._adapters = ref, None
                self._whole_version, self._deltas = version, []
            self._version = version
            t1 = time.perf_counter()
            live = [s for s in self._slots if s.actor is not None]
            loads = await asyncio.gather(*(self._push(s, ref) for s in live))
            size = push_bytes(host)
            self.last_push = PushStats(
                size, t1 - t0, max(loads, default=0.0), time.perf_counter() - t0, delta=delta
            )

        held = await self._gate.update(push, version)
        self.last_push = self.last_push and self.last_push.held(held)

    async def _push(self, slot: _Slot, ref: Any) -> float:
        """``slot``'s replica loads the pushed ``ref``: its seconds (0 if it died meanwhile)."""
        actor, generation = slot.actor, slot.generation
        try:
            seconds: float = await actor.update_weights.remote(ref, self._version)
        except self._ray.exceptions.RayTaskError as e:  # the replica's backend refused them
            cause = e.cause
            raise (cause if isinstance(cause, Exception) else e) from None
        except self._ray.exceptions.RayActorError:
            self._lost(slot, generation)  # its restart loads these weights
            return 0.0
        return seconds

    async def abort(self, request_id: str) -> None:
        self._gate.abort(request_id)  # one not sent yet will not be
        slot = self._where.get(request_id)
        if slot is None or slot.actor is None:
            return
        self._aborted.add(request_id)
        # a replica dead meanwhile: generate() sees the death and returns the abort
        with contextlib.suppress(self._ray.exceptions.RayActorError):
            await slot.actor.abort.remote(request_id)

    async def close(self) -> None:
        self._gate.close()
        for task in list(self._tasks):
            task.cancel()
        closing = [s.actor.close.remote() for s in self._slots if s.actor is not None]
        if closing:
            await asyncio.wait([asyncio.ensure_future(_quiet(c)) for c in closing], timeout=60)
        self._release()

    def _release(self) -> None:
        from ray.util import remove_placement_group

        for slot in self._slots:
            for actor in (slot.actor, slot.starting):
                if actor is not None:
                    self._ray.kill(actor)
            slot.actor = slot.starting = None
        remove_placement_group(self._pg)
        disconnect(self._owns_ray)


async def _quiet(ref: Any) -> None:
    with contextlib.suppress(Exception):  # a replica that fails to close is killed next
        await ref


def make_pool(spec: BackendBuild) -> RayPool:
    """The replicas ``spec.engine.ray`` asks for, started and serving ``spec.params``."""
    return RayPool(spec)


def main(argv: list[str] | None = None) -> None:
    """``python -m jax_agent_rl.rollout.ray_pool --address A ...``: where the cluster would
    place the replicas (a reservation, released at once)."""
    from jax_agent_rl.config import RaySection

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--address", required=True, help='"auto", "local" or HOST:PORT')
    parser.add_argument("--replicas", type=int, default=RaySection.replicas)
    parser.add_argument("--num-cpus", type=float, default=RaySection.num_cpus)
    parser.add_argument("--num-gpus", type=float, default=RaySection.num_gpus)
    parser.add_argument("--strategy", default=RaySection.strategy)
    args = parser.parse_args(argv)
    cfg = RaySection(
        address=args.address,
        replicas=args.replicas,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        strategy=args.strategy,
    )
    import ray

    t0 = time.perf_counter()
    try:
        owns = connect(cfg.address)
    except RuntimeError as e:
        raise SystemExit(f"ray_pool: {e}") from None
    try:
        _, nodes = plan_placement(cfg)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    except RuntimeError as e:
        raise SystemExit(f"ray_pool: {e}") from None
    finally:
        disconnect(owns)
    for i, node in enumerate(nodes):
        print(f"replica {i}: {bundle_of(cfg)} on node {ips.get(node, '?')} ({node[:12]})")
    print(
        json.dumps(
            {
                "replicas": cfg.replicas,
                "bundle": bundle_of(cfg),
                "strategy": cfg.strategy,
                "nodes": nodes,
                "planned_s": round(time.perf_counter() - t0, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
