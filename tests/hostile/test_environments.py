"""Environments attacked as a policy (or a broken environment) would: one episode reaching
another's state through a shared verl interaction, an environment that never returns holding up
the process that abandoned it, the event loop or the threads, and malformed answers.

An environment's ``async`` method ran on the rollout's event loop: one that blocked its thread
(a ``time.sleep``, a synchronous client call with no timeout, inside ``async def``) held every
episode's model turns and the backend while it blocked, and one that never returned hung the
run, where nothing could stop it. Environments' async calls now run on an event loop of their
own, in a thread of its own (`jax_agent_rl.envs.env_loop`; one loop for all of them, so a verl
interaction shared by every episode lives on one loop), awaited from the rollout's loop within
``env.step_timeout_s``: the call that blocks ends at its timeout (the policy's, as any step
past it), the calls it held up end as not the policy's (``env_error``, naming it), and a loop
blocked for good ends every later episode so, which stops the run with that error."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.agent import episode as played
from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.compat.verl.interaction import InteractionEnvironment, interaction_factory
from jax_agent_rl.config.sections import EnvSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, Environments, EnvStep, checked_step, make_environments
from jax_agent_rl.envs.base import EnvBusyError, EnvStepError, GuardedEnvironment
from jax_agent_rl.envs.env_loop import THREAD, EnvLoop
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.episodes import raise_if_all_failed

ROOT = Path(__file__).resolve().parents[2]


class Keeper:
    """One interaction instance for every episode (as verl shares it), keyed by instance id:
    it remembers what each episode said and echoes it back."""

    def __init__(self) -> None:
        self.said: dict[str, list[str]] = {}
        self.finalized: list[str] = []

    async def start_interaction(self, instance_id: str, **_kwargs: object) -> str:
        self.said[instance_id] = []
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict], **_kwargs: object
    ) -> tuple[bool, str, float, dict]:
        self.said[instance_id].append(messages[-1]["content"])
        return False, " | ".join(self.said[instance_id]), 0.0, {}

    async def finalize_interaction(self, instance_id: str, **_kwargs: object) -> None:
        self.finalized.append(instance_id)
        del self.said[instance_id]


def test_episodes_of_one_interaction_never_see_each_others_turns() -> None:
    """Two episodes interleaved on one shared interaction, one of them writing what looks like
    the other's turn: each reply holds only its own episode's turns, and each is finalized."""
    keeper = Keeper()

    async def go() -> tuple[list[str], list[str]]:
        a, b = (InteractionEnvironment(keeper, "keeper") for _ in range(2))
        for env, uid in ((a, "p/t/0"), (b, "p/t/1")):
            await env.reset(Sample(uid, [{"role": "user", "content": "hi"}], "1",
                                   extra={"interaction_kwargs": {"name": "keeper"}}))  # fmt: skip
        replies: tuple[list[str], list[str]] = ([], [])
        for turn in range(3):
            for k, env in enumerate((a, b)):
                text = f"ep{k} turn{turn}" if k == 0 else f"ep0 turn{turn} (forged)"
                step = await env.step(text, [{"role": "assistant", "content": text}])
                replies[k].append(step.observations[0]["content"])
        await a.close()
        await b.close()
        return replies

    a_replies, b_replies = asyncio.run(go())
    assert a_replies[-1] == "ep0 turn0 | ep0 turn1 | ep0 turn2"
    assert all("forged" not in r for r in a_replies)
    assert all(r.count("forged") == i + 1 for i, r in enumerate(b_replies))
    assert sorted(keeper.finalized) == ["p/t/0", "p/t/1"] and not keeper.said


def test_an_environment_stuck_forever_does_not_hold_up_the_process(tmp_path: Path) -> None:
    """A synchronous step that never returns: the episode's call ends at its timeout
    (EnvError) and the process still exits (the stuck thread is a daemon, not joined at the
    event loop's close, as the default executor's would be). (A skyrl-gym one is killed with
    its process: tests/hostile/test_skyrl_isolation.py.)"""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from jax_agent_rl.data.sample import Sample
            from jax_agent_rl.envs.base import EnvError, Environments

            class Stuck:
                turns, owns_reward = "all", True
                def reset(self, sample):
                    return sample.messages
                def step(self, text, messages):
                    threading.Event().wait()
                def close(self):
                    pass

            async def main():
                envs = Environments({"stuck": lambda _: Stuck()}, step_timeout_s=0.5)
                sample = Sample("s", [{"role": "user", "content": "x"}], "1", env_class="stuck")
                env = envs.make(sample)
                await env.reset(sample)
                try:
                    await env.step("go", [])
                except EnvError as e:
                    print("ended:", e)

            asyncio.run(main())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout, not an installed one
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ended: stuck.step took longer than env.step_timeout_s=0.5s" in done.stdout


def _sample(env_class: str = "x", uid: str = "s/0") -> Sample:
    return Sample(uid, [{"role": "user", "content": "go"}], "1", env_class=env_class)


def _environments(env: object, timeout_s: float) -> Environments:
    """Environments of one class ``x`` that makes ``env``."""
    return Environments({"x": lambda _sample: env}, step_timeout_s=timeout_s)


RELEASE, WOKE = threading.Event(), threading.Event()  # (the blocking step's thread)


class AsyncEnv:
    """A native environment whose step misbehaves as ``kind`` says."""

    turns, owns_reward = "all", True

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        if self.kind == "forever":
            await asyncio.Event().wait()
        if self.kind == "blocks":  # a synchronous wait inside an async step, until released
            RELEASE.wait(30)
            WOKE.set()
        if self.kind == "bad_reward":
            return EnvStep([], reward="1.0", done=True)  # type: ignore[arg-type]
        content = {"none": None, "bytes": b"hi", "int": 3}.get(self.kind, "ok")
        return EnvStep([{"role": "user", "content": content}], 0.0, done=self.kind != "fine")

    async def close(self) -> None:
        if self.kind == "forever":
            await asyncio.Event().wait()


def _step(env: object, timeout_s: float = 0.2) -> str:
    """What one reset + step of ``env`` made by the run's `Environments` gives: ``ok`` or the
    `EnvError` text (the whole test is bounded: a call that hangs fails it)."""

    async def go() -> str:
        made = _environments(env, timeout_s).make(_sample())
        assert made is not None
        await made.reset(_sample())
        try:
            await made.step("move", [])
        except EnvError as e:
            return str(e)
        return "ok"

    return asyncio.run(asyncio.wait_for(go(), 20))


def test_a_native_environment_is_held_to_the_step_timeout() -> None:
    """A native async step that never returns ends at env.step_timeout_s (EnvError naming the
    environment); so does one that blocks its thread (on the environments' own event loop, which
    it holds: `test_an_async_step_blocking_its_thread_holds_not_the_rollout_loop`), its error
    saying so."""
    assert "x.step took longer than env.step_timeout_s=0.2s" in _step(AsyncEnv("forever"))
    try:
        error = _step(AsyncEnv("blocks"))
    finally:
        RELEASE.set()
        assert WOKE.wait(30)  # (the loop is free again for the tests after this one)
    assert "x.step took longer than env.step_timeout_s=0.2s (it blocks the environments'" in error


class StubbornEnv:
    """A native environment whose step retries whatever stops it, its cancellation too (a
    retry loop catching every exception), until ``released`` is set or BOUND_S have passed."""

    turns, owns_reward = "all", True
    BOUND_S = 30.0

    def __init__(self) -> None:
        self.released, self.ended = asyncio.Event(), threading.Event()
        self.cancelled = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the one it runs on

    async def reset(self, sample: Sample) -> list[dict]:
        self.loop = asyncio.get_running_loop()
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        for _ in range(2):
            try:
                await asyncio.wait_for(self.released.wait(), self.BOUND_S)
                break
            except BaseException:  # the cancellation too: the stubborn loop under test
                self.cancelled += 1
        self.ended.set()
        return EnvStep([], reward=1.0, done=True)

    async def close(self) -> None:
        pass


def test_a_native_environment_that_ignores_its_cancellation_is_abandoned_at_the_timeout() -> None:
    """Its step is cancelled at env.step_timeout_s, ignores it, and the episode ends then with
    an EnvError naming the timeout (before: the loop waited for the step to end however long
    it ran, and then called it an async method that blocked the event loop)."""
    env = StubbornEnv()

    async def go() -> str:
        made = _environments(env, 0.05).make(_sample())
        assert made is not None
        await made.reset(_sample())
        try:
            await made.step("move", [])
            return "ok"
        except EnvError as e:
            return str(e)
        finally:
            assert env.loop is not None
            env.loop.call_soon_threadsafe(env.released.set)  # the abandoned step ends
            assert await asyncio.to_thread(env.ended.wait, env.BOUND_S)

    assert "x.step took longer than env.step_timeout_s=0.05s" in asyncio.run(go())
    assert env.cancelled == 1


@pytest.mark.parametrize("kind", ["none", "bytes", "int", "bad_reward"])
def test_malformed_observations_and_rewards_are_refused_naming_the_environment(
    kind: str,
) -> None:
    """A native environment's observation content that is None, bytes or a number, and a
    reward that is a string, end the episode as an env error naming the environment."""
    error = _step(AsyncEnv(kind), timeout_s=5.0)
    assert error.startswith("x") and ("content" in error or "reward '1.0'" in error), error


class SyncEnv:
    """A synchronous environment: its step waits for ``gate``, which a coroutine on the event
    loop opens; on the event loop it would wait for ever."""

    turns, owns_reward = "all", True

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        assert self.gate.wait(10), "the event loop was held while this step ran"
        return EnvStep([], reward=1.0, done=True)

    def close(self) -> None:
        pass


def test_a_synchronous_environment_runs_in_a_thread_beside_the_event_loop() -> None:
    """A synchronous environment is played (not refused), its calls in a thread of the pool:
    the event loop goes on while its step runs."""
    gate = threading.Event()

    async def go() -> EnvStep:
        made = _environments(SyncEnv(gate), 15.0).make(_sample())
        assert made is not None
        await made.reset(_sample())
        step = asyncio.ensure_future(made.step("move", []))
        await asyncio.sleep(0)
        gate.set()  # only the event loop opens it
        return await step

    assert asyncio.run(go()) == EnvStep([], 1.0, True)


def test_environments_stuck_for_good_hold_at_most_the_pool_of_threads(tmp_path: Path) -> None:
    """20 episodes of a synchronous environment (a user's own, not skyrl-gym's, whose
    processes are killed) whose step never returns: each ends at its timeout, and at most
    env.max_threads=4 threads stay stuck (the others never start: they wait for a thread
    within their timeout), however many episodes run into it."""
    (tmp_path / "stuck.py").write_text(
        textwrap.dedent(
            """
            import threading

            class Stuck:
                turns, owns_reward = "all", True
                def reset(self, sample):
                    return sample.messages
                def step(self, text, messages):
                    threading.Event().wait()
                def close(self):
                    pass

            def stuck(sample):
                return Stuck()
            """
        )
    )
    section = EnvSection(
        classes={"stuck": f"{tmp_path / 'stuck.py'}:stuck"}, step_timeout_s=0.2, max_threads=4
    )
    envs = make_environments(section, 2)
    before = threading.active_count()

    async def episode() -> str:
        made = envs.make(_sample("stuck"))
        assert made is not None
        await made.reset(_sample("stuck"))
        try:
            await made.step("move", [])
        except EnvError as e:
            return str(e)
        return "ok"

    async def go() -> list[str]:
        return list(await asyncio.gather(*(episode() for _ in range(20))))

    errors = asyncio.run(asyncio.wait_for(go(), 60))
    assert all("stuck.step took longer than" in e for e in errors), errors
    assert threading.active_count() - before <= 4
    assert envs.threads.busy == 4


def test_a_step_whose_done_and_success_are_numpy_bools_is_taken() -> None:
    """``done = np.array_equal(board, goal)`` gives a NumPy bool, which is True or False as a
    Python bool is (before: every such step was an env error, "expected True or False", so
    every episode of the environment failed); a reward that is a NumPy float is a number."""
    for done, success in ((np.True_, np.False_), (np.False_, None), (np.bool_(1), np.True_)):
        raw = {"observations": [], "reward": np.float32(0.5), "done": done, "success": success}
        step = checked_step(raw, "env")
        assert step == EnvStep([], 0.5, bool(done), None if success is None else bool(success))
        assert type(step.done) is bool and type(step.reward) is float
    with pytest.raises(EnvError, match="done array"):
        checked_step({"observations": [], "reward": 0.0, "done": np.array([True])}, "env")


class HugePrompt:
    """A native environment whose reset gives a prompt of 300,000 characters."""

    turns, owns_reward = "all", True

    async def reset(self, sample: Sample) -> list[dict]:
        del sample
        return [{"role": "user", "content": "go " * 100_000}]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        return EnvStep([], 0.0, True)

    async def close(self) -> None:
        pass


def test_a_huge_reset_prompt_is_built_beside_the_event_loop(
    backend: EmbeddedBackend, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt an environment's reset gives is templated and tokenized in a thread: on the
    event loop, a 12M-character one held every other episode 34.9 s. The build waits until
    the event loop has run a step of the test's own (it never could, before), then goes on."""
    envs = Environments({"h": lambda _: HugePrompt()}, step_timeout_s=5.0, loop=EnvLoop())
    sample = Sample("h/0", [{"role": "user", "content": "go"}], "1", env_class="h")

    async def go() -> Trajectory:
        cfg = AgentConfig(max_turns=1, max_tokens_per_turn=4, max_model_len=256)
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(
            backend, tokenizer, tools, make_parser("hermes"), cfg, envs=envs
        )
        building, loop_ran = threading.Event(), threading.Event()
        built = ctx.builder.prompt_ids

        def watched(messages: list[dict]) -> list[int]:
            building.set()
            assert loop_ran.wait(60), "the event loop was held while the prompt was built"
            return built(messages)

        monkeypatch.setattr(ctx.builder, "prompt_ids", watched)
        episode = asyncio.ensure_future(run_sample(sample, ctx))
        assert await asyncio.to_thread(building.wait, 60)
        loop_ran.set()  # (this line runs only while the loop is free)
        return await episode

    traj = asyncio.run(go())
    assert traj.stop_reason != "agent_error", traj.error
    assert len(traj.prompt_ids) > 100_000  # (the whole prompt, too long for the context)


