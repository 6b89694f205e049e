"""Rollout replicas and tool servers on a Ray cluster of two nodes (``ray.cluster_utils.Cluster``:
two raylets on this machine, each a node of its own): the replicas spread over both, a replica
killed while it serves has its requests run again elsewhere and counted, it comes back with the
newest weights, a training step completes through such a death, and ``launch/gpu.sh --ray``
asks the cluster where its engines would go; tool servers route by trajectory, and an episode
whose server died is run again, token for token, while the server restarts. (The pool as a
backend: the conformance suite, "ray".)"""

import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.cli.demo import demo_config, prepare
from jax_agent_rl.cluster.ray import connect
from jax_agent_rl.config import EngineSection, RaySection, ToolsSection
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.models import DecoderPolicy, ModelConfig, Weights, load_hf
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rewards import Answer
from jax_agent_rl.rollout import (
    EmbeddedBackend,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    ray_pool,
)
from jax_agent_rl.rollout.delta import DeltaPusher, WeightDelta, push_bytes
from jax_agent_rl.rollout.ray_pool import RayPool, Replica, _check_fits
from jax_agent_rl.rollout.registry import BackendBuild
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.ray_servers import RayToolServers
from jax_agent_rl.tools.registry import ToolTransportError
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics
from jax_agent_rl.train.rollout_score import rollout_episodes
from tests.agent.test_loop import CONFIG
from tests.weights import sparse_step

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

ROOT = Path(__file__).resolve().parents[2]
NODE = {"num_cpus": 2, "num_gpus": 2, "object_store_memory": 100 * 2**20}  # GPUs: declared only
DEADLINE_S = 600  # for states that must come (a replica restarting compiles its engine)


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(NODE))
    c.add_node(**NODE)
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def test_an_unreachable_head_is_named_at_once() -> None:
    """(Ray would retry it for minutes; `launch/gpu.sh --ray ... --dry-run` fails at once.)"""
    if ray.is_initialized():  # a connection an earlier module's test left in this process
        ray.shutdown()
    with pytest.raises(RuntimeError, match=r"'127.0.0.1:1': no Ray head answers there"):
        connect("127.0.0.1:1")
    out = _gpu_sh("--gpus", "2", "--ray", "127.0.0.1:1", "--replicas", "2", "--dry-run", "c.yaml")
    assert out.returncode == 2 and "no Ray head answers there" in out.stderr


def _spread(address: str, **overrides: object) -> RaySection:
    return RaySection(address=address, replicas=2, strategy="STRICT_SPREAD", **overrides)


def _requests(tag: str, n: int = 8) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            f"{tag}{i}",
            tuple(range(3, 6 + i)),
            SamplingParams(max_tokens=48, temperature=1.0, seed=i),
            session_id=f"s{i}",
        )
        for i in range(n)
    ]


async def _until(condition: object, what: str) -> None:
    async def poll() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), DEADLINE_S)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


def _kill(actor: object) -> None:
    """Kills ``actor`` and returns once it is dead (``ray.kill`` only asks)."""
    ray.kill(actor)
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=DEADLINE_S)  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return


def _kill_server(server: object) -> None:
    """Kills a tool server's actor and returns once its port refuses connections: Ray marks a
    killed actor dead before its process has exited, and until then the server still answers."""
    _kill(server.actor)  # type: ignore[attr-defined]
    host, port = server.client.url.removeprefix("http://").rsplit(":", 1)  # type: ignore[attr-defined]
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=DEADLINE_S).close()
        except OSError:
            return
        time.sleep(0.01)


def _dying_replica(name: str, on_request: int) -> type:
    """A `Replica` whose actor ``name`` (``jarl-replica-{slot}.{generation}``) ends its process
    when its ``on_request``-th request arrives: it dies with that request (and any before it
    that are unfinished) in flight, whatever the machine's speed. A restarted replica has
    another name and lives. (Defined here, so Ray sends the class itself to the workers.)"""

    class DyingReplica(Replica):
        arrived = 0

        async def generate(self, request: GenerateRequest) -> GenerateResult:
            self.arrived += 1
            if self.arrived == on_request and ray.get_runtime_context().get_actor_name() == name:
                os._exit(1)
            return await super().generate(request)

    return DyingReplica


