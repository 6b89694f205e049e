"""Tool servers as Ray actors: `RayToolServers`, one `ToolExecutor` in front of several.

With ``engine.ray.tool_servers`` > 0, each tool server is a Ray actor (`ToolServer`) running
the app of ``jarl serve-tools`` over ``tools.config`` on its node's address, at a free port,
behind a bearer token the run makes up (a non-loopback server never runs without one; it is
compared in constant time, and nothing but ``/health`` answers without it). Each server's
client (`HttpTools`) keeps its calls in a namespace of its own. The actors are spread over
the nodes. The executor routes: all calls of one trajectory go to one
server (its tool state lives there), a new trajectory to the server holding the fewest.

A server that dies takes its trajectories' tool state with it, so their next call fails
(`ToolTransportError`: the trajectory ends with stop reason ``tool_error``) and the rollout
runs those trajectories again from their prompts
(`jax_agent_rl.train.rollout_score.rollout_episodes`, counted in
``rollout/trajectories_rerun``). The server is restarted (a new actor, a new port)
up to ``engine.ray.max_restarts`` times; new trajectories go to the live ones meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jax_agent_rl.cluster.ray import connect
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import ToolTransportError

if TYPE_CHECKING:
    from jax_agent_rl.config import RaySection, ToolsSection

PING_TIMEOUT_S = 30.0  # a server that does not answer a ping within this is taken for dead


class ToolServer:
    """``jarl serve-tools`` in a Ray actor (``ray.remote(ToolServer)``)."""

    def __init__(self, tools_config: str, token: str, timeout_s: float) -> None:
        from jax_agent_rl.tools.registry import ToolRegistry

        self.registry = ToolRegistry.from_yaml(tools_config)
        self.token, self.timeout_s = token, timeout_s
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Serves on this node's address at a free port; returns the server's URL."""
        import ray
        import uvicorn

        from jax_agent_rl.tools.app import create_app
        from jax_agent_rl.tools.server import server_config

        host = ray.util.get_node_ip_address()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        app = create_app(self.registry, timeout_s=self.timeout_s, token=self.token)
        self._server = uvicorn.Server(server_config(app, host, sock.getsockname()[1]))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # until it listens (or failed to)
            if self._task.done():
                self._task.result()
                raise RuntimeError("the tool server stopped while starting")
            await asyncio.sleep(0.01)
        return f"http://{host}:{sock.getsockname()[1]}"

    def ping(self) -> bool:
        return True

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


@dataclasses.dataclass
class _Server:
    index: int
    actor: Any = None
    client: HttpTools | None = None  # None while it restarts (for good once restarts are spent)
    trajectories: set[str] = dataclasses.field(default_factory=set)
    restarts: int = 0


class RayToolServers:
    """`ToolExecutor` over tool-server actors (see the module docstring)."""

    def __init__(self, tools: ToolsSection, ray_cfg: RaySection) -> None:
        import ray

        self._ray = ray
        self._tools, self._cfg = tools, ray_cfg
        self._token = secrets.token_urlsafe(32)
        connect(ray_cfg.address)
        self._servers = [_Server(i) for i in range(ray_cfg.tool_servers)]
        self._where: dict[str, _Server] = {}
        self._orphans: set[str] = set()  # trajectories whose server died: their state is gone
        self._tasks: set[asyncio.Task[None]] = set()
        self._counts = {"tool_server_deaths": 0, "tool_server_restarts": 0}
        actors = [self._actor() for _ in self._servers]
        try:
            urls = ray.get([a.start.remote() for a in actors], timeout=ray_cfg.start_timeout_s)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        for server, actor, url in zip(self._servers, actors, urls, strict=True):
            server.actor, server.client = actor, self._client(url)

    def _actor(self) -> Any:
        options = {"num_cpus": self._cfg.tool_server_cpus, "scheduling_strategy": "SPREAD"}
        cls = self._ray.remote(ToolServer).options(**options)
        return cls.remote(self._tools.config, self._token, self._tools.timeout_s)

    def _client(self, url: str) -> HttpTools:
        return HttpTools(url, token=self._token, timeout_s=self._tools.timeout_s)

    def counters(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in self._counts.items()}

    def urls(self) -> list[str]:
        return [s.client.url for s in self._servers if s.client is not None]

    def _route(self, trajectory_id: str) -> _Server:
        server = self._where.get(trajectory_id)
        if server is not None:
            return server
        live = [s for s in self._servers if s.client is not None]
        if not live:
            raise ToolTransportError("no tool server is up (every one died; restarting)")
        server = min(live, key=lambda s: (len(s.trajectories), s.index))
        server.trajectories.add(trajectory_id)
        self._where[trajectory_id] = server
        return server

    async def schemas(self) -> list[dict[str, Any]]:
        live = [s.client for s in self._servers if s.client is not None]
        if not live:
            raise ToolTransportError("no tool server is up")
        return await live[0].schemas()

    async def call(
        self,
        trajectory_id: str,
        name: str,
        arguments: Any,
        create_kwargs: Mapping[str, Any] | None = None,
    ) -> ToolResult:
        if trajectory_id in self._orphans:
            raise ToolTransportError(
                f"the tool server of trajectory {trajectory_id} died, and its tool state with it"
            )
        server = self._route(trajectory_id)
        client = server.client
        assert client is not None  # `_route` gives live servers; a dead one's are orphans
        try:
            return await client.call(trajectory_id, name, arguments, create_kwargs)
        except ToolTransportError:
            await self._check(server, client)
            raise

    async def _check(self, server: _Server, client: HttpTools) -> None:
        """After a failed call: if ``server``'s actor is dead (and not handled already),
        count it and restart it."""
        if server.client is not client:
            return
        try:
            await asyncio.wait_for(server.actor.ping.remote(), PING_TIMEOUT_S)
            return  # alive: the failure was the call's own
        except (self._ray.exceptions.RayActorError, TimeoutError):
            pass
        if server.client is not client:
            return
        self._counts["tool_server_deaths"] += 1
        server.client = None
        self._orphans |= server.trajectories  # their state died with it: their calls now fail
        for tid in server.trajectories:
            del self._where[tid]
        server.trajectories = set()
        task = asyncio.get_running_loop().create_task(self._restart(server, client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, server: _Server, old: HttpTools) -> None:
        with contextlib.suppress(Exception):
            await old.close()
        with contextlib.suppress(Exception):
            self._ray.kill(server.actor)
        while server.restarts < self._cfg.max_restarts:
            server.restarts += 1
            server.actor = self._actor()
            try:
                url = await server.actor.start.remote()
            except self._ray.exceptions.RayError:
                self._counts["tool_server_deaths"] += 1
                continue
            server.client = self._client(url)
            self._counts["tool_server_restarts"] += 1
            return

    async def release(self, trajectory_id: str) -> None:
        self._orphans.discard(trajectory_id)
        server = self._where.pop(trajectory_id, None)
        if server is None:
            return
        server.trajectories.discard(trajectory_id)
        if server.client is not None:
            with contextlib.suppress(ToolTransportError):  # a dead server holds nothing
                await server.client.release(trajectory_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            if server.client is not None:
                await server.client.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.actor.stop.remote(), PING_TIMEOUT_S)
            if server.actor is not None:
                self._ray.kill(server.actor)
