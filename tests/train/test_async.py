"""Asynchronous training (``trainer.max_staleness`` >= 1): its admission and freshness rules
on their own, and whole runs: every update's trajectories are within the bound, by their
tokens' versions. (That it still learns: tests/train/test_learning.py.)"""

import asyncio
import json
from pathlib import Path

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import TaskFiles, demo_config, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.rollout import (
    BackendBuild,
    BackendFactory,
    GenerateRequest,
    GenerateResult,
    RolloutBackend,
    register_backend,
)
from jax_agent_rl.rollout.registry import backend_factory
from jax_agent_rl.train import train
from jax_agent_rl.train.producer import Admission, Finished, Grant, Group, take_groups
from jax_agent_rl.train.traces import read_traces


def _traj(uid: str, versions: list[int], reward: float = 0.0) -> Episode:
    t = Trajectory(uid=uid, group_id=uid.split("/", maxsplit=1)[0], prompt_ids=[1, 2])
    for v in versions:  # a sampled turn, then a tool result
        t.append([3, 4], model=True, logprobs=[-0.5, -0.5], version=v)
        t.append([5], model=False)
    return Episode(t, reward=reward)


def test_admission_holds_groups_to_the_staleness_bound() -> None:
    async def scenario() -> list[int]:
        admission = Admission(version=3, max_staleness=1, per_update=2)
        allowed = [admission.allowed]  # (3 + 1 + 1) * 2
        # the groups of the updates of versions 3 and 4, two prompts each
        assert [await admission.next_grant() for _ in range(2)] == [Grant(2, 3), Grant(2, 4)]
        waiter = asyncio.create_task(admission.next_grant())
        await asyncio.sleep(0)
        assert not waiter.done()
        await admission.replace(1, 3, 1)  # a dropped group is replaced: 11 may start
        assert (await asyncio.wait_for(waiter, timeout=60)).tag == "s3a1"
        allowed.append(admission.allowed)
        await admission.advance(4)
        allowed.append(admission.allowed)
        return allowed

    assert asyncio.run(scenario()) == [10, 11, 13]


def test_an_update_takes_only_fresh_groups_and_replaces_the_rest() -> None:
    """Policy at version 5, max_staleness 2: a group whose oldest token is from version 2 is
    dropped (even if later turns are fresh), one from 3 is taken; so is a group with no sampled
    token (its episodes failed before sampling). Taken groups come back in prompt order."""

    async def scenario() -> tuple[list[int], list[int], list[int], int]:
        finished = Finished(first_index=6, in_order=False)
        admission = Admission(version=5, max_staleness=2, per_update=2)
        before = admission.allowed
        for group in [
            Group(7, [_traj("a/0", [2, 5]), _traj("a/1", [5])]),  # too old: 5 - 2 > 2
            Group(9, [_traj("b/0", [3, 4]), _traj("b/1", [5])]),
            Group(8, [_traj("c/0", [])]),  # nothing sampled
            Group(6, [_traj("d/0", [4])]),  # not needed: left for the next update
        ]:
            await finished.put(group)
        taken = await take_groups(
            finished, admission, 2, 5, 2, dynamic_sampling=False, max_refills=0
        )
        return (
            [g.index for g in taken.groups],
            [g.index for g in taken.stale],
            [e.traj.oldest_version or -1 for g in taken.groups for e in g.episodes],
            admission.allowed - before,
        )

    taken, stale, oldest, replaced = asyncio.run(scenario())
    assert taken == [8, 9] and stale == [7] and replaced == 1
    assert all(v == -1 or 5 - v <= 2 for v in oldest)


def test_dynamic_sampling_drops_groups_without_signal() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        finished = Finished(first_index=0, in_order=False)
        admission = Admission(version=0, max_staleness=0, per_update=1)
        await finished.put(Group(0, [_traj("a/0", [0], 1.0), _traj("a/1", [0], 1.0)]))
        await finished.put(Group(1, [_traj("b/0", [0], 1.0), _traj("b/1", [0], 0.0)]))
        taken = await take_groups(
            finished, admission, 1, 0, 0, dynamic_sampling=True, max_refills=1
        )
        return [g.index for g in taken.groups], [g.index for g in taken.no_signal]

    assert asyncio.run(scenario()) == ([1], [0])


