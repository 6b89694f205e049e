"""The LangGraph ReAct loop (agent_name react_agent) on the real embedded engine, with the tiny
model `tests.agent.test_loop` memorises: its trajectories are token-exact, and for the same
seeds token for token those of `run_tool_agent` (greedy and sampled, every budget, a tool that
ends the episode, a dead tool service); malformed calls are answered as in the loop; a user
graph named by ``agent.graph`` drives the episode; importing jax_agent_rl imports no LangChain.
"""

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.langgraph_loop import INVALID_CALL, BackendChatModel
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import AgentSection, ConfigError
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import LocalTools, ToolTransportError
from tests.agent.test_loop import CONFIG, Recording, _assert_token_exact

CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
HERE = "tests.agent.test_langgraph_loop"
BROKEN = "Try a broken call."
SAMPLED = dataclasses.replace(CONFIG, temperature=1.0)


class DoneTools(LocalTools):
    """Every call ends the episode (stop reason tool_done), with a reward."""

    async def call(
        self, trajectory_id: str, name: str, arguments: Any, create_kwargs: Any = None
    ) -> ToolResult:
        result = await super().call(trajectory_id, name, arguments, create_kwargs)
        return dataclasses.replace(result, done=True, reward=0.5)


class DeadTools(LocalTools):
    """A tool service that is gone (stop reason tool_error)."""

    async def call(
        self, trajectory_id: str, name: str, arguments: Any, create_kwargs: Any = None
    ) -> ToolResult:
        del trajectory_id, name, arguments, create_kwargs
        raise ToolTransportError("connection refused")


FINAL_MESSAGES: list[list[BaseMessage]] = []  # what recording_graph saw, one list an episode


def recording_graph(model: BackendChatModel, tools: list[BaseTool]) -> Any:
    """A user graph: the ReAct graph with a last node that keeps the conversation."""
    bound = model.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    def record(state: MessagesState) -> dict[str, list[BaseMessage]]:
        FINAL_MESSAGES.append(list(state["messages"]))
        return {"messages": []}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_node("record", record)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: "record"})
    graph.add_edge("tools", "agent")
    graph.add_edge("record", END)
    return graph.compile()


def one_call_graph(model: BackendChatModel, tools: list[BaseTool]) -> Any:
    """A user graph that ends on its first tool results, as a return_direct tool does."""
    bound = model.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", END)
    return graph.compile()


def _episode(
    setup: dict[str, Any],
    question: str,
    agent: str,
    config: AgentConfig = CONFIG,
    tools: Any = None,
    seed: int | None = None,
) -> tuple[Trajectory, Recording]:
    backend = Recording(EmbeddedBackend(setup["engine"], setup["weights"]))

    async def go() -> Trajectory:
        executor = tools or setup["tools"]
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], executor, make_parser(setup["parser"]), config, seed
        )
        sample = Sample(
            uid=f"q{sorted(setup['expected']).index(question)}",
            messages=[{"role": "user", "content": question}],
            agent_name=agent,
        )
        traj = await run_sample(sample, ctx)
        await backend.close()
        return traj

    return asyncio.run(go()), backend


def _assert_same(react: Trajectory, loop: Trajectory) -> None:
    """Every field but the timings: tokens, masks, logprobs, versions, messages, counters."""
    assert react.error is None, react.error
    got, want = dataclasses.asdict(react), dataclasses.asdict(loop)
    assert got.pop("timings").keys() == want.pop("timings").keys()
    assert got == want


def test_react_episodes_are_token_exact(setup: dict[str, Any]) -> None:
    for question, (ids, mask) in setup["expected"].items():
        traj, backend = _episode(setup, question, "react_agent")
        _assert_token_exact(traj, backend)
        assert traj.prompt_ids + traj.response_ids == ids, question
        assert [0] * len(traj.prompt_ids) + traj.loss_mask == mask
        assert traj.stop_reason == "eos" and traj.num_turns == 2
        assert traj.tool_calls == (2 if "and" in question else 1)
        assert traj.timings["tools_s"] > 0 and traj.timings["total_s"] > 0


