"""The OpenAI-compatible endpoint (agent_name openai_agent) on the real embedded engine, with the
tiny model `tests.agent.test_loop` memorises, driven by harnesses written against OpenAI's API:
the official ``openai`` client and LangChain's ``ChatOpenAI``. Their trajectories are token for
token those of `run_tool_agent` for the same seeds; a rewrite of an earlier turn starts a new
sample (tests/agent/test_rewritten_contexts.py: compaction, stripped thinking, sub-agents);
malformed requests end their own session's episode (harness_error before a model turn,
caused_error after one; counted) and nothing else.
"""

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_openai import ChatOpenAI

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.endpoint_http import Limits
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask, Session, serve
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import ConfigError
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization.tool_calls import make_parser
from tests.agent.test_langgraph_loop import CAPPED, REFUSED, SAMPLED, _assert_same
from tests.agent.test_loop import CONFIG

pytestmark = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
HERE = "tests.agent.test_openai_endpoint"
QUESTION = "What is 17 + 25?"


async def openai_harness(task: HarnessTask) -> None:
    """A small agent on the official client: the model, then its calls, until it stops."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages: list[Any] = list(task.messages)
    while True:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=task.tools
        )
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return
        for call in choice.message.tool_calls or []:
            text = await task.run_tool(call.model_dump())
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})


async def langchain_harness(task: HarnessTask) -> None:
    """The same agent on LangChain's ChatOpenAI, with tool calls in LangChain's form."""
    llm = ChatOpenAI(
        model="policy", base_url=task.base_url, api_key=task.api_key, max_retries=0
    ).bind_tools(task.tools)
    messages: list[Any] = list(task.messages)
    while True:
        ai: BaseMessage = await llm.ainvoke(messages)
        messages.append(ai)
        calls = getattr(ai, "tool_calls", [])
        if not calls:
            return
        for c in calls:
            function = {"name": c["name"], "arguments": json.dumps(c["args"])}
            text = await task.run_tool({"id": c["id"], "function": function})
            messages.append(ToolMessage(text, tool_call_id=c["id"]))


async def rewriting_harness(task: HarnessTask) -> None:
    """Answers the first call, with the model's turn rewritten (its text and its call)."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="policy", messages=task.messages, tools=task.tools
    )
    message = reply.choices[0].message.model_dump(exclude_none=True)
    (call,) = message["tool_calls"]
    call["function"]["arguments"] = json.dumps({"expression": "1 + 1"})
    message["content"] = message["content"].replace("17 + 25", "1 + 1")
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "2"}
    await client.chat.completions.create(
        model="policy", messages=[*task.messages, message, tool], tools=task.tools
    )


async def raising_harness(task: HarnessTask) -> None:
    """Takes one model turn, then fails with a bug of its own."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=task.messages, tools=task.tools)
    raise KeyError("harness bug")


async def refused_first_harness(task: HarnessTask) -> None:
    """Its first request is refused (an assistant turn first); the client then raises."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "assistant", "content": "hi"}]
    )


async def _context(setup: dict[str, Any], config: AgentConfig, seed: int | None) -> AgentContext:
    backend = EmbeddedBackend(setup["engine"], setup["weights"])
    parser = make_parser(setup["parser"])
    return await AgentContext.create(
        backend, setup["tokenizer"], setup["tools"], parser, config, seed
    )


def _episode(
    setup: dict[str, Any], question: str, agent: str, config: AgentConfig, seed: int | None = None
) -> Trajectory:
    async def go() -> Trajectory:
        ctx = await _context(setup, config, seed)
        sample = Sample(
            uid=f"q{sorted(setup['expected']).index(question)}",
            messages=[{"role": "user", "content": question}],
            agent_name=agent,
        )
        traj = await run_sample(sample, ctx)
        await ctx.backend.close()
        return traj

    return asyncio.run(go())


def _harness(config: AgentConfig, name: str) -> AgentConfig:
    return dataclasses.replace(config, harness=f"{HERE}:{name}")