def test_refills_for_a_signal_stop_after_max_refills() -> None:
    """Dynamic sampling with every group's rewards equal: the update asks for a fresh group
    ``max_refills`` times (tagged as the synchronous loop's attempts), then takes what it has
    instead of sampling for ever."""

    async def scenario() -> tuple[list[int], list[int], list[str]]:
        finished = Finished(first_index=0, in_order=False)
        admission = Admission(version=0, max_staleness=0, per_update=1)
        for i in range(4):
            await finished.put(Group(i, [_traj(f"{i}/0", [0], 1.0), _traj(f"{i}/1", [0], 1.0)]))
        taken = await take_groups(
            finished, admission, 1, 0, 0, dynamic_sampling=True, max_refills=2
        )
        grants = [await admission.next_grant() for _ in range(3)]
        return (
            [g.index for g in taken.groups],
            [g.index for g in taken.no_signal],
            [g.tag for g in grants],
        )

    taken, dropped, tags = asyncio.run(scenario())
    assert taken == [] and dropped == [0, 1, 2]
    assert tags == ["s0a0", "s0a1", "s0a2"]


def test_a_failed_group_fails_the_update() -> None:
    async def scenario() -> None:
        finished = Finished(first_index=0, in_order=False)
        await finished.put(RuntimeError("the reward function is broken"))
        await take_groups(
            finished, Admission(0, 0, 1), 1, 0, 0, dynamic_sampling=False, max_refills=0
        )

    with pytest.raises(RuntimeError, match="reward function is broken"):
        asyncio.run(scenario())


def test_pinned_groups_come_in_prompt_order_and_are_counted() -> None:
    """In order, a group that finished early waits for the ones before it; `wait_count`
    returns once that many groups have finished (what a pinned push waits for)."""

    async def scenario() -> list[int]:
        finished = Finished(first_index=4, in_order=True)
        await finished.put(Group(5, [_traj("b/0", [0])]))
        first = asyncio.create_task(finished.next())
        counted = asyncio.create_task(finished.wait_count(2))
        await asyncio.sleep(0)
        assert not first.done() and not counted.done()  # group 4 is not finished yet
        await finished.put(Group(4, [_traj("a/0", [0])]))
        await asyncio.wait_for(counted, timeout=60)
        return [(await first).index, (await finished.next()).index]

    assert asyncio.run(scenario()) == [4, 5]


# ------------------------------------------------------------------ whole runs

TINY = [
    "sft.steps=2",
    "sft.batch_size=8",
    "data.prompts_per_step=2",
    "data.val=",
    "group.n=4",
    "engine.max_model_len=128",
    "engine.max_concurrent=8",
    "engine.warmup=false",
    "agent.max_response_tokens=64",
    # a length penalty gives every group a reward signal, so each update moves the policy
    "data.overlong_buffer=48",
    "learner.micro_batch_size=8",
    "trainer.tensorboard=false",
    "trainer.traces_per_step=8",
]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=40, n_val=4, n_sft=60)


