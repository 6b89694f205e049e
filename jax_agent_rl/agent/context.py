"""What an agent loop is given: its settings (`AgentConfig`) and the parts it drives
(`AgentContext`: the backend, the tokenizer, the tools, the parser), the limits on tool calls
(`ToolCallSlots` for a trajectory's calls at once, `cap_calls` for a turn's) and a tree
rollout's shared `Budget`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Literal

from jax_agent_rl.config import AgentSection
from jax_agent_rl.config.sections import ContextSection
from jax_agent_rl.envs.base import Environments
from jax_agent_rl.protocol import RolloutBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import ParsedCall, ToolCallParser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import ToolExecutor
from jax_agent_rl.usercode.load import load_function

_AGENT: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(AgentSection)}
# the setup checks of the loops in modules of their own, loaded by name as user code is (so
# importing the loop imports neither LangChain nor FastAPI, and they import the loop, not it
# them): each takes the setting and fails on a wrong one
GRAPH_CHECK = "jax_agent_rl.agent.langgraph_loop:graph_builder"
HARNESS_CHECK = "jax_agent_rl.agent.openai_endpoint:harness_function"


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What the loop reads: the ``agent`` section's budgets (their defaults are the
    section's), and what the run takes from ``engine`` and ``sampling``: the sequence limit and how
    every turn samples."""

    max_turns: int = _AGENT["max_turns"]
    max_tokens_per_turn: int = _AGENT["max_tokens_per_turn"]
    max_response_tokens: int = _AGENT["max_response_tokens"]
    max_tool_response_tokens: int = _AGENT["max_tool_response_tokens"]
    tool_response_truncate: Literal["left", "right", "middle"] = _AGENT["tool_response_truncate"]
    max_observation_chars: int = _AGENT["max_observation_chars"]
    max_parallel_tool_calls: int = _AGENT["max_parallel_tool_calls"]
    max_tool_calls_per_turn: int = _AGENT["max_tool_calls_per_turn"]
    stop: tuple[str, ...] = ()  # agent.stop: the stop strings of every turn
    graph: str = _AGENT["graph"]  # react_agent's (agent/langgraph_loop.py)
    harness: str = _AGENT["harness"]  # openai_agent's (agent/openai_endpoint.py)
    harness_timeout_s: float = _AGENT["harness_timeout_s"]
    sub_agent_tool: str = _AGENT["sub_agent_tool"]  # tool_agent's (`agent.loop.run_sub_agent`)
    # tool_agent's context rewrites between turns (`agent.loop.rewrite_context`)
    context: ContextSection = dataclasses.field(default_factory=ContextSection)
    max_model_len: int = 2048  # prompt + response
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, agent: AgentSection, **run: Any) -> AgentConfig:
        """What the loop reads of ``agent``, with the run's settings (``run``) on top."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name in _AGENT and f.name != "stop"]
        settings = {name: getattr(agent, name) for name in fields}
        return cls(**settings, stop=tuple(agent.stop), **run)


class ToolCallSlots:
    """At most ``limit`` tool calls in flight per trajectory, however its loop issues them (a
    turn's calls gathered, a graph's tool node): the rest wait for these, in order, so one
    trajectory's turn of dozens of calls does not take every tool worker from its siblings. A
    trajectory is kept here only while it has calls in flight or waiting."""

    def __init__(self) -> None:
        self._slots: dict[str, tuple[asyncio.Semaphore, int]] = {}  # and calls holding it

    @contextlib.asynccontextmanager
    async def hold(self, trajectory_id: str, limit: int) -> AsyncIterator[None]:
        """One of ``trajectory_id``'s ``limit`` slots, for one call."""
        slots, calls = self._slots.get(trajectory_id) or (asyncio.Semaphore(limit), 0)
        self._slots[trajectory_id] = (slots, calls + 1)
        try:
            async with slots:
                yield
        finally:
            calls = self._slots[trajectory_id][1] - 1
            if calls:
                self._slots[trajectory_id] = (slots, calls)
            else:
                del self._slots[trajectory_id]


@dataclasses.dataclass(frozen=True)
class RefusedCall(ParsedCall):
    """A well-formed call past its turn's ``agent.max_tool_calls_per_turn``: not run, answered
    with ``error`` (why) as a malformed call is, but counted in `Trajectory.refused_calls`."""


def cap_calls(calls: list[ParsedCall], cap: int) -> list[ParsedCall]:
    """A turn's ``calls`` with every well-formed one after the first ``cap`` refused
    (`RefusedCall`); malformed calls run nothing and do not count. verl's
    ``multi_turn.max_parallel_calls`` drops such calls from the turn; here each is answered,
    so the model reads the limit and nothing it wrote is silently lost."""
    out: list[ParsedCall] = []
    runs = 0
    for i, call in enumerate(calls):
        runs += call.error is None
        if call.error is None and runs > cap:
            why = (
                f"tool call {i + 1} of {len(calls)} not run: at most {cap} tool calls per turn "
                "(agent.max_tool_calls_per_turn)"
            )
            out.append(RefusedCall(call.name, call.arguments, why))
        else:
            out.append(call)
    return out


