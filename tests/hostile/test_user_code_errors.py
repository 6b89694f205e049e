"""What user code raises that is not an `Exception` ended the whole run, or cancelled its step:
func_timeout's ``FunctionTimedOut`` (a `BaseException`, which a reward or a tool that wraps its
work in ``func_timeout`` raises on an answer it gave up on: the policy's answer chose it), a
``KeyboardInterrupt`` or asyncio ``CancelledError`` the code raised itself, and, in a task of
its own (an async tool's call, an async environment method), a ``SystemExit`` (argparse
reading a policy's arguments), which asyncio re-raises out of the event loop. A reward
function's in its worker process reached the step as it was; a synchronous tool's or
environment's from its thread too. Each is now the call's error, as a `RuntimeError` naming
it (`usercode.threads.carried`, `usercode.threads.own_errors`): a reward error, an environment
error, a tool's error result the model reads, a harness error; the episode's own cancellation
still passes on. A skyrl-gym environment's in its own process ended that process, its episode's
error saying it died "out of memory ..., or broken"; it names what was raised now."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import load_config
from jax_agent_rl.config.sections import EnvSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import make_environments
from jax_agent_rl.envs.base import EnvError, Environments
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.rollout_score import score_episodes

HERE = "tests.hostile.test_user_code_errors"


class FunctionTimedOut(BaseException):
    """func_timeout's exception (``func_timeout.exceptions.FunctionTimedOut``): not an
    `Exception`."""


def not_an_exception(what: str) -> BaseException:
    """What user code raises that is not an `Exception`, by name."""
    return {
        "timed_out": FunctionTimedOut("func_timeout gave up after 5 seconds"),
        "interrupted": KeyboardInterrupt(),
        "cancelled": asyncio.CancelledError(),
        "exited": SystemExit(2),  # (argparse's, on arguments it cannot read)
    }[what]


RAISED = {
    "timed_out": "FunctionTimedOut: func_timeout gave up after 5 seconds",
    "interrupted": "KeyboardInterrupt",
    "cancelled": "CancelledError",
    "exited": "SystemExit: 2",
}


def giving_up(text: str, ground_truth: Any) -> float:
    """A user's reward: 1 for the right answer; what is not an `Exception` for the answers
    naming one (as a scorer under func_timeout gives up on an answer it cannot finish)."""
    if text in RAISED:
        raise not_an_exception(text)
    return float(text == ground_truth)


def test_a_reward_raising_what_is_not_an_exception_ends_only_its_episode(
    tokenizer: Tokenizer,
) -> None:
    cfg = load_config(
        None,
        ["model.path=m", "data.train=t.jsonl", f"data.reward={HERE}:giving_up",
         "data.reward_workers=1"],
    )  # fmt: skip
    texts = ["timed_out", "interrupted", "cancelled", "exited", "4"]
    sample = Sample("r", [{"role": "user", "content": "2+2?"}], "4", data_source="s")
    group = []
    for i, text in enumerate(texts):
        traj = Trajectory(uid=f"r/s1a0/{i}", group_id="r", prompt_ids=[1])
        traj.messages = [{"role": "assistant", "content": text}]
        group.append(traj)

    async def go() -> list[list[Episode]]:
        with make_reward(cfg.data) as score:
            return await score_episodes(
                [group], [sample], score, 0.0, tokenizer, success_reward=1.0
            )

    (scored,) = asyncio.run(go())  # (before: FunctionTimedOut, or KeyboardInterrupt, out of it)
    for episode, text in zip(scored[:-1], texts, strict=False):
        # (it scores the row's own answer: the answer's fault, a wrong answer, trained on,
        # `test_answer_faults.py`; before that, these ended reward_error, untrained)
        assert (episode.stop_reason, episode.reward, episode.trainable) == ("eos", 0.0, True)
        assert f"(RuntimeError: the call raised {RAISED[text]} in giving_up" in str(
            episode.answer_fault
        )
    assert (scored[-1].stop_reason, scored[-1].reward, scored[-1].success) == ("eos", 1.0, True)


class Raising:
    """An environment whose step raises what ``kind`` names (synchronous methods)."""

    turns, owns_reward = "all", True

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def reset(self, sample: Sample) -> list[dict[str, str]]:
        return sample.messages

    def step(self, text: str, messages: list[dict[str, str]]) -> Any:
        del text, messages
        raise not_an_exception(self.kind)

    def close(self) -> None:
        pass


class AsyncRaising(Raising):
    """The same, async."""

    async def reset(self, sample: Sample) -> list[dict[str, str]]:  # type: ignore[override]
        return sample.messages

    async def step(self, text: str, messages: list[dict[str, str]]) -> Any:
        del text, messages
        raise not_an_exception(self.kind)

    async def close(self) -> None:  # type: ignore[override]
        pass


@tool
def parse(kind: str) -> str:
    """A tool that reads its arguments as a command line (argparse exits on bad ones).

    Args:
        kind: what to raise.
    """
    raise not_an_exception(kind)


@tool(name="parse_async")
async def parse_async(kind: str) -> str:
    """The same, async.

    Args:
        kind: what to raise.
    """
    raise not_an_exception(kind)


@pytest.mark.parametrize("kind", list(RAISED))
@pytest.mark.parametrize("style", ["sync", "async"])
def test_an_environment_or_tool_raising_what_is_not_an_exception_fails_only_its_call(
    kind: str, style: str
) -> None:
    """Before: from a thread (sync) it reached the episode as it was, and in an async call's
    task a SystemExit or KeyboardInterrupt ended the event loop itself: the whole run."""
    env_class = Raising if style == "sync" else AsyncRaising
    tool_name = "parse" if style == "sync" else "parse_async"

    async def go() -> tuple[str, str]:
        envs = Environments({"raising": lambda _: env_class(kind)}, step_timeout_s=60)
        sample = Sample("s", [{"role": "user", "content": "x"}], "1", env_class="raising")
        env = envs.make(sample)
        assert env is not None
        await env.reset(sample)
        with pytest.raises(EnvError) as raised:
            await env.step("go", [])
        tools = LocalTools(ToolRegistry([parse, parse_async]))
        result = await tools.call("t", tool_name, {"kind": kind})
        assert result.error
        return str(raised.value), result.text

    env_error, tool_text = asyncio.run(go())
    assert env_error == f"raising.step raised RuntimeError: the call raised {RAISED[kind]}"
    assert tool_text == f"error: {tool_name} failed: RuntimeError: the call raised {RAISED[kind]}"


SKYRL_ENV = """
class FunctionTimedOut(BaseException):
    pass


