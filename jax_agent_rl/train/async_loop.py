"""Asynchronous off-policy training with bounded staleness (``trainer.mode=async``).

Rollouts never wait for the learner: groups (one prompt, ``group.n`` episodes) run on the
backend continuously, and each update takes ``data.prompts_per_step`` finished groups as they
come, while the next ones are sampled. Three rules keep the off-policy gap bounded:

- **Admission.** Group ``i`` (in prompt order) may start once ``i`` is below
  ``(version + max_staleness + 1) * prompts_per_step`` plus the groups dropped so far: at most
  ``max_staleness + 1`` updates' worth of groups is ever sampled ahead of the policy.
- **Partial rollouts.** A weight push lands between turns: the turn in flight finishes under
  the weights it started with, the trajectory's next turns use the new ones, and every token
  records the version that sampled it (`Trajectory.token_versions`). With
  ``engine.keep_kv_on_update`` the push lands mid-turn instead: the turn goes on under the new
  weights over the old ones' keys and values, and so do the next turns (no prefill again);
  each token also records the oldest version of its KV (`Trajectory.kv_versions`), which the
  freshness rule and the staleness metrics count as its age.
- **Freshness.** An update of the policy at version ``v`` trains only on groups whose oldest
  token (or KV) was sampled at ``v - max_staleness`` or later; a group that fell further behind
  (a long tail of tool calls) is dropped, counted (``async/groups_stale``) and replaced by a
  new one. TIS (``algorithm.tis_cap``) corrects the rest with the rollout logprobs.

That is ``trainer.async_schedule=as_finished``: which groups an update gets, and where a push
lands in a trajectory, follow the machine's timing (the engine's, the learner's and the
tools' speeds), so two runs of one config differ, the more so on a loaded machine. With
``pinned`` the schedule follows versions and events only: updates take groups in prompt
order, and a push waits until every group started under the weights it replaces is done, so
each group is sampled whole under the weights served when it was admitted (update ``k``
trains on groups sampled by version ``max(k - max_staleness, first)``; nothing is ever
stale). The versions and batches are then the same whatever the load, but no push lands
mid-trajectory: a slow group holds back the next version's groups.

``max_staleness=0`` trains as the synchronous loop does: the same prompts, seeds, batches and
updates (not in every respect: `jax_agent_rl.train.step`). Both end an update with the same
tail (`learn.learn_and_push`), which runs the learner in a worker thread, so the event loop
(agent loops, tool calls) keeps going meanwhile. A resumed run starts sampling at the next
unsampled prompt; the groups that were in flight when it stopped are not sampled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.train.build import Rollout, Run
from jax_agent_rl.train.learn import learn_and_push
from jax_agent_rl.train.step import distinct_samples, keep_with_signal, run_episodes
from jax_agent_rl.train.traces import UpdateTokens

# a training step: (the learner's state, step, whether it compiles) -> the new state, its
# metrics, the episodes it sampled and its update's per-token values (`learn.learn`);
# the state it is given is donated
StepResult = tuple[LearnerState, dict[str, float], list[Episode], UpdateTokens | None]
StepFn = Callable[[LearnerState, int, bool], Awaitable[StepResult]]


@dataclasses.dataclass(frozen=True)
class Group:
    """The episodes of one prompt, and its place in the run's prompt order."""

    index: int
    episodes: list[Episode]

    @property
    def oldest_version(self) -> int | None:
        versions = [e.traj.oldest_version for e in self.episodes]
        return min((v for v in versions if v is not None), default=None)