@pytest.mark.parametrize(("config", "seed"), [(CONFIG, None), (SAMPLED, 0), (SAMPLED, 1)])
def test_react_agent_equals_the_tool_agent(
    setup: dict[str, Any], config: AgentConfig, seed: int | None
) -> None:
    """Same seeds, same trajectory, greedy or sampled."""
    for question in setup["expected"]:
        react, backend = _episode(setup, question, "react_agent", config, seed=seed)
        loop, _ = _episode(setup, question, "tool_agent", config, seed=seed)
        _assert_same(react, loop)
        _assert_token_exact(react, backend)


@CHATML
@pytest.mark.parametrize(
    ("budget", "reason"),
    [
        ("turns", "max_turns"),
        ("turn_tokens", "max_tokens_per_turn"),
        ("response_tokens", "max_response_tokens"),
        ("observation", "max_response_tokens"),  # the first observation does not fit
        ("model_len", "max_model_len"),
        ("prompt", "max_model_len"),  # the prompt fills the model length: no request at all
    ],
)
def test_budgets_end_both_loops_alike(setup: dict[str, Any], budget: str, reason: str) -> None:
    question = "What is 17 + 25?"
    mask = setup["expected"][question][1]
    prompt_len = mask.index(1)
    second_turn = mask.index(1, mask.index(0, prompt_len))
    override = {
        "turns": {"max_turns": 1},
        "turn_tokens": {"max_tokens_per_turn": 5},
        "response_tokens": {"max_response_tokens": 30},
        "observation": {"max_response_tokens": second_turn - prompt_len},
        "model_len": {"max_model_len": prompt_len + 30},
        "prompt": {"max_model_len": prompt_len},
    }[budget]
    config = dataclasses.replace(CONFIG, **override)
    react, _ = _episode(setup, question, "react_agent", config)
    loop, _ = _episode(setup, question, "tool_agent", config)
    _assert_same(react, loop)
    assert react.stop_reason == reason


@CHATML
@pytest.mark.parametrize(
    ("executor", "reason"), [(DoneTools, "tool_done"), (DeadTools, "tool_error")]
)
def test_tools_that_end_the_episode_end_both_loops_alike(
    setup: dict[str, Any], executor: type[LocalTools], reason: str
) -> None:
    question = "Compute 3 + 4 and 6 * 7."
    react, _ = _episode(setup, question, "react_agent", tools=executor(setup["tools"].registry))
    loop, _ = _episode(setup, question, "tool_agent", tools=executor(setup["tools"].registry))
    _assert_same(react, loop)
    assert react.stop_reason == reason and react.num_turns == 1


@CHATML
def test_a_malformed_call_is_answered_with_its_error(setup: dict[str, Any]) -> None:
    FINAL_MESSAGES.clear()
    config = dataclasses.replace(CONFIG, graph=f"{HERE}:recording_graph")
    traj, backend = _episode(setup, BROKEN, "react_agent", config)
    _assert_token_exact(traj, backend)
    assert traj.prompt_ids + traj.response_ids == setup["expected"][BROKEN][0]
    assert traj.malformed_calls == 1 and traj.tool_errors == 1
    assert traj.turn_kinds == ["malformed", "text"]
    observation = next(m["content"] for m in traj.messages if m["role"] == "tool")
    assert observation.startswith("error") and observation.endswith("...(truncated)...")
    # in the graph, the call went to the tool node as a call of invalid_tool_call
    (messages,) = FINAL_MESSAGES
    call, answer, reply = messages[-3:]
    assert [c["name"] for c in call.tool_calls] == [INVALID_CALL]
    assert call.tool_calls[0]["args"]["error"].startswith("the tool call is not valid JSON")
    assert isinstance(answer, ToolMessage) and answer.tool_call_id == call.tool_calls[0]["id"]
    assert answer.content.startswith("error: the tool call is not valid JSON")
    assert reply.response_metadata["stop_reason"] == "eos"
    sampled = reply.response_metadata["token_ids"]
    assert sampled and traj.response_ids[-len(sampled) :] == sampled