def test_openai_client_trajectories_are_the_tool_loops(setup: dict[str, Any]) -> None:
    """Every scripted episode greedily (tool calls, two at once, a malformed call, a truncated
    tool output), and one sampled with a seed: every field but the timings is the loop's."""
    config = _harness(CONFIG, "openai_harness")
    for question in setup["expected"]:
        loop = _episode(setup, question, "tool_agent", config)
        _assert_same(_episode(setup, question, "openai_agent", config), loop)
    sampled = _harness(SAMPLED, "openai_harness")
    loop = _episode(setup, QUESTION, "tool_agent", sampled, seed=7)
    _assert_same(_episode(setup, QUESTION, "openai_agent", sampled, seed=7), loop)


def test_langchain_chat_openai_drives_an_episode(setup: dict[str, Any]) -> None:
    config = _harness(CONFIG, "langchain_harness")
    for question in ("What is 17 + 25?", "Compute 3 + 4 and 6 * 7."):
        loop = _episode(setup, question, "tool_agent", config)
        traj = _episode(setup, question, "openai_agent", config)
        _assert_same(traj, loop)
        assert traj.stop_reason == "eos" and traj.tool_calls >= 1


def test_a_call_past_the_turn_cap_is_answered_by_the_endpoint(setup: dict[str, Any]) -> None:
    """Under agent.max_tool_calls_per_turn=1 the harness is given a two-call turn's first
    call only; the endpoint answers the second with the cap's error, as the loop does."""
    config = _harness(CAPPED, "openai_harness")
    question = "Compute 3 + 4 and 6 * 7."
    loop = _episode(setup, question, "tool_agent", config)
    _assert_same(_episode(setup, question, "openai_agent", config), loop)
    assert (loop.refused_calls, loop.malformed_calls) == (1, 0)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"][:2] == ["7", REFUSED]


def test_a_rewritten_turn_starts_a_new_sample(setup: dict[str, Any]) -> None:
    """A request whose messages rewrite the model's turn (its call's arguments) goes on with no
    conversation of the session's: its context, as the template renders it, starts a new
    sample; the turn as the model wrote it stays in the first, token for token."""
    traj = _episode(setup, QUESTION, "openai_agent", _harness(CONFIG, "rewriting_harness"))
    assert traj.error is None and traj.trainable and traj.num_samples == 2
    first, second = traj.train_sequences(0.0)
    loop = _episode(setup, QUESTION, "tool_agent", CONFIG)
    turn = loop.response_ids[: loop.loss_mask.index(0)]  # the model's first turn, its call
    assert first.prompt_ids == loop.prompt_ids and first.response_ids == turn
    assert first.loss_mask == [1] * len(turn)
    rewritten = setup["tokenizer"].decode(second.prompt_ids)
    said = setup["tokenizer"].decode(first.prompt_ids).count("17 + 25")  # (the question's)
    assert '"1 + 1"' in rewritten and rewritten.count("17 + 25") == said
    assert "<|im_end|><|im_end|>" not in rewritten  # its text is rendered without its eos
    assert (
        sum(second.loss_mask) > 0
        and second.prompt_ids[: len(first.prompt_ids) - 3] == (first.prompt_ids[:-3])
    )


def test_a_harness_that_raises_ends_with_harness_error(setup: dict[str, Any]) -> None:
    """An exception inside the harness is not the loop's: after a model turn reached the
    harness it is the policy's text's (caused_error: trained, outcome 0; nothing can tell it
    from a bug of the harness's, docs/harness.md), before one the harness's (harness_error);
    its traceback is kept; a harness whose first request was refused is not said to have never
    called the endpoint."""
    traj = _episode(setup, QUESTION, "openai_agent", _harness(CONFIG, "raising_harness"))
    assert traj.stop_reason == "caused_error" and traj.trainable
    assert traj.error is not None and "KeyError: 'harness bug'" in traj.error
    assert sum(traj.loss_mask) > 0  # the turn it took is kept
    refused = _episode(setup, QUESTION, "openai_agent", _harness(CONFIG, "refused_first_harness"))
    assert refused.stop_reason == "harness_error" and refused.error is not None
    assert "first request holds only system and user messages" in refused.error
    assert "never called the endpoint" not in refused.error


