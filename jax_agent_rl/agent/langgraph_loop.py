"""LangGraph agents over the token-exact loop: the agent loop ``react_agent``.

A LangGraph graph decides what happens next; the tokens stay the loop's. `BackendChatModel`,
a LangChain chat model over one trajectory, never renders the graph's messages into text: each
call runs one model turn exactly as `run_tool_agent` does (`model_turn` over the trajectory's
``prompt_ids + response_ids``), reads it with the context's parser (`read_turn`) and answers an
``AIMessage`` with the model's text, its ``tool_calls`` and its sampled token ids
(``response_metadata["token_ids"]``). The graph's tool node runs the calls through
`episode_tools`, the executor's tools as LangChain tools (each call made as the loop makes it,
`call_tool`); on its next call the model appends the tool messages' results as the observation
(mask 0, `record_results`), then samples again. So, for the same model tokens, a
``react_agent`` trajectory is token for token the one `run_tool_agent` records, with the same
budgets, stop reasons, counters and released tool state (`run_episode`).

A call the tools cannot take as written (malformed, arguments that are not an object, a tool
that does not exist) or will not run (past ``agent.max_tool_calls_per_turn``, `read_turn`)
goes to one more tool, ``invalid_tool_call``, which answers it as the loop does (the parser's
error, the cap's, or the executor's), so the graph routes every call of a turn to its tool
node and the model reads the loop's observation. The graph runs each call of the model's last
turn once, as the loop does (`GraphEpisode.take_run`): any other tool run (a call run again, a run
of the graph's own, one after the episode ended) raises. Each run counts as the graph's
activity, so a graph that ran tools without end (retrying a call until its result holds no
error) held its episode, and the step, for ever.

When the episode ends between turns (a tool ended it, the observation does not fit, a budget
is spent), the model answers an empty message without tool calls (``response_metadata``
holds the stop reason), so a graph that stops on a message without calls stops; calling the
model again after that is an error. A graph that ends right after its tool node (a
``return_direct`` tool) ends the episode with ``tool_done``.

The graph is user code, as a harness is, and runs as one does (`harness_thread.run_apart`): in
a thread and event loop of its own, its model turns and tool calls run on the rollout's loop
(`GraphEpisode.on_rollout`), stopped once it holds its episode ``agent.harness_timeout_s`` without
one in progress (it awaits for ever, loops, blocks its thread). A graph that fails so or raises
after a model turn that left the episode going ends it ``caused_error`` (trained, outcome 0: it
read the policy's text, and an episode ended untrained would escape being wrong); before any,
``agent_error``; after the episode ended, that end is kept (`GraphEpisode.failed`).

``agent.graph`` names a user graph, ``fn(chat_model, tools)`` returning a compiled graph over
``MessagesState`` (its ``messages`` in and out); empty: `react_graph`. The model reads only the
conversation its tokens hold: the sample's messages, its own messages and the tool messages
that answer its calls. Any other message a graph passes after the model's last one (a system
prompt it adds, say) is an error, never silently left out of the tokens. A graph that passes
messages without the model's last one (it compacted or rewrote its conversation) starts a new
sample of the episode from them, rendered by the chat template (each assistant message as its
text, without its end-of-turn token; `GraphEpisode._new_context`), every sampled token still
where it was sampled (docs/agents.md). The calls of the model's last turn are then left
unanswered, and a text answer still ends the episode: a sub-agent's conversation that the
parent goes back to is the OpenAI endpoint's (docs/harness.md), not this loop's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ToolCall,
    ToolMessage,
    convert_to_openai_messages,
)
from langchain_core.messages.tool import tool_call
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import InstanceOf

from jax_agent_rl.agent.context import AgentContext, RefusedCall
from jax_agent_rl.agent.harness_thread import held_too_long, run_apart
from jax_agent_rl.agent.loop import (
    budget_stop,
    call_tool,
    model_turn,
    read_turn,
    record_results,
    run_episode,
    tool_service_failed,
)
from jax_agent_rl.agent.trajectory import StopReason, Trajectory
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import Environment
from jax_agent_rl.tokenization.tool_calls import ParsedCall
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import ToolTransportError
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool
from jax_agent_rl.usercode.load import load_function
from jax_agent_rl.usercode.threads import until_set

T = TypeVar("T")
INVALID_CALL = "invalid_tool_call"  # the tool that answers calls the tools cannot take
GRACE_S = 5.0  # how long a graph stopped at its deadline has to end, before it is abandoned
GraphBuilder = Callable[[BaseChatModel, list[BaseTool]], Any]  # -> a compiled graph


@dataclasses.dataclass
class _Calls:
    """A model turn whose calls the graph is running."""

    tokens: list[int]
    text: str
    calls: list[ParsedCall]
    ids: list[str]  # the tool call id of each call
    started: float  # when they left for the graph (perf_counter)


class GraphEpisode:
    """One trajectory as a graph plays it: what its chat model and its tools share."""

    def __init__(
        self, ctx: AgentContext, traj: Trajectory, create_kwargs: Mapping[str, dict[str, Any]]
    ) -> None:
        self.ctx, self.traj, self.create_kwargs = ctx, traj, create_kwargs
        self.schemas = ctx.builder.tools or []  # the tools the model's prompt lists
        self.tool_names = frozenset(s["function"]["name"] for s in self.schemas)
        if INVALID_CALL in self.tool_names:
            raise ValueError(f"a tool may not be named {INVALID_CALL!r} (react_agent's own)")
        self.pending: _Calls | None = None
        self.stop: StopReason | None = None
        self.replies: list[str] = []  # ids of the model's messages
        # the rollout's loop, where the episode's calls run when the graph runs in a loop of its
        # own (`run_react_agent`); None: the loop that awaits them
        self.loop: asyncio.AbstractEventLoop | None = None
        self.idle = asyncio.Event()  # set while no model turn or tool call is in progress
        self.idle.set()
        self.in_progress = 0  # (a turn's tool calls run together: idle once all have ended)
        self.asked = asyncio.Event()  # set as one starts (`held_too_long`)
        self._runs_left = 0  # tool runs the graph may still make: the pending calls not run
        self._runs_lock = threading.Lock()  # (taken in the graph's thread, set in the rollout's)

    async def on_rollout(self, call: Coroutine[Any, Any, T]) -> T:
        """``call`` (a model turn or a tool call) run on the rollout's loop, awaited from the
        graph's; it counts as the graph's request (``idle``, ``asked``)."""

        async def tracked() -> T:
            self.in_progress += 1
            self.idle.clear()
            self.asked.set()
            try:
                return await call
            finally:
                self.in_progress -= 1
                if not self.in_progress:
                    self.idle.set()

        if self.loop is None or self.loop is asyncio.get_running_loop():
            return await tracked()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(tracked(), self.loop))

    def failed(self, error: str) -> StopReason:
        """The graph raised (or held its episode past its deadline): after the episode ended,
        that end kept; after a model turn the policy's (``caused_error``: the graph read its
        text, and an episode ended untrained would escape being wrong); before, the graph's
        own (raised: ``agent_error``)."""
        if self.stop is not None:
            self.traj.add_error(f"\nthen the graph failed:\n{error}")
            return self.stop
        if not self.traj.num_turns:
            raise RuntimeError(f"the graph failed before the model's first turn:\n{error}")
        self.traj.add_error(f"the graph failed after a model turn:\n{error}")
        self.stop = "caused_error"
        return self.stop

    async def reply(self, messages: Sequence[BaseMessage]) -> AIMessage:
        """The model's next message: the observation of its last calls appended, then a model
        turn (or the end of the episode, when that observation or a budget ends it)."""
        if self.stop is not None:
            raise RuntimeError(f"the graph called the model after the episode ended ({self.stop})")
        new = self._new_messages(messages)
        self.allow_runs(0)
        if new is None:
            await self._new_context(messages)
        elif self.pending is not None:
            observation, stop = self._answer(new)
            if stop is not None:
                return self._end(stop)
            self.traj.add_observation(observation)
        stop = budget_stop(self.ctx, self.traj)
        if stop is not None:
            return self._end(stop)
        turn, finish = await model_turn(self.ctx, self.traj)
        text, calls, stop = read_turn(self.ctx, self.traj, turn, finish)
        metadata: dict[str, Any] = {"token_ids": turn, "finish_reason": finish}
        if stop is not None:
            return self._end(stop, text, metadata)
        ids = [f"call_{self.traj.num_turns}_{i}" for i in range(len(calls))]
        self.pending = _Calls(turn, text, calls, ids, time.perf_counter())
        self.allow_runs(len(calls))
        tool_calls = [self._tool_call(c, i) for c, i in zip(calls, ids, strict=True)]
        return self._message(text, metadata, tool_calls)

    def allow_runs(self, n: int) -> None:
        """Lets the graph run ``n`` tool calls (a model turn's: `reply`), and no others."""
        with self._runs_lock:
            self._runs_left = n

    def take_run(self, name: str) -> None:
        """Counts a tool run of the graph's (in its thread); raises once it has run as many as
        the model's last turn made calls (see the module docstring)."""
        with self._runs_lock:
            if self._runs_left <= 0:
                raise RuntimeError(
                    f"the graph ran a tool call the model's last turn did not make ({name}): "
                    "each of the model's calls runs once, as in the tool loop"
                )
            self._runs_left -= 1

    def finish(self, messages: Sequence[BaseMessage]) -> StopReason:
        """How the episode ended, once the graph has."""
        if self.pending is not None:  # the graph ended on its tools' results
            new = self._new_messages(messages)
            if new is None:  # (in a conversation of its own: they are not the model's to read)
                return "tool_done"
            _, stop = self._answer(new)
            return stop or "tool_done"
        if self.stop is None:
            raise RuntimeError("the graph ended without calling the model")
        return self.stop

    def tools_failed(self, error: ToolTransportError) -> StopReason:
        """The tool service failed while the graph ran the pending calls."""
        if self.pending is None:
            raise error
        self.traj.add_time("tools_s", time.perf_counter() - self.pending.started)
        return tool_service_failed(self.traj, self.pending.text, error)

    def _tool_call(self, call: ParsedCall, call_id: str) -> ToolCall:
        if call.error is None and isinstance(call.arguments, dict) and call.name in self.tool_names:
            return tool_call(name=call.name, args=call.arguments, id=call_id)
        args = {
            "name": call.name,
            "arguments": call.arguments,
            "error": call.error,
            "refused": isinstance(call, RefusedCall),  # past the turn's cap, not malformed
        }
        return tool_call(name=INVALID_CALL, args=args, id=call_id)

    def _message(
        self, text: str, metadata: dict[str, Any], tool_calls: list[ToolCall] | None = None
    ) -> AIMessage:
        self.replies.append(f"{self.traj.uid}/reply_{len(self.replies)}")
        return AIMessage(
            content=text,
            id=self.replies[-1],
            tool_calls=tool_calls or [],
            response_metadata=metadata,
        )

    def _end(
        self, stop: StopReason, text: str = "", metadata: dict[str, Any] | None = None
    ) -> AIMessage:
        self.stop = stop
        return self._message(text, {**(metadata or {}), "stop_reason": stop})

    async def _new_context(self, messages: Sequence[BaseMessage]) -> None:
        """Messages that do not go on from the model's last one (the graph compacted or
        rewrote the conversation): a new sample from their render (module doc); the calls of
        the model's last turn are left unanswered there."""
        eos = self.ctx.tokenizer.eos_token or ""
        said: list[dict[str, Any]] = []
        for m in convert_to_openai_messages(list(messages)):
            content = m.get("content") or ""
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if m["role"] == "assistant":
                content = content.removesuffix(eos)
            said.append({"role": m["role"], "content": content})
        if not said or said[-1]["role"] == "assistant":
            raise ValueError(
                "the graph passed the model a conversation that does not go on from its last "
                "message and ends with none for it to answer (an assistant message last)"
            )
        self.pending = None
        self.traj.start_sample(await asyncio.to_thread(self.ctx.builder.prompt_ids, said))
        self.traj.add_messages(said)

    def _new_messages(self, messages: Sequence[BaseMessage]) -> list[BaseMessage] | None:
        """The messages after the model's last one (none on the first call: the prompt);
        None when they do not hold it (a new context: `_new_context`)."""
        if not self.replies:
            prompt = [(m["role"], m.get("content") or "") for m in self.traj.messages]
            got = [
                (m["role"], m.get("content") or "") for m in convert_to_openai_messages(messages)
            ]
            if got != prompt:
                raise ValueError(
                    f"the graph's first messages {got} are not the sample's prompt {prompt}, "
                    "which the model's tokens hold"
                )
            return []
        last = next(
            (i for i in reversed(range(len(messages))) if messages[i].id == self.replies[-1]), None
        )
        return None if last is None else list(messages[last + 1 :])

    def _answer(self, new: list[BaseMessage]) -> tuple[list[int], StopReason | None]:
        """Records the tool messages answering the pending calls (`record_results`)."""
        pending, self.pending = self.pending, None
        assert pending is not None
        self.traj.add_time("tools_s", time.perf_counter() - pending.started)
        answers: dict[str, ToolMessage] = {}
        for m in new:
            if not isinstance(m, ToolMessage) or m.tool_call_id not in pending.ids:
                raise ValueError(
                    "the model reads only the tool messages answering its calls "
                    f"{pending.ids}; the graph passed it {m!r}"
                )
            answers[m.tool_call_id] = m
        missing = [i for i in pending.ids if i not in answers]
        if missing:
            raise ValueError(f"no tool message answers the calls {missing}")
        results = [_result(answers[i]) for i in pending.ids]
        return record_results(
            self.ctx, self.traj, pending.tokens, pending.text, pending.calls, results
        )


def _result(message: ToolMessage) -> ToolResult:
    """A tool message's text, with its reward and flags when one of our tools made it."""
    text = str(message.text)
    if isinstance(message.artifact, ToolResult):
        return dataclasses.replace(message.artifact, text=text)
    return ToolResult(text, error=message.status == "error")


class BackendChatModel(BaseChatModel):
    """A LangChain chat model over one trajectory: each call is a model turn on the
    `RolloutBackend` (async only: ``ainvoke``), see the module docstring."""

    episode: InstanceOf[GraphEpisode]

    @property
    def _llm_type(self) -> str:
        return "jax_agent_rl"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise NotImplementedError("BackendChatModel samples asynchronously: use ainvoke")

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        del run_manager
        if stop or kwargs:
            raise ValueError(
                f"BackendChatModel samples as agent.* and sampling.* say; it takes no stop "
                f"sequences or other options (got stop={stop}, {sorted(kwargs)})"
            )
        message = await self.episode.on_rollout(self.episode.reply(messages))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model itself: its prompt already lists the executor's tools, so binding only
        checks that ``tools`` are among them."""
        names = {convert_to_openai_tool(t)["function"]["name"] for t in tools}
        unknown = sorted(names - self.episode.tool_names - {INVALID_CALL})
        if unknown:
            raise ValueError(
                f"cannot bind {unknown}: the model's prompt lists the executor's tools "
                f"{sorted(self.episode.tool_names)}"
            )
        if tool_choice not in (None, "auto") or kwargs:
            raise ValueError(
                f"BackendChatModel cannot force tool use (tool_choice={tool_choice!r}, "
                f"{sorted(kwargs)}): the model calls tools as its tokens say"
            )
        return self


class EpisodeTool(BaseTool):
    """One of the executor's tools for the graph's tool node. Arguments are not checked here:
    the executor checks them and says what was wrong, as in the loop."""

    episode: InstanceOf[GraphEpisode]
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name} runs asynchronously: use ainvoke")

    async def _arun(self, /, **arguments: Any) -> tuple[str, ToolResult]:
        # (``self`` positional-only: the model's arguments may hold any key, "self" too)
        ep = self.episode
        call = self._call(arguments)
        ep.take_run(self.name)
        result = await ep.on_rollout(call_tool(ep.ctx, ep.traj, call, ep.create_kwargs))
        return result.text, result

    def _call(self, arguments: dict[str, Any]) -> ParsedCall:
        return ParsedCall(self.name, arguments)


class InvalidCallTool(EpisodeTool):
    """Answers a call the tools cannot take as written, as the loop answers it."""

    def _call(self, arguments: dict[str, Any]) -> ParsedCall:
        call = RefusedCall if arguments["refused"] else ParsedCall
        return call(arguments["name"], arguments["arguments"], arguments["error"])


def episode_tools(episode: GraphEpisode) -> list[BaseTool]:
    """The executor's tools (those the model's prompt lists), then ``invalid_tool_call``."""
    tools: list[BaseTool] = [
        EpisodeTool(
            name=s["function"]["name"],
            description=s["function"].get("description", ""),
            args_schema=s["function"].get("parameters", {"type": "object", "properties": {}}),
            episode=episode,
        )
        for s in episode.schemas
    ]
    invalid_schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "arguments": {},
            "error": {},
            "refused": {"type": "boolean"},
        },
        "required": ["name", "arguments", "error", "refused"],
    }
    return [
        *tools,
        InvalidCallTool(
            name=INVALID_CALL,
            description="Answers a tool call that is malformed or names no tool.",
            args_schema=invalid_schema,
            episode=episode,
        ),
    ]


def react_graph(model: BaseChatModel, tools: list[BaseTool]) -> Any:
    """The default graph, LangGraph's ReAct agent: the model, then the tool node for its calls,
    until it answers without calls."""
    bound = model.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@functools.cache
def graph_builder(spec: str) -> GraphBuilder:
    """The graph builder ``agent.graph`` names (loaded once), or `react_graph` when empty."""
    return load_function(spec, "agent.graph") if spec else react_graph


async def run_react_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """The episode of ``sample`` driven by the graph ``agent.graph`` names (`react_graph`
    when empty): see the module docstring."""

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        del env  # none: run_episode refuses a sample with one (this loop does not drive it)
        episode = GraphEpisode(ctx, traj, create_kwargs_by_tool(sample.extra))
        episode.loop = asyncio.get_running_loop()
        model = BackendChatModel(episode=episode)
        graph = graph_builder(ctx.config.graph)(model, episode_tools(episode))
        ended: list[dict[str, Any]] = []

        async def invoke() -> None:  # (in the graph's thread and loop)
            ended.append(await graph.ainvoke({"messages": [dict(m) for m in sample.messages]}))

        timeout_s = ctx.config.harness_timeout_s
        done = asyncio.Event()
        watch = asyncio.ensure_future(_held(episode, done, timeout_s))
        try:
            await until_set(run_apart(invoke), done, GRACE_S)
        except ToolTransportError as e:
            return episode.tools_failed(e)
        except Exception:
            return episode.failed(traceback.format_exc())
        finally:
            watch.cancel()
        if not ended:
            return episode.failed(
                f"it held its episode past agent.harness_timeout_s={timeout_s:g}s without a "
                "model turn or tool call (it awaited, looped or blocked its thread): stopped"
            )
        return episode.finish(ended[0]["messages"])

    return await run_episode(sample, ctx, play)


async def _held(episode: GraphEpisode, done: asyncio.Event, timeout_s: float) -> None:
    """Sets ``done`` once the graph has held ``episode`` ``timeout_s`` on end without a model
    turn or tool call in progress."""
    await held_too_long(episode.idle, episode.asked, timeout_s)
    done.set()
