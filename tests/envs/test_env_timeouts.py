"""An environment's own ``TimeoutError`` (its ``asyncio.wait_for`` around a request, a socket
timeout) is its failure like any other: on ``step`` the policy's (`EnvStepError`, trained on as
a wrong answer), never the "held up by others" of a call past ``env.step_timeout_s``
(`EnvBusyError`, untrained). Before, an async step's own ``TimeoutError`` was taken for the
loop's timeout of a call that never started, and became `EnvBusyError`: an action that made
the environment time out escaped its wrong answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import Environments, EnvStep
from jax_agent_rl.envs.base import EnvBusyError, EnvStepError, GuardedEnvironment
from jax_agent_rl.envs.env_loop import EnvLoop


class AsyncTimingOut:
    """An async environment whose step's upstream request times out at once."""

    turns, owns_reward = "all", True

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        await asyncio.wait_for(asyncio.Event().wait(), 0.01)  # its own request's timeout
        return EnvStep([], 1.0, True)

    async def close(self) -> None:
        pass


class SyncTimingOut:
    """The same, synchronous (it runs in an environment thread)."""

    turns, owns_reward = "all", True

    def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    def step(self, text: str, messages: list[dict]) -> EnvStep:
        del text, messages
        raise TimeoutError("the upstream request timed out")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("env_class", [AsyncTimingOut, SyncTimingOut])
def test_an_environments_own_timeout_is_the_policys_step_failure(env_class: Any) -> None:
    sample = Sample("s/0", [{"role": "user", "content": "go"}], "1", env_class="t")
    envs = Environments({"t": lambda _: env_class()}, step_timeout_s=60.0, loop=EnvLoop())

    async def go() -> None:
        made = envs.make(sample)
        assert isinstance(made, GuardedEnvironment)
        await made.reset(sample)
        with pytest.raises(EnvStepError, match=r"t\.step raised TimeoutError") as e:
            await made.step("move", [])
        assert not isinstance(e.value, EnvBusyError)
        assert "env.step_timeout_s" not in str(e.value)  # not this call's own timeout

    asyncio.run(go())


class LeavesAnExit:
    """An async environment whose step leaves a task on the loop that raises SystemExit (a
    library's background task calling sys.exit), once its own call has answered."""

    turns, owns_reward = "all", True

    async def reset(self, sample: Sample) -> list[dict]:
        return [dict(m) for m in sample.messages]

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        del messages

        async def exits() -> None:
            raise SystemExit(3)

        if text == "leave":
            asyncio.get_running_loop().create_task(exits())
        return EnvStep([], 1.0, True)

    async def close(self) -> None:
        pass


def test_a_task_an_environment_left_that_exits_leaves_the_loop_running(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """asyncio re-raises a task's SystemExit out of the loop's run_forever: before, that
    ended the environments' loop thread, and every later async call of every episode timed
    out against a dead loop ("no call's code holds it now"). Now a task on that loop has such
    an exit made its error, as a call's is, said at once, and the next episodes' calls
    answer."""
    sample = Sample("s/0", [{"role": "user", "content": "go"}], "1", env_class="x")
    envs = Environments({"x": lambda _: LeavesAnExit()}, step_timeout_s=5.0, loop=EnvLoop())

    async def go() -> None:
        for text in ("leave", "again", "and again"):
            made = envs.make(sample)
            assert isinstance(made, GuardedEnvironment)
            await made.reset(sample)
            assert await made.step(text, []) == EnvStep([], 1.0, True)

    asyncio.run(go())
    said = "started on its loop raised RuntimeError: the call raised SystemExit: 3"
    assert said in capfd.readouterr().err