class GivingUp:  # a skyrl-gym environment whose step gives up (func_timeout's exception)
    def __init__(self, env_config=None, extras={}):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        raise FunctionTimedOut("func_timeout gave up after 5 seconds")

    def close(self):
        pass
"""


def test_a_skyrl_environment_raising_what_is_not_an_exception_is_named(tmp_path: Path) -> None:
    (tmp_path / "giving_up.py").write_text(SKYRL_ENV)
    section = EnvSection(classes={"giving_up": f"{tmp_path / 'giving_up.py'}:GivingUp"})
    envs = make_environments(section, 1)
    sample = Sample("s", [{"role": "user", "content": "go"}], "1", env_class="giving_up")

    async def go() -> str:
        env = envs.make(sample)
        assert env is not None
        await env.reset(sample)
        try:
            with pytest.raises(EnvError) as raised:
                await env.step("7", [])
        finally:
            await env.close()
        return str(raised.value)

    said = f"giving_up.step raised RuntimeError: the call raised {RAISED['timed_out']}"
    assert asyncio.run(go()) == said  # (before: "its process died (exit 1): out of memory...")


async def raising_harness(task: HarnessTask) -> None:
    """A harness (an agent framework) that raises what the prompt names."""
    raise not_an_exception(task.messages[-1]["content"])


@pytest.mark.parametrize("kind", list(RAISED))
def test_a_harness_raising_what_is_not_an_exception_ends_its_episode(
    tokenizer: Tokenizer, backend: EmbeddedBackend, kind: str
) -> None:
    config = AgentConfig(harness=f"{HERE}:raising_harness")
    tools = LocalTools(ToolRegistry([]))

    async def go() -> Trajectory:
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample("h", [{"role": "user", "content": kind}], "4", agent_name="openai_agent")
        return await run_sample(sample, ctx)

    traj = asyncio.run(go())
    assert traj.stop_reason == "harness_error" and not traj.trainable
    assert f"RuntimeError: the call raised {RAISED[kind]}" in str(traj.error)