CAPPED = dataclasses.replace(CONFIG, max_tool_calls_per_turn=1, max_tool_response_tokens=64)
REFUSED = (
    "error: tool call 2 of 2 not run: at most 1 tool calls per turn (agent.max_tool_calls_per_turn)"
)


@CHATML
def test_a_call_past_the_turn_cap_is_refused_as_in_the_loop(setup: dict[str, Any]) -> None:
    """A turn of two calls under agent.max_tool_calls_per_turn=1: the graph's tool node runs
    the first and sends the second to invalid_tool_call, which answers it with the cap's
    error; the trajectory is the tool loop's, the call counted as refused."""
    question = "Compute 3 + 4 and 6 * 7."
    react, _ = _episode(setup, question, "react_agent", CAPPED)
    loop, _ = _episode(setup, question, "tool_agent", CAPPED)
    _assert_same(react, loop)
    assert (loop.refused_calls, loop.malformed_calls) == (1, 0)
    assert [m["content"] for m in loop.messages if m["role"] == "tool"][:2] == ["7", REFUSED]


@CHATML
def test_a_user_graph_drives_the_episode(setup: dict[str, Any], tmp_path: Path) -> None:
    """``agent.graph`` as module:function and as path/file.py:function; the graph here ends
    on its first tool results, so the episode ends there (tool_done), the observation kept in
    the messages and not in the tokens."""
    question = "What is 17 + 25?"
    (tmp_path / "graphs.py").write_text(f"from {HERE} import one_call_graph as build\n")
    ids, mask = setup["expected"][question]
    first_turn = mask.index(0, mask.index(1))  # where the first observation starts
    for spec in (f"{HERE}:one_call_graph", f"{tmp_path / 'graphs.py'}:build"):
        config = AgentConfig.of(AgentSection(max_tool_response_tokens=12, graph=spec))
        config = dataclasses.replace(config, max_model_len=CONFIG.max_model_len, temperature=0.0)
        assert config.graph == spec
        traj, backend = _episode(setup, question, "react_agent", config)
        _assert_token_exact(traj, backend)
        assert traj.stop_reason == "tool_done" and traj.num_turns == 1
        assert traj.prompt_ids + traj.response_ids == ids[:first_turn]
        assert traj.messages[-1] == {"role": "tool", "content": "42", "name": "calculator"}


@CHATML
@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (f"{HERE}:nope", rf"agent\.graph='{HERE}:nope': {HERE} has no function 'nope'"),
        ("no_such_pkg_xyz:graph", r"cannot import module 'no_such_pkg_xyz'"),
        ("graph", r"agent\.graph='graph': expected module:function or path/to/file\.py:function"),
    ],
)
def test_a_wrong_graph_fails_when_the_context_is_made(
    setup: dict[str, Any], spec: str, problem: str
) -> None:
    backend = EmbeddedBackend(setup["engine"], setup["weights"])
    config = dataclasses.replace(CONFIG, graph=spec)
    with pytest.raises(ConfigError, match=problem):
        asyncio.run(
            AgentContext.create(
                backend, setup["tokenizer"], setup["tools"], make_parser("hermes"), config
            )
        )


def test_importing_jax_agent_rl_imports_no_langchain(tmp_path: Path) -> None:
    """Nor does loading a dataset whose rows name react_agent (a registered loop)."""
    rows = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "2 + 2?"}], "agent_name": "react_agent"}
    rows.write_text(json.dumps({**row, "reward_model": {"ground_truth": "4"}}) + "\n")
    code = (
        "import sys\n"
        "import jax_agent_rl.agent, jax_agent_rl.train.build\n"
        "from jax_agent_rl.agent.loop import AGENT_LOOPS\n"
        "from jax_agent_rl.data import load_samples\n"
        f"(sample,) = load_samples({str(rows)!r}, agents=AGENT_LOOPS, default_agent='tool_agent')\n"
        "assert sample.agent_name == 'react_agent'\n"
        "langchain = ('langchain', 'langgraph', 'langsmith')\n"
        "loaded = [m for m in sys.modules if m.startswith(langchain)]\n"
        "assert not loaded, loaded\n"
        "assert 'jax_agent_rl.agent.langgraph_loop' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