BOUND_S = 30.0  # how long a wait on a thread's event may take (the test fails past it)


class Blocking:
    """A native environment whose async step blocks its thread (a synchronous call inside
    ``async def``) until ``release`` is set, saying when it starts (``blocking``) and ends."""

    turns, owns_reward = "all", True

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.blocking, self.woke = threading.Event(), threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        self.blocking.set()
        released = self.release.wait(BOUND_S)
        self.woke.set()
        return EnvStep([], float(released), True)

    async def close(self) -> None:
        pass


class Waiting:
    """A native environment whose async step awaits (without blocking) until ``go`` is set."""

    turns, owns_reward = "all", True

    def __init__(self) -> None:
        self.stepping = threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        self.stepping.set()
        await asyncio.sleep(3 * BOUND_S)  # (cancelled at its timeout)
        return EnvStep([], 1.0, True)

    async def close(self) -> None:
        pass


def _made(envs: Environments, env_class: str) -> GuardedEnvironment:
    made = envs.make(_sample(env_class))
    assert isinstance(made, GuardedEnvironment)
    return made


def test_an_async_step_blocking_its_thread_holds_not_the_rollout_loop() -> None:
    """An async step blocked on an event that only a coroutine of the rollout's loop sets: it
    gets it, and answers (before: it held that loop, so the event was never set and the step
    was refused once it gave up waiting, "blocked the event loop")."""
    gate = threading.Event()
    env = Blocking(gate)
    envs = Environments({"b": lambda _: env}, step_timeout_s=BOUND_S, loop=EnvLoop())

    async def go() -> EnvStep:
        made = _made(envs, "b")
        await made.reset(_sample("b"))
        step = asyncio.ensure_future(made.step("move", []))
        await asyncio.to_thread(env.blocking.wait, BOUND_S)  # (the rollout's loop runs on)
        gate.set()
        return await step

    assert asyncio.run(go()) == EnvStep([], 1.0, True)