def _tiny_pool(cluster: object, tmp_path: Path) -> tuple[RayPool, ModelConfig, Weights]:
    """Two replicas of the tiny model, one on each node, and the model they serve."""
    path = write_hf_checkpoint(tmp_path / "tiny", TINY_QWEN2)
    cfg, weights = load_hf(path, sharder=one_device_sharder())
    engine = EngineSection(
        max_concurrent=4,
        max_model_len=128,
        ray=_spread(cluster.address),  # type: ignore[attr-defined]
        warmup=False,
    )
    build = BackendBuild(
        engine,
        DecoderPolicy(cfg),
        weights,
        checkpoint=path,
        dtype="float32",
        sharder=one_device_sharder(),
    )
    return RayPool(build), cfg, weights


def test_a_killed_replica_has_its_requests_rerun_and_comes_back_with_new_weights(
    cluster: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replica 1 serves 4 of each batch of 8 (below): it dies as its second batch comes
    monkeypatch.setattr(ray_pool, "Replica", _dying_replica("jarl-replica-1.0", on_request=6))
    pool, _, weights = _tiny_pool(cluster, tmp_path)

    async def scenario() -> None:
        assert len(set(pool.nodes)) == 2  # one replica on each node
        before = await asyncio.gather(*(pool.generate(r) for r in _requests("a")))
        assert sorted(pool._sessions.values()) == [0] * 4 + [1] * 4  # least in flight: even

        # the same seeded requests again; replica 1 dies while it is serving some
        after = await asyncio.gather(
            *(pool.generate(dataclasses.replace(r, request_id=f"b{i}"))
              for i, r in enumerate(_requests("a")))
        )  # fmt: skip
        counted = pool.counters()
        assert counted["rollout/replica_deaths"] == 1
        assert counted["rollout/requests_requeued"] >= 1
        # each result says how often it was sent again (marked in its trajectory's trace)
        assert sum(r.resent for r in after) == counted["rollout/requests_requeued"]
        # nothing lost: every request finished, with the tokens it samples anywhere
        assert [r.token_ids for r in after] == [r.token_ids for r in before]
        assert all(r.finish_reason == "length" for r in after)

        # new weights while replica 1 restarts: it comes back serving them
        new = jax.tree.map(lambda x: x * 1.5, weights)
        await pool.update_weights(new, 1)
        await _until(lambda: pool.counters()["rollout/replica_restarts"] == 1, "a restart")
        assert len(set(pool.live_nodes())) == 2
        # (the killed replica's sessions stuck to replica 0, which served their last turns:
        # new sessions spread over both)
        fresh = [dataclasses.replace(r, session_id=f"new{i}") for i, r in enumerate(_requests("c"))]
        results = await asyncio.gather(*(pool.generate(r) for r in fresh))
        assert {r.weight_version for r in results} == {1}
        served = sorted(pool._sessions[f"new{i}"] for i in range(8))
        assert served == [0] * 4 + [1] * 4
        assert [r.token_ids for r in results] != [r.token_ids for r in before]
        await pool.close()

    asyncio.run(scenario())


def _served_digest(replica: object) -> str:
    """A digest of the bits of every weight ``replica``'s embedded engine serves."""

    def digest(actor: Replica) -> str:
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(actor.backend._params):  # type: ignore[attr-defined]
            h.update(np.asarray(jax.device_get(leaf)).tobytes())
        return h.hexdigest()

    return ray.get(replica.__ray_call__.remote(digest), timeout=DEADLINE_S)  # type: ignore[attr-defined]


def test_delta_pushes_reach_every_replica_and_a_restarted_one_serves_the_same_bits(
    cluster: object, tmp_path: Path
) -> None:
    """A whole push, then 3 deltas (`DeltaPusher`), each crossing to the replicas as a delta
    (its bytes a fraction of the weights'). Replica 1 is killed: it restarts from the last
    whole weights and applies the 3 deltas in order, and then serves bit for bit the weights
    replica 0 serves, which are those a whole push of the last weights gives."""
    pool, cfg, weights = _tiny_pool(cluster, tmp_path)
    steps = [weights]
    for seed in range(4):
        steps.append(sparse_step(steps[-1], seed))
    pusher = DeltaPusher(cfg, full_every=10)

    async def scenario() -> None:
        assert pool.capabilities.delta_push
        for version, step in enumerate(steps[1:], start=1):
            await pusher.push(pool, step, version)
        assert isinstance(pusher.last, WeightDelta) and pusher.last.base == 3
        assert pool.last_push is not None
        assert pool.last_push.bytes == push_bytes(pusher.last) < push_bytes(weights) / 3
        await asyncio.to_thread(_kill, pool._slots[1].actor)
        # requests find it dead (run again on replica 0), and it restarts
        await asyncio.gather(*(pool.generate(r) for r in _requests("k")))
        await _until(lambda: pool.counters()["rollout/replica_restarts"] == 1, "a restart")
        actors = [slot.actor for slot in pool._slots]
        digests = [await asyncio.to_thread(_served_digest, a) for a in actors]
        assert digests[0] == digests[1]
        # no session: replica 0 keeps s0's pages, and a prompt served from them computes one
        # row where the fresh replica computes three (rows round the matmuls differently)
        request = dataclasses.replace(_requests("same", 1)[0], session_id=None)
        served = [await a.generate.remote(request) for a in actors]
        assert served[0] == served[1] and served[0].weight_version == 4
        await pusher.push(pool, steps[-1], 5)  # (compared against its own last delta: whole)
        await pool.update_weights(steps[-1], 6)
        assert await asyncio.to_thread(_served_digest, actors[0]) == digests[0]
        await pool.close()

    asyncio.run(scenario())


def test_a_training_step_completes_when_a_replica_dies_mid_rollout(
    cluster: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole run (2 steps, 2 replicas over the 2 nodes); while the first step rolls out, a
    replica dies (replica 0 takes the run's first request, and dies with it in flight). Each
    step still trains on every trajectory of its prompts, none cut short, and the metrics
    count the death and the requests run again."""
    task = prepare(tmp_path / "task", ArithmeticTask(), n_train=40, n_val=4, n_sft=60)
    ray_keys = [f"engine.ray.{k}={v}" for k, v in (
        ("address", cluster.address), ("replicas", 2), ("strategy", "STRICT_SPREAD"),  # type: ignore[attr-defined]
    )]  # fmt: skip
    cfg = demo_config(
        tmp_path / "run",
        task,
        [
            *ray_keys,
            "sft.steps=0",
            "data.val=",
            "data.prompts_per_step=2",
            "group.n=4",
            "engine.max_model_len=128",
            "engine.warmup=false",
            "engine.max_concurrent=8",
            "agent.max_response_tokens=64",
            "learner.micro_batch_size=8",
            "trainer.steps=2",
            "trainer.tensorboard=false",
        ],
    )
    monkeypatch.setattr(ray_pool, "Replica", _dying_replica("jarl-replica-0.0", on_request=1))
    run_dir = train(cfg)
    steps = read_metrics(run_dir / "metrics.jsonl", "train")
    assert len(steps) == 2
    assert steps[0]["rollout/replica_deaths"] == 1 and steps[1]["rollout/replica_deaths"] == 0
    assert steps[0]["rollout/requests_requeued"] >= 1
    for m in steps:
        assert m["batch/trajectories"] == 8  # 2 prompts x 4 samples: none lost
        assert m["stop/aborted"] == m["stop/agent_error"] == m["untrainable"] == 0.0


def test_an_impossible_placement_names_what_is_missing() -> None:
    nodes = [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 1.0}]
    gpu = RaySection(replicas=3, num_gpus=1.0)
    _check_fits(gpu, {"CPU": 1.0, "GPU": 1.0}, nodes)  # 2 + 1 GPUs: fits
    with pytest.raises(RuntimeError, match=r"4 replicas .* room for 3 on 2 live nodes"):
        _check_fits(dataclasses.replace(gpu, replicas=4), {"CPU": 1.0, "GPU": 1.0}, nodes)
    spread = dataclasses.replace(gpu, strategy="STRICT_SPREAD")
    with pytest.raises(RuntimeError, match="nodes with room for one 2"):
        _check_fits(spread, {"CPU": 1.0, "GPU": 1.0}, nodes)
    with pytest.raises(RuntimeError, match="room for 2"):
        _check_fits(dataclasses.replace(gpu, strategy="STRICT_PACK"), {"GPU": 1.0}, nodes)


def _gpu_sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu.sh"), *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=DEADLINE_S,
    )


def test_gpu_sh_asks_the_cluster_where_its_engines_go(cluster: object) -> None:
    """Two nodes of 2 GPUs each: 4 one-GPU engines go 2 and 2; a fifth does not fit, and the
    launcher says so before anything starts."""
    address = cluster.address  # type: ignore[attr-defined]
    out = _gpu_sh("--gpus", "2", "--ray", address, "--replicas", "4", "--dry-run", "cfg.yaml")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.splitlines()[-2])
    assert plan["bundle"] == {"CPU": 1.0, "GPU": 1.0} and plan["strategy"] == "SPREAD"
    assert sorted(plan["nodes"].count(n) for n in set(plan["nodes"])) == [2, 2]
    run = out.stdout.splitlines()[-1]
    for arg in (f"engine.ray.address={address}", "engine.ray.replicas=4",
                "engine.ray.num_gpus=1", "engine.backend=vllm", "CUDA_VISIBLE_DEVICES=0,1",
                "mesh.data=2"):  # fmt: skip
        assert arg in run, (arg, run)
    assert "engine.vllm.devices" not in run
    too_many = _gpu_sh("--gpus", "2", "--ray", address, "--replicas", "5", "--dry-run", "c.yaml")
    assert too_many.returncode == 2
    assert "5 replicas of {'CPU': 1.0, 'GPU': 1.0} (SPREAD) do not fit" in too_many.stderr


CALCULATOR_YAML = "- class: jax_agent_rl.tools.calculator:calculator\n"


def _tool_servers(address: str, folder: Path) -> RayToolServers:
    (folder / "tools.yaml").write_text(CALCULATOR_YAML)
    tools = ToolsSection(config=str(folder / "tools.yaml"), timeout_s=30.0)
    return RayToolServers(tools, RaySection(address=address, tool_servers=2))


def test_tool_servers_keep_a_trajectory_on_one_server_and_restart(
    cluster: object, tmp_path: Path
) -> None:
    servers = _tool_servers(cluster.address, tmp_path)  # type: ignore[attr-defined]

    async def scenario() -> None:
        assert len(set(servers.urls())) == 2  # two servers, each on its own port
        assert [s["function"]["name"] for s in await servers.schemas()] == ["calculator"]
        first = await asyncio.gather(
            *(servers.call(f"t{i}", "calculator", {"expression": f"{i} * 7"}) for i in range(4))
        )
        assert [r.text for r in first] == ["0", "7", "14", "21"]
        on = {t: s.index for t, s in servers._where.items()}
        assert sorted(on.values()) == [0, 0, 1, 1]  # new trajectories: the emptier server

        dead = next(s for s in servers._servers if s.index == on["t1"])
        _kill_server(dead)
        with pytest.raises(ToolTransportError):  # its state died with the server
            await servers.call("t1", "calculator", {"expression": "1 + 1"})
        assert servers.counters()["rollout/tool_server_deaths"] == 1
        with pytest.raises(ToolTransportError, match="died, and its tool state with it"):
            await servers.call("t1", "calculator", {"expression": "1 + 1"})
        alive = next(t for t, i in on.items() if i != dead.index)
        assert (await servers.call(alive, "calculator", {"expression": "2 + 3"})).text == "5"

        await _until(lambda: servers.counters()["rollout/tool_server_restarts"] == 1, "restart")
        await servers.release("t1")  # the episode is over; run again, it starts afresh
        assert (await servers.call("t1", "calculator", {"expression": "6 * 7"})).text == "42"
        await servers.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_an_episode_whose_tool_server_died_is_run_again_token_for_token(
    cluster: object, setup: dict, tmp_path: Path
) -> None:
    """The first server (where a new trajectory goes when both are empty) dies before the
    episode's calculator call reaches it: the episode ends with a transport failure, is run
    again from its prompt on the other server, and comes out as the memorised episode."""
    servers = _tool_servers(cluster.address, tmp_path)  # type: ignore[attr-defined]
    question = "What is 17 + 25?"

    async def _zero(_answer: Answer) -> float:
        return 0.0

    _kill_server(servers._servers[0])

    async def go() -> list:
        backend = EmbeddedBackend(setup["engine"], setup["weights"])
        ctx = await AgentContext.create(  # schemas of the memorised tools, calls to the servers
            backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), CONFIG
        )
        ctx = dataclasses.replace(ctx, tools=servers)
        sample = Sample(uid="q", messages=[{"role": "user", "content": question}])
        trajs = await rollout_episodes(
            [sample], 1, ctx, "t", seed=0, score=_zero, tool_reward_weight=0.0,
            success_reward=1.0, tool_failure_reruns=1,
        )  # fmt: skip
        await backend.close()
        await servers.close()
        return trajs

    (episode,) = asyncio.run(go())
    assert episode.reruns == 1 and episode.stop_reason == "eos" and episode.trainable
    traj = episode.traj
    assert traj.tool_calls >= 1 and traj.tool_errors == 0
    assert traj.prompt_ids + traj.response_ids == setup["expected"][question][0]
    assert servers.counters()["rollout/tool_server_deaths"] == 1
