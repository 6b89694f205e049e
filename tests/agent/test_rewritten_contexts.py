"""Agents that do not only append, on the real embedded engine with the memorised tiny model:
harnesses behind the OpenAI-compatible endpoint (one that compacts its context every 3 model
turns, one that strips the thinking of its earlier turns, one that asks a sub-agent in a
context of its own), a LangGraph graph that compacts, and the tool loop's own rewrites
(``agent.context.compact``, ``agent.context.strip_thinking``). Each model call whose prompt
extends none of the episode's sequences starts a new sample; every trained token of every
sample is the token the engine sampled, at the position it was sampled from, with its logprob
(`assert_samples_exact`, against the requests the engine served).
"""

import asyncio
import dataclasses
import re
from typing import Any

import openai
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.loop import call_tools, model_turn, run_sample
from jax_agent_rl.agent.openai_endpoint import HarnessTask
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config.sections import ContextSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rl.batch import turn_spans
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult
from jax_agent_rl.tokenization.tool_calls import ParsedCall, make_parser
from tests.agent.test_langgraph_loop import _episode as graph_episode
from tests.agent.test_loop import CONFIG, Recording

HERE = "tests.agent.test_rewritten_contexts"
QUESTION = "What is 17 + 25?"
# room for the turns a compacting harness takes (the memorised model answers in two)
LONG = dataclasses.replace(CONFIG, max_turns=12)


def assert_samples_exact(traj: Trajectory, log: list[tuple[GenerateRequest, GenerateResult]]):
    """Each sampled run of each sample is what requests whose prompt was exactly the sample's
    sequence before it sampled, with their logprobs; nothing else has mask 1 or a logprob, and
    every token the engine sampled is in exactly one sample."""
    served: dict[tuple[int, ...], list[GenerateResult]] = {}
    for request, result in log:
        served.setdefault(tuple(request.prompt_ids), []).append(result)
    trained = 0
    for row in traj.train_sequences(0.0):
        seq, P = row.prompt_ids + row.response_ids, len(row.prompt_ids)
        assert len(row.response_ids) == len(row.loss_mask) == len(row.rollout_logprobs)
        for a, b in turn_spans(row.loss_mask):
            at = a
            while at < b:  # (a turn may be several requests: an inline block continued)
                result = served[tuple(seq[: P + at])].pop(0)
                n = len(result.token_ids)
                assert row.response_ids[at : at + n] == list(result.token_ids), row.uid
                assert row.rollout_logprobs[at : at + n] == list(result.logprobs or ()), row.uid
                at += n
            assert at == b, row.uid
            trained += b - a
        off = [lp for lp, m in zip(row.rollout_logprobs, row.loss_mask, strict=True) if not m]
        assert not any(off), row.uid
    assert trained == sum(len(r.token_ids) for _, r in log) > 0


def _episode(
    setup: dict[str, Any], harness: str, config: AgentConfig = LONG
) -> tuple[Trajectory, Recording]:
    """The episode of `QUESTION` the harness ``harness`` plays (openai_agent), or with none
    the tool loop (tool_agent), and the requests the engine served."""
    backend = Recording(EmbeddedBackend(setup["engine"], setup["weights"]))
    if harness:
        config = dataclasses.replace(config, harness=f"{HERE}:{harness}")

    async def go() -> Trajectory:
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), config
        )
        sample = Sample(
            uid=f"q{sorted(setup['expected']).index(QUESTION)}",
            messages=[{"role": "user", "content": QUESTION}],
            agent_name="openai_agent" if harness else "tool_agent",
        )
        traj = await run_sample(sample, ctx)
        await backend.close()
        return traj

    return asyncio.run(go()), backend


