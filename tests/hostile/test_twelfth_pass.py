"""Twelfth pass: attacks on what a policy or a user controls, kept as regression tests.

- What user code raises that is not an `Exception` ended the whole run, or cancelled its step:
  func_timeout's ``FunctionTimedOut`` (a `BaseException`, which a reward or a tool that wraps
  its work in ``func_timeout`` raises on an answer it gave up on: the policy's answer chose
  it), a ``KeyboardInterrupt`` or asyncio ``CancelledError`` the code raised itself, and, in a
  task of its own (an async tool's call, an async environment method), a ``SystemExit``
  (argparse reading a policy's arguments), which asyncio re-raises out of the event loop. A
  reward function's in its worker process reached the step as it was; a synchronous tool's or
  environment's from its thread too. Each is now the call's error, as a `RuntimeError`
  naming it (`call_threads.carried`, `call_threads.own_errors`): a reward error, an
  environment error, a tool's error result the model reads, a harness error; the episode's own
  cancellation still passes on. A skyrl-gym environment's in its own process ended that
  process, its episode's error saying it died "out of memory ..., or broken"; it names what
  was raised now.
- Synchronous tools share one pool of 32 threads (`TOOL_THREADS`), and a call past its timeout
  keeps its thread until it returns. One episode's calls that hang a tool for good (a query
  that runs for ever: sqlite has no timeout), 4 turns of 8, held all 32, and from then on every
  sibling's call of every synchronous tool timed out waiting for a thread (a sibling's lower
  reward is the episode's advantage). A trajectory's calls now hold at most 4 threads
  (`TOOL_THREADS_PER_TRAJECTORY`), those abandoned included.
- ``model.lora.rank=1000000000000`` (a typo) passed every check and ended ``jarl train`` in a
  traceback allocating 1.5 PB; an adapter's rank past its projection's smaller side adds
  parameters and no function (A B's rank is at most min(in, out)), so it is refused, naming
  the projection and the largest rank that fits (the config check says it as a line).
- A hostile PEFT adapter folder (`load_peft`): ``r: 4.9`` loaded as rank 4 and ``r: true`` as
  1, NaN or infinite adapters loaded silently (every logit of their layers NaN), integer
  tensors were cast; a malformed config (not JSON, a list, ``r: "abc"``, a missing key, a
  nested list of targets) and a file that is no safetensors file raised JSONDecodeError,
  AttributeError, ValueError, KeyError, TypeError or SafetensorError without naming the file.
  Each is a `CheckpointError` naming the file, the header checked before any tensor is read
  (as for a base checkpoint: `checkpoint.stored_tensors`).
- A tool's result whose reward or flags were NumPy's (``np.float32(...)``, the ``bool_`` of
  ``np.isclose``: a careful user's grader) did not serialize: on the tool server, the answer to
  a batch of several trajectories' calls (calls made in one event-loop tick share one
  ``/execute_batch`` request) broke off at it, and every sibling's call in that batch raised
  `ToolTransportError`, ending its episode ``tool_error``. The executor now hands on plain
  values (a float reward, bool flags), and a result that is no `ToolResult`, or whose text is
  no string, is the call's error result.
- Calls made in one event-loop tick share one ``/execute_batch`` request of up to 32 calls,
  whatever their size: ten calls of 1 MB each (a file a tool writes), each well within the
  server's bound on a body (8 MiB), made a body over it, which the server cut off as it came,
  and the client read a broken connection, not the 413 it splits a batch on: every call of
  the batch, siblings' too, raised `ToolTransportError` (tool_error). A batch now carries at
  most `BATCH_BYTES` (1 MiB) of calls, a longer call going alone.
- A harness that retries every failed request (a careful user's loop: ask again until the
  model says it is done) once the episode had ended at a budget was answered 409 for ever, and
  its episode, and with it the step, never ended (4,440 requests in 60 s). Once the episode
  has ended, the harness has nothing left to do: its next request (or ``run_tool``) has it
  cancelled (`call_threads.until_set`), the episode keeping its stop reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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
from jax_agent_rl.models import ModelConfig, init_params
from jax_agent_rl.models.adapters import add_lora, load_peft, save_peft
from jax_agent_rl.models.checkpoint import CheckpointError
from jax_agent_rl.models.config_checks import UnsupportedConfigError
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rewards import make_reward
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization import (
    Tokenizer,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.base import TOOL_THREADS_PER_TRAJECTORY, ToolResult, tool
from jax_agent_rl.tools.client import BATCH_BYTES, HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.train.step import score_episodes
from tests.tools.test_server import serving

HERE = "tests.hostile.test_twelfth_pass"


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
        # `test_thirteenth_pass`; the thirteenth pass ended these reward_error, untrained)
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


BOUND_S = 30.0  # how long a wait on a thread's event may take (the test fails past it)
_QUERY: dict[str, Any] = {"gate": threading.Event(), "entered": 0, "lock": threading.Lock()}
_ALL_ENTERED = threading.Event()  # the hostile episode's calls holding threads all entered


@tool
def query(sql: str) -> str:
    """Runs a query on the task's database.

    Args:
        sql: the query.
    """
    if "RECURSIVE" in sql:  # the policy's query that runs for ever (until the test's end)
        with _QUERY["lock"]:
            _QUERY["entered"] += 1
            if _QUERY["entered"] == TOOL_THREADS_PER_TRAJECTORY:
                _ALL_ENTERED.set()
        _QUERY["gate"].wait(2 * BOUND_S)
    return "1 row"


def test_one_episodes_stuck_tool_calls_leave_its_siblings_threads() -> None:
    hostile = LocalTools(ToolRegistry([query]), timeout_s=0.01)  # (its calls time out at once)
    honest = LocalTools(ToolRegistry([query]), timeout_s=BOUND_S)

    async def go() -> tuple[list[str], str]:
        turn = asyncio.Semaphore(4)  # (agent.max_parallel_tool_calls)

        async def stuck() -> str:
            async with turn:
                return (await hostile.call("evil/s1a0/0", "query", {"sql": "WITH RECURSIVE"})).text

        texts = [t for _ in range(4) for t in await asyncio.gather(*(stuck() for _ in range(8)))]
        sibling = await honest.call("fine/s1a0/1", "query", {"sql": "SELECT 1"})
        return texts, sibling.text

    try:
        texts, sibling = asyncio.run(go())
        assert _ALL_ENTERED.wait(BOUND_S)
        assert texts == ["error: query timed out after 0.01s"] * 32
        assert sibling == "1 row"  # (before: it timed out waiting for a thread)
        assert _QUERY["entered"] == TOOL_THREADS_PER_TRAJECTORY  # (before: 32)
    finally:
        _QUERY["gate"].set()


TINY = ModelConfig(
    family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


def test_a_lora_rank_past_a_projections_smaller_side_is_refused() -> None:
    fits = dataclasses.replace(TINY, lora=Lora(16, 8.0))  # (k, v: in 32, out 16)
    assert fits.lora is not None and fits.lora.rank == 16
    assert dataclasses.replace(TINY, lora=Lora(32, 8.0, ("q", "o"))).lora is not None
    side = r"k projection's smaller side \(in 32, out 16\).*use a rank <= 16$"
    for rank in (17, 10**12):
        with pytest.raises(UnsupportedConfigError, match=rf"^LoRA rank={rank} exceeds the {side}"):
            dataclasses.replace(TINY, lora=Lora(rank, 8.0))


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter folder of rank 4 on q and v of `TINY`, as `save_peft` writes it."""
    cfg, w = add_lora(
        jax.random.key(1),
        TINY,
        init_params(jax.random.key(0), TINY, sharder=one_device_sharder()),
        Lora(4, 8.0, ("q", "v")),
    )
    return save_peft(tmp_path_factory.mktemp("peft") / "adapter", cfg, w)