def test_calls_held_up_by_a_blocked_env_loop_are_not_the_policys() -> None:
    """While one episode's async step blocks the environments' loop: its own step ends at its
    timeout as the policy's (EnvStepError: it holds the loop itself), and another episode's
    step, submitted meanwhile and never started, ends as not the policy's (EnvBusyError),
    naming the call that holds the loop."""
    release = threading.Event()
    blocker, other = Blocking(release), Waiting()
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: other}, step_timeout_s=0.5, loop=EnvLoop()
    )

    async def go() -> tuple[BaseException, BaseException]:
        a, b = _made(envs, "b"), _made(envs, "w")
        await a.reset(_sample("b"))
        await b.reset(_sample("w"))
        stepped = asyncio.ensure_future(a.step("move", []))
        await asyncio.to_thread(blocker.blocking.wait, BOUND_S)
        errors = await asyncio.gather(stepped, b.step("move", []), return_exceptions=True)
        return errors[0], errors[1]

    try:
        own, held = asyncio.run(go())
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert isinstance(own, EnvStepError), own
    assert "b.step took longer than env.step_timeout_s=0.5s (it blocks the environments'" in str(
        own
    )
    assert isinstance(held, EnvBusyError), held
    assert "w.step took longer than env.step_timeout_s=0.5s" in str(held)
    assert "never started it: b.step has held it for" in str(held)
    assert not other.stepping.is_set()  # (given up before it started: it never runs)