class Finished:
    """Finished groups (or a failure: a group's, the producer's), handed out as they finished
    or, ``in_order``, in prompt order from ``first_index``."""

    def __init__(self, first_index: int, in_order: bool) -> None:
        self.count = 0  # groups finished so far
        self._next, self._in_order = first_index, in_order
        self._ready: dict[int, Group] = {}  # by index, in the order they finished
        self._failure: BaseException | None = None
        self._changed = asyncio.Condition()

    async def put(self, got: Group | BaseException) -> None:
        async with self._changed:
            if isinstance(got, Group):
                self._ready[got.index] = got
                self.count += 1
            else:
                self._failure = self._failure or got
            self._changed.notify_all()

    async def next(self) -> Group:
        """The next group, once it is finished; raises a failure at once."""

        def ready() -> bool:
            if self._failure is not None:
                return True
            return self._next in self._ready if self._in_order else bool(self._ready)

        async with self._changed:
            await self._changed.wait_for(ready)
            if self._failure is not None:
                raise self._failure
            index = self._next if self._in_order else next(iter(self._ready))
            self._next += 1
            return self._ready.pop(index)

    async def wait_count(self, count: int) -> None:
        """Until ``count`` groups have finished; raises a failure at once."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._failure is not None or self.count >= count)
            if self._failure is not None:
                raise self._failure


class Admission:
    """Which groups may start: ``(version + max_staleness + 1) * per_update`` of them, plus
    one for each group dropped (`replace`)."""

    def __init__(self, version: int, max_staleness: int, per_update: int) -> None:
        self._version, self._extra = version, 0
        self._max_staleness, self._per_update = max_staleness, per_update
        self._changed = asyncio.Condition()

    @property
    def allowed(self) -> int:
        return (self._version + self._max_staleness + 1) * self._per_update + self._extra

    async def wait_for(self, index: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: index < self.allowed)

    async def advance(self, version: int) -> None:
        async with self._changed:
            self._version = version
            self._changed.notify_all()

    async def replace(self, groups: int) -> None:
        async with self._changed:
            self._extra += groups
            self._changed.notify_all()


@dataclasses.dataclass
class Producer:
    """Starts every admitted group and puts it, finished, on ``finished`` (an exception
    instead, should a group fail as a whole, or the producer itself)."""

    run: Run
    rollout: Rollout
    admission: Admission
    first_index: int
    finished: Finished
    _tasks: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    # the uids drawn under the latest tag (`step.distinct_samples`: a prompt drawn twice for
    # one update is played under another uid the second time)
    _drawn: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    async def run_forever(self) -> None:
        per_update = self.run.cfg.data.prompts_per_step
        index = self.first_index
        try:
            while True:
                await self.admission.wait_for(index)
                (sample,) = self.run.sampler.next_batch(1)
                tag = f"s{index // per_update}a0"  # the synchronous loop's tag for this prompt
                if tag not in self._drawn:
                    self._drawn = {tag: set()}
                (sample,) = distinct_samples([sample], self._drawn[tag])
                task = asyncio.create_task(self._group(index, sample, tag))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                index += 1
        except Exception as e:  # (the sampler's): the step waiting for groups raises it
            await self.finished.put(e)
            raise
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def _group(self, index: int, sample: Sample, tag: str) -> None:
        try:
            episodes = await run_episodes(
                self.run, self.rollout, [sample], self.run.cfg.group.n, tag
            )
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the learner raises it
            await self.finished.put(e)
            return
        await self.finished.put(Group(index, episodes))


@dataclasses.dataclass
class Taken:
    """What an update gets: its groups (in prompt order), and those it dropped."""

    groups: list[Group]
    stale: list[Group]
    no_signal: list[Group]

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g.episodes]

    @property
    def seen(self) -> list[Episode]:
        return [e for g in (*self.groups, *self.stale, *self.no_signal) for e in g.episodes]


async def take_groups(
    finished: Finished,
    admission: Admission,
    want: int,
    version: int,
    max_staleness: int,
    dynamic_sampling: bool,
) -> Taken:
    """The next ``want`` groups off ``finished`` fresh enough to update the policy at
    ``version`` (and, with dynamic sampling, with a reward signal); each one dropped is
    replaced (`Admission.replace`)."""
    taken = Taken([], [], [])
    while len(taken.groups) < want:
        got = await finished.next()
        oldest = got.oldest_version
        if oldest is not None and version - oldest > max_staleness:
            taken.stale.append(got)
        elif not keep_with_signal([got.episodes], dynamic_sampling)[0]:
            taken.no_signal.append(got)
        else:
            taken.groups.append(got)
            continue
        await admission.replace(1)
    taken.groups.sort(key=lambda g: g.index)
    return taken


async def async_step(
    run: Run,
    rollout: Rollout,
    producer: Producer,
    reported: dict[str, float],
    state: LearnerState,
    step: int,
    compiles: bool,
) -> StepResult:
    """One update of ``state`` (the policy at version ``step``, donated) from finished groups,
    then its push (``pinned``: once every group started under the weights it replaces is
    done). Returns the new state, its metrics, the trajectories it trained on (those
    dropped are counted) and the update's per-token values. ``reported``: the rollout's
    counters reported so far (`learn_and_push`)."""
    cfg = run.cfg

    async def groups_of_this_version() -> None:
        allowed = producer.admission.allowed  # every one started (or starting) by now
        await producer.finished.wait_count(allowed - producer.first_index)

    t0, idle0 = time.perf_counter(), rollout.backend.idle_s()
    taken = await take_groups(
        producer.finished,
        producer.admission,
        cfg.data.prompts_per_step,
        step,
        cfg.trainer.max_staleness,
        cfg.group.dynamic_sampling,
    )
    state, m, totals, tokens = await learn_and_push(
        run,
        rollout,
        state,
        taken.episodes,
        taken.seen,
        step,
        compiles,
        reported=reported,
        t0=t0,
        idle0=idle0,
        waited_s=time.perf_counter() - t0,
        before_push=groups_of_this_version if cfg.trainer.async_schedule == "pinned" else None,
    )
    await producer.admission.advance(step + 1)
    m.update(
        {
            # the rollouts ran all along: their rate is what fed this update, over its span
            "time/rollout_tokens_per_s": totals["model_tokens"] / m["time/step_s"],
            "async/groups_stale": len(taken.stale),
            "async/groups_no_signal": len(taken.no_signal),
            "async/groups_in_flight": producer.in_flight,
        }
    )
    return state, m, taken.episodes, tokens


@contextlib.asynccontextmanager
async def async_steps(run: Run, rollout: Rollout) -> AsyncIterator[StepFn]:
    """Samples groups continuously while open (see the module docstring); yields the step
    function of the training loop, `async_step` over them."""
    per_update = run.cfg.data.prompts_per_step
    admission = Admission(run.start, run.cfg.trainer.max_staleness, per_update)
    first = run.start * per_update
    in_order = run.cfg.trainer.async_schedule == "pinned"
    producer = Producer(run, rollout, admission, first, Finished(first, in_order))
    sampling = asyncio.create_task(producer.run_forever())
    reported: dict[str, float] = {}

    async def step_fn(state: LearnerState, step: int, compiles: bool) -> StepResult:
        if sampling.done():  # it only ends by failing
            sampling.result()
        return await async_step(run, rollout, producer, reported, state, step, compiles)

    try:
        yield step_fn
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