async def converse(
    task: HarnessTask, client: openai.AsyncOpenAI, messages: list[Any]
) -> tuple[list[Any], str]:
    """One model turn on ``messages`` and the calls it made run (`HarnessTask.run_tool`): the
    messages after it, and its finish reason."""
    reply = await client.chat.completions.create(
        model="policy", messages=messages, tools=task.tools
    )
    choice = reply.choices[0]
    messages = [*messages, choice.message.model_dump(exclude_none=True)]
    for call in choice.message.tool_calls or []:
        text = await task.run_tool(call.model_dump())
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return messages, str(choice.finish_reason)


def _client(task: HarnessTask) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)


COMPACTED_AFTER = 3  # model turns


async def compacting_harness(task: HarnessTask) -> None:
    """Seven model turns: after each answer without calls it asks the question again; every
    3 turns it drops its history for the task and a note of the model's last words."""
    client = _client(task)
    messages: list[Any] = list(task.messages)
    for turn in range(1, 8):
        messages, finish = await converse(task, client, messages)
        if finish == "length":
            return
        if turn % COMPACTED_AFTER == 0:
            last = next(m for m in reversed(messages) if m["role"] == "assistant")
            note = re.sub(r"<[^>]*>", "", last["content"] or "")[:60]
            messages = [*task.messages, {"role": "user", "content": f"Notes: {note} {QUESTION}"}]
        elif messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": QUESTION})


async def thinking_stripping_harness(task: HarnessTask) -> None:
    """The tool loop, but each request carries the earlier assistant turns without their
    ``<think>...</think>`` (as templates that drop earlier reasoning render them)."""
    client = _client(task)
    messages: list[Any] = list(task.messages)
    finish = "tool_calls"
    while finish == "tool_calls":
        messages, finish = await converse(task, client, messages)
        messages = [
            {**m, "content": re.sub(r"<think>.*?</think>", "", m["content"], flags=re.S)}
            if m["role"] == "assistant"
            else m
            for m in messages
        ]


async def delegating_harness(task: HarnessTask) -> None:
    """The model's first call is answered by a sub-agent: a conversation of its own on the
    same question, whose final answer is the tool message; then the model goes on."""
    client = _client(task)
    reply = await client.chat.completions.create(
        model="policy", messages=task.messages, tools=task.tools
    )
    message = reply.choices[0].message.model_dump(exclude_none=True)
    (call,) = message["tool_calls"]
    sub: list[Any] = [{"role": "user", "content": QUESTION}]
    finish = "tool_calls"
    while finish == "tool_calls":
        sub, finish = await converse(task, client, sub)
    answer = {"role": "tool", "tool_call_id": call["id"], "content": sub[-1]["content"]}
    await converse(task, client, [*task.messages, message, answer])


async def restarting_harness(task: HarnessTask) -> None:
    """Asks the question afresh at every request, whatever the model answered, until a
    budget ends the episode."""
    client = _client(task)
    finish = ""
    while finish != "length":
        reply = await client.chat.completions.create(
            model="policy", messages=task.messages, tools=task.tools
        )
        finish = str(reply.choices[0].finish_reason)


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_the_response_budget_spans_every_sample(setup: dict[str, Any]) -> None:
    """A harness that starts a new context at every request still meets
    agent.max_response_tokens: it bounds the episode's tokens over all its samples."""
    config = dataclasses.replace(LONG, max_response_tokens=60)
    traj, backend = _episode(setup, "restarting_harness", config)
    assert traj.stop_reason == "max_response_tokens" and traj.num_samples >= 2
    assert traj.response_tokens <= 60 and traj.num_turns < config.max_turns
    assert_samples_exact(traj, backend.log)


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_harness_that_compacts_every_3_turns_trains_each_context_exactly(
    setup: dict[str, Any],
) -> None:
    traj, backend = _episode(setup, "compacting_harness")
    assert traj.error is None and traj.trainable, traj.error
    assert traj.num_turns == 7 and traj.num_samples == 3  # turns 1-3, 4-6, 7
    assert_samples_exact(traj, backend.log)
    rows = traj.train_sequences(1.0)
    assert [sum(1 for _ in turn_spans(r.loss_mask)) for r in rows] == [3, 3, 1]
    # each compacted context starts from the task, then the note: not from the history
    prompt = rows[0].prompt_ids[:-3]  # (the generation prompt follows the question)
    for row in rows[1:]:
        assert row.prompt_ids[: len(prompt)] == prompt
        assert len(row.prompt_ids) < len(rows[0].prompt_ids) + len(rows[0].response_ids)