def test_a_call_stalled_midway_by_another_that_blocks_is_not_the_policys() -> None:
    """An episode's async step that started and awaits, then another episode's step blocks the
    loop for the rest of the first's timeout: the first ends as not the policy's (EnvBusyError:
    other calls held the loop for most of its time), not as a wrong answer."""
    release = threading.Event()
    blocker, waiter = Blocking(release), Waiting()
    # the blocker must take the loop within half the waiter's timeout of its start (this
    # thread's hand-off, milliseconds idle): 3 s of slack for a machine other jobs load
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: waiter}, step_timeout_s=6.0, loop=EnvLoop()
    )

    async def go() -> BaseException | EnvStep:
        a, b = _made(envs, "b"), _made(envs, "w")
        await a.reset(_sample("b"))
        await b.reset(_sample("w"))
        waiting = asyncio.ensure_future(b.step("move", []))
        await asyncio.to_thread(waiter.stepping.wait, BOUND_S)
        blocked = asyncio.ensure_future(a.step("move", []))
        out = (await asyncio.gather(waiting, return_exceptions=True))[0]
        await asyncio.gather(blocked, return_exceptions=True)
        return out

    try:
        error = asyncio.run(go())
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert isinstance(error, EnvBusyError), error
    assert "other calls' synchronous code held the environments' event loop" in str(error)