HOSTILE_PEFT: dict[str, tuple[Any, str]] = {
    # name: (a change to the folder, what the error says after the file's name)
    "r-not-a-number": ({"r": "abc"}, r"adapter_config.json: r='abc': expected a whole number"),
    "r-a-fraction": ({"r": 4.9}, r"adapter_config.json: r=4.9: expected a whole number"),
    "r-a-bool": ({"r": True}, r"adapter_config.json: r=True: expected a whole number"),
    "r-missing": ({"r": None}, r"adapter_config.json: r=None: expected a whole number"),
    "r-huge": ({"r": 10**12}, r"adapter_config.json: LoRA rank=1000000000000 exceeds the v "),
    "alpha-a-list": ({"lora_alpha": [8]}, r"adapter_config.json: lora_alpha=\[8\]: expected a "),
    "targets-nested": ({"target_modules": [["q_proj"]]}, r"adapter_config.json: target_modules="),
    "config-a-list": (b"[1, 2]", r"adapter_config.json is not a JSON object"),
    "config-not-json": (b"{r: 4", r"adapter_config.json is not JSON: "),
    "weights-nan": (np.nan, r"adapter_model.safetensors: tensor '.*' holds values not finite"),
    "weights-inf": (-np.inf, r"adapter_model.safetensors: tensor '.*' holds values not finite"),
    "weights-1e30": (1e30, r"adapter_model.safetensors: tensor '.*' holds values past 10000 "),
    "weights-int": (np.int64, r"adapter_model.safetensors: tensor '.*' is stored as 'I64'"),
    # read as if absent: adapters applied where PEFT applies none, biases and targets dropped
    "exclude-modules": ({"exclude_modules": ["q_proj"]}, r"adapter_config.json: exclude_modules"),
    "lora-bias": ({"lora_bias": True}, r"adapter_config.json: lora_bias=True is not supported"),
    "target-parameters": (
        {"target_parameters": ["mlp.experts.gate_up_proj"]},
        r"adapter_config.json: target_parameters=",
    ),
    "weights-garbage": (b"\x08" + bytes(7) + b'{"a":1}', r"adapter_model.safetensors is not a "),
}


