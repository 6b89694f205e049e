"""The RL loop's steps: groups sampled continuously, updates with bounded staleness.

``trainer.max_staleness`` bounds how far behind the policy an update's groups may be
sampled; at 0 (the default) this is the synchronous loop (docs/async.md).

Rollouts never wait for the learner: groups (one prompt, ``group.n`` episodes) run on the
backend continuously, and each update takes ``data.prompts_per_step`` finished groups as they
come, while the next ones are sampled. Three rules keep the off-policy gap bounded:

- **Admission.** The groups of the update of version ``u`` (``data.prompts_per_step``
  prompts, drawn together: a grant) may start once the policy is at ``u - max_staleness``:
  at most ``max_staleness + 1`` updates' worth of groups is ever sampled ahead of the policy.
  A dropped group is replaced by a new grant (`take_groups`).
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
  new one. TIS (``algorithm.tis_cap``) or a rollout mask (``algorithm.rollout_mask``: IcePop,
  KPop, geometric) corrects the rest with the rollout logprobs, as in the sync loop.

That is ``trainer.async_schedule=as_finished``: which groups an update gets, and where a push
lands in a trajectory, follow the machine's timing (the engine's, the learner's and the
tools' speeds), so two runs of one config differ, the more so on a loaded machine. With
``pinned`` the schedule follows versions and events only: updates take groups in prompt
order, and a push waits until every group started under the weights it replaces is done, so
each group is sampled whole under the weights served when it was admitted (update ``k``
trains on groups sampled by version ``max(k - max_staleness, first)``; nothing is ever
stale). The versions and batches are then the same whatever the load, but no push lands
mid-trajectory: a slow group holds back the next version's groups.

At ``max_staleness=0`` each update's prompts are drawn when it begins (after the hooks of
the one before, its checkpoint among them), its groups are all sampled by the weights it
updates, and the learner waits for them: the synchronous loop. With dynamic sampling the
groups without a reward signal are replaced in rounds, at most ``group.max_refills`` of them
(at any staleness). The synchronous loop runs on several processes too: each draws every process's
prompts and plays its slice, and the refills are agreed. Every update ends with the
same tail (`learn.learn_and_push`), which runs the learner in a worker thread, so the event
loop (agent loops, tool calls) keeps going meanwhile. A resumed run starts sampling at the
next unsampled prompt; the groups that were in flight when it stopped are not sampled again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import jax

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.cluster import distributed
from jax_agent_rl.config import JarlConfig
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rl.update import LearnerState
from jax_agent_rl.train.build import Rollout, Run
from jax_agent_rl.train.learn import learn_and_push
from jax_agent_rl.train.rollout_score import distinct_samples, has_signal, run_episodes
from jax_agent_rl.train.traces import UpdateTokens

# a training step: (the learner's state, step, whether it compiles) -> the new state, its
# metrics, the episodes it sampled (those fresh enough for it: `Taken.fresh`) and its
# update's per-token values (`learn.learn`);
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


@dataclasses.dataclass(frozen=True)
class Grant:
    """Groups that may start: ``count`` prompts for each process, drawn together for the
    update of ``version`` (``attempt`` 0, or a refill's), tagged ``s<version>a<attempt>``
    (their episodes' seeds: `rollout_score.episode_seed`)."""

    count: int
    version: int
    attempt: int = 0

    @property
    def tag(self) -> str:
        return f"s{self.version}a{self.attempt}"


class Admission:
    """Which groups may start, as grants in order: each version's ``per_update`` groups
    (tagged ``s<version>a0``), granted once the policy is at most ``max_staleness`` versions
    behind them, and the replacements of dropped groups (`replace`); none of a version past
    ``last`` (the run's last update: no update would train on them). ``allowed`` counts the
    groups granted so far: ``(version + max_staleness + 1) * per_update`` (the version at
    most ``last``) plus the replacements."""

    def __init__(
        self, version: int, max_staleness: int, per_update: int, last: int | None = None
    ) -> None:
        self._last = last
        # the newest version whose groups are granted
        self._opened = self._capped(version + max_staleness)
        self._grants = collections.deque(
            Grant(per_update, v) for v in range(version, self._opened + 1)
        )
        self.allowed = (self._opened + 1) * per_update
        self._max_staleness, self._per_update = max_staleness, per_update
        self._changed = asyncio.Condition()

    def _capped(self, version: int) -> int:
        return version if self._last is None else min(version, self._last)

    async def next_grant(self) -> Grant:
        """The next grant, once there is one."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._grants))
            return self._grants.popleft()

    async def advance(self, version: int) -> None:
        """The policy is at ``version``: the groups of the versions up to ``version +
        max_staleness`` (and ``last``) may start."""
        async with self._changed:
            newest = self._capped(version + self._max_staleness)
            for v in range(self._opened + 1, newest + 1):
                self._grants.append(Grant(self._per_update, v))
                self.allowed += self._per_update
            self._opened = max(self._opened, newest)
            self._changed.notify_all()

    async def replace(self, groups: int, version: int, attempt: int) -> None:
        """``groups`` more may start: the ``attempt``-th refill of ``version``'s update."""
        async with self._changed:
            self._grants.append(Grant(groups, version, attempt))
            self.allowed += groups
            self._changed.notify_all()


@dataclasses.dataclass
class Producer:
    """Starts every admitted group and puts it, finished, on ``finished`` (an exception
    instead, should a group fail as a whole, or the producer itself). Every process draws
    each grant's prompts for all processes (``count`` each) and plays its own slice, so the
    sampler's state is one for the run, whatever the process count, and a group never spans
    processes."""

    run: Run
    rollout: Rollout
    admission: Admission
    first_index: int
    finished: Finished
    _tasks: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    # the uids drawn for each recent version's updates (`rollout_score.distinct_samples`)
    _drawn: dict[int, set[str]] = dataclasses.field(default_factory=dict)

    async def run_forever(self) -> None:
        processes, me = jax.process_count(), jax.process_index()
        index = self.first_index
        try:
            while True:
                grant = await self.admission.next_grant()
                drawn = self.run.sampler.next_batch(grant.count * processes)
                k = grant.count
                mine = self._distinct(drawn, grant.version)[me * k : (me + 1) * k]
                tag = grant.tag + (f"p{me}" if processes > 1 else "")
                for sample in mine:
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

    def _distinct(self, drawn: list[Sample], version: int) -> list[Sample]:
        """``drawn`` renamed apart from every prompt drawn for an update that may take the
        same groups: a prompt drawn twice (past an epoch's end) is played under another uid
        the second time, not merged into the first one's group. Update ``v`` takes groups
        granted for ``v - max_staleness`` (a refill of that update's) to ``v + max_staleness``,
        so the versions ``2 * max_staleness`` on either side count; at ``max_staleness=0``
        only the update's own (its refills'), so that a resumed synchronous run, which has
        forgotten the uids drawn before, names its prompts as an uninterrupted one. Every
        process renames alike."""
        near = 2 * staleness_bound(self.run.cfg)
        self._drawn = {v: uids for v, uids in self._drawn.items() if v >= version - near}
        taken = set().union(*(u for v, u in self._drawn.items() if abs(v - version) <= near))
        out = distinct_samples(drawn, taken)
        self._drawn.setdefault(version, set()).update(s.uid for s in out)
        return out

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
    """What an update gets: its groups (in prompt order), those it dropped, and those a
    refill brought beyond its need (another process lacked more: `take_groups`)."""

    groups: list[Group] = dataclasses.field(default_factory=list)
    stale: list[Group] = dataclasses.field(default_factory=list)
    no_signal: list[Group] = dataclasses.field(default_factory=list)
    spare: list[Group] = dataclasses.field(default_factory=list)

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g.episodes]

    @property
    def fresh(self) -> list[Episode]:
        """Every episode fresh enough for the update, in prompt order: those it trains on and
        those it dropped for want of a signal or of need (the step's hooks get them: its
        traces, its warnings' examples; at ``max_staleness=0``, every episode it sampled)."""
        every = sorted((*self.groups, *self.no_signal, *self.spare), key=lambda g: g.index)
        return [e for g in every for e in g.episodes]

    @property
    def seen(self) -> list[Episode]:
        every = (*self.groups, *self.stale, *self.no_signal, *self.spare)
        return [e for g in every for e in g.episodes]


async def take_groups(
    finished: Finished,
    admission: Admission,
    want: int,
    version: int,
    max_staleness: int,
    dynamic_sampling: bool,
    max_refills: int,
) -> Taken:
    """The next ``want`` groups off ``finished`` fresh enough to update the policy at
    ``version`` (and, with dynamic sampling, with a reward signal), in rounds: a round takes
    as many finished groups as it was granted (``want`` at first), and the groups it dropped
    are replaced in the next (`Admission.replace`): as many for each process as the neediest
    one lacks (`distributed.agree_max`), the groups beyond a process's need kept aside
    (``spare``). Stale groups are always replaced; groups without a reward signal in at most
    ``max_refills`` rounds, after which the update takes what it has."""
    taken = Taken()
    granted, refills = want, 0
    for attempt in itertools.count(1):
        no_signal = len(taken.no_signal)
        arrived = [await finished.next() for _ in range(granted)]
        for got in sorted(arrived, key=lambda g: g.index):  # (spares: the later prompts)
            oldest = got.oldest_version
            if oldest is not None and version - oldest > max_staleness:
                taken.stale.append(got)
            elif dynamic_sampling and not has_signal(got.episodes):
                taken.no_signal.append(got)
            elif len(taken.groups) < want:
                taken.groups.append(got)
            else:
                taken.spare.append(got)
        short, dropped = distributed.agree_max(
            [want - len(taken.groups), len(taken.no_signal) - no_signal]
        )
        if dropped:
            refills += 1
        if short == 0 or (dropped and refills > max_refills):
            break
        await admission.replace(short, version, attempt)
        granted = short
    taken.groups.sort(key=lambda g: g.index)
    return taken


def staleness_bound(cfg: JarlConfig) -> int:
    """How many versions behind its policy an update's trajectories may be sampled:
    ``trainer.max_staleness`` (0: the synchronous loop)."""
    return cfg.trainer.max_staleness


async def update_step(
    run: Run,
    rollout: Rollout,
    producer: Producer,
    reported: dict[str, float],
    state: LearnerState,
    step: int,
    compiles: bool,
) -> StepResult:
    """One update of ``state`` (the policy at version ``step``, donated) from finished
    groups, then its push (``pinned``: once every group started under the weights it
    replaces is done). The groups of version ``step + max_staleness`` are granted when it
    begins, after the previous step's hooks: at ``max_staleness=0`` no prompt of a step is
    drawn before the checkpoint of the one before; above it, once the push lands (the policy
    is at ``step + 1``), those of ``step + 1 + max_staleness`` are, so that they run while the
    step's hooks do. Returns the new state, its metrics, the
    episodes fresh enough for it (`Taken.fresh`: those dynamic sampling dropped among them;
    the stale ones are counted) and the update's per-token values.
    ``reported``: the rollout's counters reported so far (`learn_and_push`)."""
    cfg = run.cfg
    bound = staleness_bound(cfg)

    async def groups_of_this_version() -> None:
        allowed = producer.admission.allowed  # every one started (or starting) by now
        await producer.finished.wait_count(allowed - producer.first_index)

    t0, idle0 = time.perf_counter(), rollout.backend.idle_s()
    await producer.admission.advance(step)
    taken = await take_groups(
        producer.finished,
        producer.admission,
        cfg.data.prompts_per_step // jax.process_count(),
        step,
        bound,
        cfg.group.dynamic_sampling,
        cfg.group.max_refills,
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
    if bound:  # the next version's groups run during the hooks
        await producer.admission.advance(step + 1)
    # at staleness 0 the rollouts stop while the learner updates: their rate is over their
    # own time; else they ran all along, and what fed this update is their rate over its span
    span = m["time/rollout_s"] if bound == 0 else m["time/step_s"]
    m.update(
        {
            "time/rollout_tokens_per_s": totals["model_tokens"] / max(span, 1e-9),
            "async/groups_stale": len(taken.stale),
            "async/groups_no_signal": len(taken.no_signal),
            "async/groups_in_flight": producer.in_flight,
        }
    )
    return state, m, taken.fresh, tokens


@contextlib.asynccontextmanager
async def update_steps(run: Run, rollout: Rollout) -> AsyncIterator[StepFn]:
    """Samples groups continuously while open (see the module docstring); yields the step
    function of the training loop, `update_step` over them."""
    per_update = run.cfg.data.prompts_per_step // jax.process_count()
    admission = Admission(
        run.start, staleness_bound(run.cfg), per_update, run.cfg.trainer.steps - 1
    )
    first = run.start * per_update
    in_order = run.cfg.trainer.async_schedule == "pinned"
    producer = Producer(run, rollout, admission, first, Finished(first, in_order))
    sampling = asyncio.create_task(producer.run_forever())
    reported: dict[str, float] = {}

    async def step_fn(state: LearnerState, step: int, compiles: bool) -> StepResult:
        if sampling.done():  # it only ends by failing
            sampling.result()
        if step >= run.cfg.trainer.steps:  # (no groups are granted for it: it would wait)
            raise ValueError(f"step {step} is past trainer.steps={run.cfg.trainer.steps}")
        return await update_step(run, rollout, producer, reported, state, step, compiles)

    try:
        yield step_fn
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