@dataclasses.dataclass
class AgentContext:
    """What a loop needs, passed in: the backend, the tokenizer, tools and the turn builder,
    and the tool call slots of the trajectories it runs."""

    backend: RolloutBackend
    tokenizer: Tokenizer
    tools: ToolExecutor
    parser: ToolCallParser
    config: AgentConfig
    builder: TurnBuilder
    seed: int | None = None
    budget: Budget | None = None  # shared by the episodes of one prompt (a tree rollout)
    # a sub-agent's turn builder (the tools but ``sub_agent_tool``); None: no sub-agent tool
    sub_builder: TurnBuilder | None = None
    # which environment plays a sample (its env_class, verl's interaction_kwargs); none: tools
    envs: Environments = dataclasses.field(default_factory=Environments)
    tool_slots: ToolCallSlots = dataclasses.field(default_factory=ToolCallSlots, repr=False)

    @classmethod
    async def create(
        cls,
        backend: RolloutBackend,
        tokenizer: Tokenizer,
        tools: ToolExecutor,
        parser: ToolCallParser,
        config: AgentConfig,
        seed: int | None = None,
        envs: Environments | None = None,
    ) -> AgentContext:
        schemas = await tools.schemas()
        builder = sub_builder = TurnBuilder(tokenizer, schemas or None)
        if config.sub_agent_tool:
            names = [s["function"]["name"] for s in schemas or []]
            if config.sub_agent_tool in names:
                raise ValueError(
                    f"agent.sub_agent_tool={config.sub_agent_tool!r} names one of the tools "
                    f"{names}: the sub-agent tool is the loop's own"
                )
            builder = TurnBuilder(tokenizer, [*(schemas or []), sub_agent_schema(config)])
        for tok in parser.stop_tokens:
            tokenizer.token_id(tok)  # a parser's stop must be one token: fail at setup, not mid-run
        if not all(config.stop):  # agent.stop's strings may be any text but empty
            raise ValueError(f"agent.stop={list(config.stop)}: a stop string is empty")
        if config.graph:  # react_agent's user graph: a wrong one fails here, not in each episode
            load_function(GRAPH_CHECK, "agent.graph")(config.graph)
        if config.harness:  # openai_agent's harness: likewise
            load_function(HARNESS_CHECK, "agent.harness")(config.harness)
        envs = envs or Environments()
        sub = sub_builder if config.sub_agent_tool else None
        return cls(
            backend, tokenizer, tools, parser, config, builder, seed, envs=envs, sub_builder=sub
        )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return turn_stop_ids(self.tokenizer, self.parser)


def sub_agent_schema(config: AgentConfig) -> dict[str, Any]:
    """The schema the prompt lists for ``agent.sub_agent_tool``."""
    return {
        "type": "function",
        "function": {
            "name": config.sub_agent_tool,
            "description": "Hand a sub-task to a sub-agent, which works on it with the same "
            "tools in a fresh context and returns its answer.",
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string", "description": "The sub-task."}},
                "required": ["task"],
            },
        },
    }


def turn_stop_ids(tokenizer: Tokenizer, parser: ToolCallParser) -> tuple[int, ...]:
    """The ids a model turn stops at: the tokenizer's end of turn, the parser's stop tokens."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple(dict.fromkeys([*eos, *map(tokenizer.token_id, parser.stop_tokens)]))


@dataclasses.dataclass
class Budget:
    """Model tokens and tool calls that several episodes draw on together (a tree rollout's
    per-prompt budget). A request reserves its ``max_tokens`` before it is sent and gives back
    what it did not sample (`reserve`, `settle`), and a turn's calls are taken before they run
    (`take_calls`), so what is used never exceeds the budget, however the episodes
    interleave. A request that finds every remaining token reserved by others waits for what
    they give back; the budget is spent once nothing is left and nothing is reserved."""

    model_tokens: int
    tool_calls: int
    used_tokens: int = 0  # sampled, or reserved by requests in flight
    used_calls: int = 0
    _in_flight: int = dataclasses.field(default=0, compare=False, repr=False)
    _changed: asyncio.Condition = dataclasses.field(
        default_factory=asyncio.Condition, compare=False, repr=False
    )

    @property
    def tokens_left(self) -> int:
        return self.model_tokens - self.used_tokens

    @property
    def spent(self) -> bool:
        return self.tokens_left <= 0 and self._in_flight == 0

    async def reserve(self, tokens: int) -> int:
        """Up to ``tokens`` model tokens for one request (0: the budget is spent)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.tokens_left > 0 or self._in_flight == 0)
            granted = max(0, min(tokens, self.tokens_left))
            self.used_tokens += granted
            self._in_flight += granted > 0
            return granted

    async def settle(self, granted: int, sampled: int) -> None:
        """A request that reserved ``granted`` tokens sampled ``sampled``: the rest is free."""
        async with self._changed:
            self.used_tokens -= granted - sampled
            self._in_flight -= 1
            self._changed.notify_all()

    def take_calls(self, calls: int) -> bool:
        """Takes ``calls`` tool calls if that many are left (all or none)."""
        if self.used_calls + calls > self.tool_calls:
            return False
        self.used_calls += calls
        return True