@pytest.mark.parametrize("case", list(HOSTILE_PEFT))
def test_a_hostile_peft_folder_is_a_checkpoint_error_naming_its_file(
    peft_folder: Path, tmp_path: Path, case: str
) -> None:
    change, said = HOSTILE_PEFT[case]
    folder = tmp_path / "adapter"
    shutil.copytree(peft_folder, folder)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if isinstance(change, dict):
        config = json.loads(config_file.read_text())
        config.update(change)
        config_file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    elif isinstance(change, bytes):
        (config_file if case.startswith("config") else weights).write_bytes(change)
    else:
        tensors = load_file(str(weights))
        changed = {
            k: v.astype(change) if isinstance(change, type) else np.full_like(v, change)
            for k, v in tensors.items()
        }
        save_file(changed, str(weights))
    with pytest.raises(CheckpointError, match=f"^{folder}/{said}"):
        load_peft(folder, TINY)
    assert load_peft(peft_folder, TINY)[0].lora == Lora(4, 8.0, ("q", "v"))  # (the folder: fine)


@tool
def grade(answer: str) -> Any:
    """Grades an answer with NumPy, as a careful user's grader does; other answers name a
    malformed result.

    Args:
        answer: the answer.
    """
    malformed = {"bytes": ToolResult(b"graded"), "text-reward": ToolResult("graded", "1"),
                 "string-flag": ToolResult("graded", done="yes")}  # type: ignore[arg-type]  # fmt: skip
    if answer in malformed:
        return malformed[answer]
    right = np.isclose(float(answer), 4.0)
    return ToolResult("graded", reward=np.float32(right), done=right)


@tool
def echo(text: str) -> str:
    """Echoes the text.

    Args:
        text: what to echo.
    """
    return text