def _fresh(ctx: AgentContext, uid: str) -> Session:
    traj = Trajectory(uid=uid, group_id=uid, prompt_ids=[])
    traj.timings["tools_s"] = 0.0
    return Session(ctx, traj, {})


PROMPT = [{"role": "user", "content": QUESTION}]
MALFORMED: dict[str, Any] = {
    "not JSON": b"{not json",
    "no messages": {"model": "policy"},
    "a wrong role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "garbage content": {"messages": [{"role": "user", "content": {"x": [1, 2]}}]},
    "an assistant turn first": {"messages": [{"role": "assistant", "content": "hi"}]},
    "a sampling field": {"messages": PROMPT, "temperature": 0.3},
    "a huge body": {"messages": [{"role": "user", "content": "x" * 5000}]},
}


def test_malformed_requests_end_only_their_session(setup: dict[str, Any]) -> None:
    """Each malformed request ends its own session (400, or 413 for a body over the limit:
    harness_error) and later requests of it are refused (409); an unknown key ends nothing
    (401); a session served beside them, driven by the official client meanwhile, records the
    tool loop's trajectory."""
    sample = Sample(uid="q0", messages=PROMPT)  # the uid the loop's episode has

    async def go() -> tuple[dict[str, Session], Trajectory, list[str]]:
        ctx = await _context(setup, CONFIG, None)
        sessions = {name: _fresh(ctx, f"bad-{i}") for i, name in enumerate(MALFORMED)}
        sessions["good"] = _fresh(ctx, sample.uid)
        statuses: list[str] = []
        limits = Limits(max_body_bytes=4096)
        async with (
            serve(sessions, limits) as base_url,
            httpx.AsyncClient(base_url=base_url) as http,
        ):

            async def misbehave(name: str, body: Any) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                headers = {"X-Session-Id": name, "Content-Type": "application/json"}
                r = await http.post("/chat/completions", content=raw, headers=headers)
                again = await http.post(
                    "/chat/completions", json={"messages": PROMPT}, headers=headers
                )
                statuses.append(f"{name}: {r.status_code} {again.status_code}")

            unknown = await http.post(
                "/chat/completions",
                json={"messages": PROMPT},
                headers={"Authorization": "Bearer nobody"},
            )
            assert unknown.status_code == 401 and "no open session" in unknown.text
            good = openai_harness(
                HarnessTask(
                    base_url,
                    "good",
                    PROMPT,
                    list(ctx.builder.tools or []),
                    sessions["good"].run_tool,
                )
            )
            await asyncio.gather(good, *(misbehave(n, b) for n, b in MALFORMED.items()))
        await ctx.backend.close()
        return sessions, sessions["good"].traj, statuses

    sessions, good, statuses = asyncio.run(go())
    want = {name: 413 if name == "a huge body" else 400 for name in MALFORMED}
    assert sorted(statuses) == sorted(f"{name}: {status} 409" for name, status in want.items())
    for name in MALFORMED:
        session = sessions[name]
        assert session.stop == "harness_error" and session.traj.loss_mask == [], name
        assert session.traj.error is not None and session.traj.error.startswith("harness error")
    good.stop_reason = sessions["good"].finish()
    loop = _episode(setup, QUESTION, "tool_agent", CONFIG)
    assert good.prompt_ids + good.response_ids == loop.prompt_ids + loop.response_ids
    assert good.loss_mask == loop.loss_mask and good.rollout_logprobs == loop.rollout_logprobs
    assert good.stop_reason == "eos"


def test_a_harness_is_checked_when_the_context_is_made(setup: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"agent\.harness=.*no function 'no_such_harness'"):
        asyncio.run(_context(setup, _harness(CONFIG, "no_such_harness"), None))