def _run(task: TaskFiles, run_dir: Path, *overrides: str) -> list[dict[str, float]]:
    train(demo_config(run_dir, task, [*TINY, *overrides]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["phase"] == "train"]


def test_dynamic_sampling_without_a_signal_anywhere_still_ends_each_update(
    task: TaskFiles, tmp_path: Path
) -> None:
    """A reward that is the same for every episode, under dynamic sampling: no group ever has a
    signal. Each async update asks for fresh groups group.max_refills times and then trains
    on none, as a synchronous step does (an async update used to sample for ever)."""
    flat = tmp_path / "flat.py"
    flat.write_text("def flat(text, ground_truth):\n    return 0.0\n")
    steps = _run(
        task,
        tmp_path / "run",
        "trainer.steps=2",
        "trainer.max_staleness=1",
        "group.dynamic_sampling=true",
        "group.max_refills=1",
        f"data.reward={flat}:flat",
    )
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["batch/trajectories"] == 0
        # the update's 2 groups, then one refill of 2: all dropped
        assert m["async/groups_no_signal"] == 4 and m["episodes_sampled"] == 16


@pytest.mark.parametrize("keep_kv", [False, True])
def test_async_updates_stay_within_max_staleness(
    task: TaskFiles, tmp_path: Path, keep_kv: bool
) -> None:
    """Every trained token, and (engine.keep_kv_on_update) every key and value it was
    sampled over, comes from a policy at most max_staleness versions behind."""
    run_dir = tmp_path / "async2"
    keep = f"engine.keep_kv_on_update={str(keep_kv).lower()}"
    steps = _run(task, run_dir, "trainer.steps=5", "trainer.max_staleness=2", keep)
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert any(m["staleness/max"] > 0 for m in steps)  # it did run ahead of the learner
    for m in steps:
        assert m["staleness/max"] <= 2
        assert m["batch/trajectories"] == 8  # whole groups: 2 prompts x 4
    # from the tokens themselves: every trajectory traced at update k (policy version k - 1)
    # was sampled at versions k - 3 .. k - 1
    for k in range(1, 6):
        for record in read_traces(run_dir / "traces.jsonl", k):
            versions = record["weight_versions"]
            assert versions and all(k - 1 - 2 <= v <= k - 1 for v in versions), (k, versions)
            pairs = [
                (v, kv)
                for v, kv in zip(record["token_versions"], record["kv_versions"], strict=True)
                if v >= 0
            ]
            assert all(k - 1 - 2 <= kv <= v for v, kv in pairs), (k, pairs)
            if not keep_kv:
                assert all(kv == v for v, kv in pairs)
    assert all(m["staleness/kv_older_tokens"] == 0 for m in steps) or keep_kv


class Stragglers:
    """The embedded engine, with the first episode of every group made a straggler: each of
    its turns, once sampled, is returned only when no other request is in flight (an event
    the last of them sets), so its group finishes after the groups sampled beside it."""

    def __init__(self, inner: RolloutBackend) -> None:
        self.inner, self.capabilities = inner, inner.capabilities
        self.held_back = 0  # turns that did wait for others
        self._others = 0
        self._no_others = asyncio.Event()
        self._no_others.set()

    def counters(self) -> dict[str, float]:
        return dict(self.inner.counters())

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        held = request.request_id.split("/")[-2] == "0"  # "<prompt>/<tag>/<episode>/<turn>"
        if not held:
            self._others += 1
            self._no_others.clear()
        try:
            result = await self.inner.generate(request)
        finally:
            if not held:
                self._others -= 1
                if self._others == 0:
                    self._no_others.set()
        if held and not self._no_others.is_set():
            self.held_back += 1
            await self._no_others.wait()
        return result

    async def update_weights(self, params: object, version: int) -> None:
        await self.inner.update_weights(params, version)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()


STARTED: list[Stragglers] = []


def _stragglers(spec: BackendBuild) -> RolloutBackend:
    STARTED.append(Stragglers(backend_factory("embedded").build(spec)))
    return STARTED[-1]


register_backend("embedded_stragglers", BackendFactory(_stragglers))


def _uid(record: dict) -> str:
    return record["uid"]


def test_a_pinned_schedule_is_the_same_whatever_the_timing(task: TaskFiles, tmp_path: Path) -> None:
    """trainer.async_schedule=pinned at max_staleness 1, once as the machine runs it and once
    with every group's first episode held back to the end of what is in flight: the same
    trajectories in every update, each token sampled by the same weight version (update k
    trains on groups sampled by version max(k - 1, 0), never partially), the same tokens, and
    the same updates."""
    same = [
        "trainer.steps=4",
        "trainer.max_staleness=1",
        "trainer.async_schedule=pinned",
        "engine.batch_buckets=false",  # numbers that do not depend on who shared a batch
    ]
    runs = {}
    for name, backend in (("plain", "embedded"), ("stragglers", "embedded_stragglers")):
        steps = _run(task, tmp_path / name, *same, f"engine.backend={backend}")
        traces = [
            [
                (r["uid"], r["token_versions"], r["response_ids"], r["reward"])
                for r in sorted(read_traces(tmp_path / name / "traces.jsonl", k), key=_uid)
            ]
            for k in range(1, 5)
        ]
        runs[name] = (traces, [(m["grad_norm"], m["pg_loss"]) for m in steps])
    assert STARTED[-1].held_back > 0  # the timing did change
    (plain, plain_updates), (held, held_updates) = runs["plain"], runs["stragglers"]
    for k, update in enumerate(plain):
        assert len(update) == 8  # 2 groups of 4, all traced
        versions = {v for _, token_versions, _, _ in update for v in token_versions}
        assert versions == {max(k - 1, 0)}, (k, versions)
    assert held == plain
    assert held_updates == plain_updates