@pytest.mark.parametrize("setup", ["qwen3"], indirect=True)
def test_a_harness_that_strips_earlier_thinking_trains_each_context_exactly(
    setup: dict[str, Any],
) -> None:
    traj, backend = _episode(setup, "thinking_stripping_harness")
    assert traj.error is None and traj.trainable, traj.error
    # the first turn thinks; the turns after it read it stripped: one new sample
    assert traj.num_samples == 2 and traj.num_turns >= 2
    assert_samples_exact(traj, backend.log)
    first, second = traj.train_sequences(1.0)
    think = setup["tokenizer"].decode(first.response_ids)
    assert "<think>" in think
    assert "<think>" not in setup["tokenizer"].decode(second.prompt_ids)


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_harness_that_calls_a_sub_agent_trains_both_contexts_exactly(
    setup: dict[str, Any],
) -> None:
    """The parent's sample goes on after the sub-agent's: two samples, the parent's holding
    its two turns around the sub-agent's answer."""
    traj, backend = _episode(setup, "delegating_harness")
    assert traj.error is None and traj.trainable, traj.error
    assert traj.num_samples == 2 and traj.num_turns == 4 and traj.sample == 0
    assert_samples_exact(traj, backend.log)
    parent, sub = traj.train_sequences(1.0)
    assert (parent.uid, sub.uid) == ("q3", "q3@1")
    assert [len(turn_spans(r.loss_mask)) for r in (parent, sub)] == [2, 2]
    assert parent.prompt_ids == sub.prompt_ids  # the same question, asked afresh
    assert "<answer>42</answer>" in setup["tokenizer"].decode(sub.response_ids)


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_built_in_compaction_summarises_in_a_sample_and_goes_on_from_the_summary(
    setup: dict[str, Any],
) -> None:
    """Past 290 tokens of context (the prompt is about 270) the loop asks for a summary: the
    summary turn is a sample of its own, from the conversation and the request for it, and
    the episode goes on from the prompt and the summary; all token for token."""
    context = ContextSection(compact=290)
    traj, backend = _episode(setup, "", dataclasses.replace(LONG, context=context))
    assert traj.error is None and traj.trainable, traj.error
    assert_samples_exact(traj, backend.log)
    rows = traj.train_sequences(1.0)
    assert len(rows) >= 3
    first, summary, after = rows[:3]
    decode = setup["tokenizer"].decode
    asked = decode(summary.prompt_ids)
    assert context.compact_prompt in asked and QUESTION in asked
    assert len(first.prompt_ids) + len(first.response_ids) >= context.compact
    told = decode(after.prompt_ids)
    said = decode(summary.response_ids).removesuffix("<|im_end|>")
    assert context.summary_prefix + said in told and context.compact_prompt not in told
    assert len(turn_spans(summary.loss_mask)) == 1  # the summary turn alone


@pytest.mark.parametrize("setup", ["qwen3"], indirect=True)
def test_built_in_thinking_stripping_renders_the_context_again_without_it(
    setup: dict[str, Any],
) -> None:
    config = dataclasses.replace(LONG, context=ContextSection(strip_thinking=True))
    traj, backend = _episode(setup, "", config)
    assert traj.error is None and traj.trainable, traj.error
    assert_samples_exact(traj, backend.log)
    first, second = traj.train_sequences(1.0)[:2]
    decode = setup["tokenizer"].decode
    assert "<think>" in decode(first.response_ids)
    assert "<think>" not in decode(second.prompt_ids) and "17 + 25" in decode(second.prompt_ids)
    # without the setting the same episode is the one sample it always was
    plain, _ = _episode(setup, "", LONG)
    assert plain.num_samples == 1 and plain.train_sequences(1.0)[0].uid == plain.uid