class Leaving:
    """A native environment whose async step answers at once, leaving a task on the loop that
    blocks it (until ``release``)."""

    turns, owns_reward = "all", True

    def __init__(self, release: threading.Event) -> None:
        self.release, self.woke = release, threading.Event()

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages

        async def left() -> None:
            self.release.wait(BOUND_S)
            self.woke.set()

        asyncio.get_running_loop().create_task(left())
        return EnvStep([], 1.0, False)

    async def close(self) -> None:
        pass


def test_a_call_that_answered_is_taken_though_a_task_it_left_blocks_the_loop() -> None:
    """Its answer is taken as its coroutine gives it (not once its task's callbacks run, behind
    the task it left), and a call after it, never started, ends as not the policy's, naming no
    call as holding the loop (before: the task it left held the rollout's loop, every episode
    with it)."""
    release = threading.Event()
    env = Leaving(release)
    envs = Environments({"l": lambda _: env}, step_timeout_s=0.5, loop=EnvLoop())

    async def go() -> tuple[EnvStep, BaseException]:
        a, b = _made(envs, "l"), _made(envs, "l")
        await a.reset(_sample("l"))
        await b.reset(_sample("l"))
        answered = await a.step("move", [])
        held = (await asyncio.gather(b.step("move", []), return_exceptions=True))[0]
        return answered, held

    try:
        answered, held = asyncio.run(go())
    finally:
        release.set()
        assert env.woke.wait(BOUND_S)
    assert answered == EnvStep([], 1.0, False)
    assert isinstance(held, EnvBusyError) and "no call's code holds it now" in str(held)