def test_a_tools_numpy_result_leaves_its_batchs_sibling_calls_alone() -> None:
    async def go() -> list[ToolResult]:
        async with serving(create_app(ToolRegistry([grade, echo]), token="t")) as url:
            client = HttpTools(url, token="t")
            try:  # (made in one tick: one /execute_batch request)
                return list(
                    await asyncio.gather(
                        client.call("graded/s1a0/0", "grade", {"answer": "4"}),
                        *(client.call(f"sib/s1a0/{i}", "echo", {"text": "hi"}) for i in (1, 2)),
                    )
                )
            finally:
                await client.close()

    graded, *siblings = asyncio.run(go())  # (before: ToolTransportError, every one)
    assert graded == ToolResult("graded", 1.0, True, False)
    assert type(graded.reward) is float and type(graded.done) is bool
    assert siblings == [ToolResult("hi")] * 2


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ("bytes", "text that is a bytes, not a string"),
        ("text-reward", "a reward that is a str, not a number"),
        ("string-flag", "done and error flags of types ['str', 'bool'], not bools"),
    ],
)
def test_a_malformed_tool_result_is_the_calls_error(answer: str, said: str) -> None:
    tools = LocalTools(ToolRegistry([grade]))
    result = asyncio.run(tools.call("t", "grade", {"answer": answer}))
    assert result == ToolResult(f"error: grade returned {said}", error=True)


def test_long_calls_made_together_are_not_sent_as_one_body_over_the_servers_bound() -> None:
    long_text = "a" * 1_000_000  # (10 of them: 10 MB, over the server's 8 MiB bound)
    assert len(long_text) < BATCH_BYTES  # (a batch holds each: they go one a batch)

    async def go() -> list[ToolResult]:
        async with serving(create_app(ToolRegistry([echo]), token="t")) as url:
            client = HttpTools(url, token="t")
            try:  # (made in one tick)
                return list(
                    await asyncio.gather(
                        *(client.call(f"w/{i}", "echo", {"text": long_text}) for i in range(10)),
                        *(client.call(f"sib/s1a0/{i}", "echo", {"text": "hi"}) for i in range(2)),
                    )
                )
            finally:
                await client.close()

    results = asyncio.run(go())  # (before: ToolTransportError, every one)
    assert results == [ToolResult(long_text)] * 10 + [ToolResult("hi")] * 2


_ASKED: list[int] = []  # the statuses the retrying harness got
_STOPPED: list[bool] = []  # it was cancelled


async def retrying_harness(task: HarnessTask) -> None:
    """Asks until the model says FINAL, asking again after any error (for ever)."""
    messages = list(task.messages)
    headers = {"Authorization": f"Bearer {task.api_key}"}
    try:
        # (no client timeout: on a loaded machine a reply takes what it takes, and httpx's
        # 5 s default ended the harness with a ReadTimeout; the test bounds the episode)
        async with httpx.AsyncClient(timeout=None) as client:
            while True:
                body = {"messages": messages, "model": "m"}
                url = f"{task.base_url}/chat/completions"
                r = await client.post(url, json=body, headers=headers)
                _ASKED.append(r.status_code)
                if r.status_code != 200:
                    continue  # (again, whatever went wrong)
                said = r.json()["choices"][0]["message"]["content"]
                if "FINAL" in said:
                    return
                messages.append({"role": "assistant", "content": said})
                messages.append({"role": "user", "content": "Go on; say FINAL when done."})
    except asyncio.CancelledError:
        _STOPPED.append(True)
        raise


def test_a_harness_that_asks_on_after_its_episode_ended_is_stopped(
    tokenizer: Tokenizer, backend: EmbeddedBackend
) -> None:
    config = AgentConfig(
        harness=f"{HERE}:retrying_harness", max_turns=1, max_tokens_per_turn=1, max_model_len=256
    )  # (one turn of one token: no call, so the episode ends at a budget)

    async def go() -> Trajectory:
        tools = LocalTools(ToolRegistry([]))
        ctx = await AgentContext.create(backend, tokenizer, tools, make_parser("hermes"), config)
        sample = Sample("r", [{"role": "user", "content": "2+2?"}], "4", agent_name="openai_agent")
        return await asyncio.wait_for(run_sample(sample, ctx), BOUND_S)  # (a bound on failing)

    traj = asyncio.run(go())  # (before: it never returned)
    assert traj.stop_reason in ("max_tokens_per_turn", "max_turns")
    assert _ASKED[0] == 200 and set(_ASKED[1:]) <= {409}  # (stopped as its request was refused)
    assert _STOPPED == [True]