def compacting_graph(model: BaseChatModel, tools: list[BaseTool]) -> Any:
    """LangGraph's ReAct graph, but each model call after tool results reads the question and
    a note of the results only: the conversation compacted."""
    bound = model.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        messages = state["messages"]
        if isinstance(messages[-1], ToolMessage):
            notes = "; ".join(str(m.text) for m in messages if isinstance(m, ToolMessage))
            messages = [messages[0], HumanMessage(f"Notes: {notes}")]
        return {"messages": [await bound.ainvoke(messages)]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_a_graph_that_compacts_trains_each_context_exactly(setup: dict[str, Any]) -> None:
    """react_agent with a graph that passes the model its compacted conversation: a new
    sample from it (before: an error that ended the episode)."""
    config = dataclasses.replace(LONG, graph=f"{HERE}:compacting_graph")
    traj, backend = graph_episode(setup, QUESTION, "react_agent", config)
    assert traj.error is None and traj.trainable, traj.error
    assert traj.num_samples >= 2
    assert_samples_exact(traj, backend.log)
    second = traj.train_sequences(1.0)[1]
    told = setup["tokenizer"].decode(second.prompt_ids)
    assert "Notes: 42" in told and "<tool_call>" not in told.split(QUESTION)[-1]


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)
def test_the_sub_agent_tool_plays_a_context_of_its_own_and_the_parent_goes_on(
    setup: dict[str, Any],
) -> None:
    """agent.sub_agent_tool: the parent's prompt lists it; a turn's call of it runs the
    policy on the task in a new sample (its prompt the tool loop's for that question), and
    the parent's sample is current again when its answer comes back as the result."""
    config = dataclasses.replace(LONG, sub_agent_tool="delegate")
    backend = Recording(EmbeddedBackend(setup["engine"], setup["weights"]))
    parser = make_parser(setup["parser"])

    async def go() -> tuple[Trajectory, list[Any], list[str]]:
        ctx = await AgentContext.create(backend, setup["tokenizer"], setup["tools"], parser, config)
        listed = [t["function"]["name"] for t in ctx.builder.tools or []]
        prompt = [{"role": "user", "content": "Echo hello."}]
        traj = Trajectory("p", "g", ctx.builder.prompt_ids(prompt), messages=prompt)
        await model_turn(ctx, traj)  # the parent's turn, whatever it wrote
        calls = [ParsedCall("delegate", {"task": QUESTION}), ParsedCall("delegate", {"task": 3})]
        results = await call_tools(ctx, traj, calls, {})
        with pytest.raises(ValueError, match=r"sub_agent_tool='calculator' names one of"):
            await AgentContext.create(
                backend,
                setup["tokenizer"],
                setup["tools"],
                parser,
                dataclasses.replace(config, sub_agent_tool="calculator"),
            )
        await backend.close()
        return traj, results, listed

    traj, (answer, bad), listed = asyncio.run(go())
    assert listed == ["calculator", "echo", "delegate"]
    assert answer.text == "The answer is <answer>42</answer>." and not answer.error
    assert bad.error and "takes" in bad.text
    assert traj.sample == 0 and traj.num_samples == 2
    assert_samples_exact(traj, backend.log)
    parent, sub = traj.train_sequences(1.0)
    ids, mask = setup["expected"][QUESTION]  # the tool loop's episode of the question
    assert sub.prompt_ids + sub.response_ids == ids
    assert [0] * len(sub.prompt_ids) + sub.loss_mask == mask
    assert parent.uid == "p" and sub.uid == "p@1" and len(turn_spans(parent.loss_mask)) == 1