def test_a_shared_interaction_runs_on_the_environments_loop() -> None:
    """Every episode's calls of the one interaction instance verl shares run on the
    environments' loop thread, one loop for all (before: on the rollout's)."""
    threads: set[str] = set()

    class Recorder:
        async def start_interaction(self, instance_id: str, **_kwargs: object) -> str:
            threads.add(threading.current_thread().name)
            return instance_id

        async def generate_response(
            self, instance_id: str, messages: list[dict], **_kwargs: object
        ) -> tuple[bool, str, float, dict]:
            del instance_id, messages
            threads.add(threading.current_thread().name)
            return True, "ok", 0.0, {}

        async def finalize_interaction(self, instance_id: str, **_kwargs: object) -> None:
            del instance_id
            threads.add(threading.current_thread().name)

    envs = Environments(interaction=interaction_factory({"r": Recorder()}), loop=EnvLoop())

    async def episode(uid: str) -> None:
        sample = Sample(uid, [{"role": "user", "content": "hi"}], "1",
                        extra={"interaction_kwargs": {"name": "r"}})  # fmt: skip
        made = envs.make(sample)
        assert made is not None
        await made.reset(sample)
        await made.step("x", [{"role": "assistant", "content": "x"}])
        await made.close()

    async def go() -> None:
        await asyncio.gather(episode("a/0"), episode("b/0"))

    asyncio.run(go())
    assert threads == {THREAD}


def _episodes(
    backend: EmbeddedBackend, tokenizer: Tokenizer, envs: Environments, blocker: Blocking
) -> list[Trajectory]:
    """One episode of ``blocker`` (its first step blocks the environments' loop for good), then,
    once it blocks, three of another environment."""

    async def go() -> list[Trajectory]:
        tools = LocalTools(ToolRegistry([]))
        cfg = AgentConfig(max_turns=2, max_tokens_per_turn=4, max_model_len=256)
        ctx = await AgentContext.create(
            backend, tokenizer, tools, make_parser("hermes"), cfg, envs=envs
        )
        first = asyncio.ensure_future(run_sample(_sample("b", "b/0"), ctx))
        await asyncio.to_thread(blocker.blocking.wait, BOUND_S)
        rest = [run_sample(_sample("w", f"w/{i}"), ctx) for i in range(3)]
        return list(await asyncio.wait_for(asyncio.gather(first, *rest), 3 * BOUND_S))

    return asyncio.run(go())


def test_an_env_loop_blocked_for_good_stops_the_run_naming_it(
    backend: EmbeddedBackend, tokenizer: Tokenizer
) -> None:
    """An episode whose async step blocks the environments' loop for good (released only when
    the test ends): it ends caused_error at its timeout, every episode started after it ends
    env_error (its reset never started), and the rollout's every-episode-failed error names the
    call holding the loop and the timeout (before: the rollout's loop was held, and with it
    every episode, until the step returned)."""
    release = threading.Event()
    blocker = Blocking(release)
    envs = Environments(
        {"b": lambda _: blocker, "w": lambda _: Waiting()}, step_timeout_s=1.0, loop=EnvLoop()
    )
    try:
        trajs = _episodes(backend, tokenizer, envs, blocker)
    finally:
        release.set()
        assert blocker.woke.wait(BOUND_S)
    assert [t.stop_reason for t in trajs] == ["caused_error", *["env_error"] * 3]
    with pytest.raises(RuntimeError) as failed:
        raise_if_all_failed([played.Episode(t) for t in trajs])
    said = str(failed.value)
    assert "75% of episodes ended env_error" in said, said
    assert "w.reset took longer than env.step_timeout_s=1.0s" in said
    assert "b.step has held it for" in said


def test_a_reset_raising_system_exit_on_the_env_loop_is_an_env_error() -> None:
    """(A guard: the env loop carries an environment's own error through as it is.)"""

    class Raising:
        turns, owns_reward = "all", True

        async def reset(self, sample: Sample) -> list[dict]:
            del sample
            raise SystemExit(3)  # (not an Exception: carried as a RuntimeError naming it)

        async def step(self, text: str, messages: list[dict]) -> EnvStep:
            del text, messages
            raise AssertionError

        async def close(self) -> None:
            pass

    envs = Environments({"r": lambda _: Raising()}, step_timeout_s=BOUND_S, loop=EnvLoop())

    async def go() -> None:
        await _made(envs, "r").reset(_sample("r"))

    with pytest.raises(EnvError, match=r"r.reset raised .*SystemExit"):
        asyncio.run(go())
