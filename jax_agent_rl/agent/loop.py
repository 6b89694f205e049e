"""The agent loop: one coroutine per trajectory, tokens in and tokens out.

``run_tool_agent`` alternates model turns and tool calls against any `RolloutBackend` and any
`ToolExecutor`. Model tokens are appended exactly as sampled (mask 1, with their logprobs);
every other token comes from the chat template as a delta (mask 0), so ``prompt_ids +
response_ids`` is what the model saw. Tool calls of one turn run concurrently, at most
``agent.max_parallel_tool_calls`` of a trajectory at once (`ToolCallSlots`); a malformed
call is answered with a tool message saying what was wrong. Every trajectory ends with a
`StopReason`, and its tool state is always released; an unexpected exception ends only its own
trajectory (``agent_error``, see `run_sample`).

A sample's ``agent_name`` picks the loop from `AGENT_LOOPS`: ``tool_agent`` and
``single_turn_agent``, spelled as verl spells them, ``react_agent`` (the same episode driven by
a LangGraph graph, `jax_agent_rl.agent.langgraph_loop`, imported on first use), ``openai_agent``
(the episode driven by a user's harness through an OpenAI-compatible endpoint,
`jax_agent_rl.agent.openai_endpoint`), or a user loop added with `register_agent_loop`.
Datasets are checked against these names when they are loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

from jax_agent_rl.agent.trajectory import Sample, StopReason, Trajectory
from jax_agent_rl.config import AgentSection
from jax_agent_rl.engine.sampling import SamplingParams
from jax_agent_rl.envs.base import EnvError, Environment, Environments
from jax_agent_rl.rollout.protocol import GenerateRequest, RolloutBackend
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import InlineToolCallParser, ParsedCall, ToolCallParser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import ToolExecutor, ToolTransportError
from jax_agent_rl.tools.verl import create_kwargs_by_tool


@dataclasses.dataclass(frozen=True)
class AgentConfig(AgentSection):
    """One episode's settings: the ``agent`` section's budgets and parser, and what the run
    takes from ``rollout``: the sequence limit and how every turn samples."""

    max_model_len: int = 2048  # prompt + response
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, agent: AgentSection, **rollout: Any) -> AgentConfig:
        """``agent``'s settings (every field) with ``rollout``'s on top."""
        return cls(**{f.name: getattr(agent, f.name) for f in dataclasses.fields(agent)}, **rollout)


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
        builder = TurnBuilder(tokenizer, schemas or None)
        for tok in parser.stop_tokens:
            tokenizer.token_id(tok)  # a stop string must be one token: fail at setup, not mid-run
        if config.graph:  # react_agent's user graph: a wrong one fails here, not in each episode
            from jax_agent_rl.agent.langgraph_loop import graph_builder

            graph_builder(config.graph)
        if config.harness:  # openai_agent's harness: likewise
            from jax_agent_rl.agent.openai_endpoint import harness_function

            harness_function(config.harness)
        envs = envs or Environments()
        return cls(backend, tokenizer, tools, parser, config, builder, seed, envs=envs)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return turn_stop_ids(self.tokenizer, self.parser)


def turn_stop_ids(tokenizer: Tokenizer, parser: ToolCallParser) -> tuple[int, ...]:
    """The ids a model turn stops at: the tokenizer's end of turn, the parser's stop tokens."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple(dict.fromkeys([*eos, *map(tokenizer.token_id, parser.stop_tokens)]))


AgentLoopFn = Callable[[Sample, AgentContext], Awaitable[Trajectory]]


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


def _budget_stop(traj: Trajectory, ctx: AgentContext, turn_tokens: int) -> StopReason | None:
    cfg = ctx.config
    if ctx.budget is not None and ctx.budget.spent:
        return "budget"
    if len(traj.prompt_ids) + len(traj.response_ids) >= cfg.max_model_len:
        return "max_model_len"
    if len(traj.response_ids) >= cfg.max_response_tokens:
        return "max_response_tokens"
    if turn_tokens >= cfg.max_tokens_per_turn:
        return "max_tokens_per_turn"
    return None


def _fits(traj: Trajectory, ctx: AgentContext, ids: list[int]) -> StopReason | None:
    """None if ``ids`` plus at least one more model token fit the budgets, else the budget
    that they exhaust."""
    total = len(traj.prompt_ids) + len(traj.response_ids) + len(ids)
    if total >= ctx.config.max_model_len:
        return "max_model_len"
    if len(traj.response_ids) + len(ids) >= ctx.config.max_response_tokens:
        return "max_response_tokens"
    return None


def _request_seed(ctx: AgentContext, tag: str) -> int | None:
    """The seed of request ``tag``: none without a run seed, and none for a backend that
    draws seeds itself (it refuses them: sampling is set per server)."""
    if ctx.seed is None or not ctx.backend.capabilities.per_request_sampling:
        return None
    return zlib.crc32(f"{ctx.seed}/{tag}".encode())


async def _generate(traj: Trajectory, ctx: AgentContext, turn_tokens: int) -> tuple[list[int], str]:
    """One request for the trajectory's next tokens (its ``n``-th: one weight version is
    recorded per request), appended to it."""
    cfg = ctx.config
    n = len(traj.weight_versions)
    max_tokens = min(
        cfg.max_tokens_per_turn - turn_tokens,
        cfg.max_response_tokens - len(traj.response_ids),
        cfg.max_model_len - len(traj.prompt_ids) - len(traj.response_ids),
    )
    if ctx.budget is not None:
        max_tokens = await ctx.budget.reserve(max_tokens)
        if max_tokens == 0:
            return [], "budget"
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=_request_seed(ctx, f"{traj.uid}/{n}"),
        stop_token_ids=ctx.stop_ids,
    )
    request = GenerateRequest(
        request_id=f"{traj.uid}/{n}",
        prompt_ids=(*traj.prompt_ids, *traj.response_ids),
        sampling=sampling,
        session_id=traj.uid,
        prefix_session=traj.forked_from,
    )
    try:
        result = await ctx.backend.generate(request)
    except BaseException:
        if ctx.budget is not None:
            await ctx.budget.settle(max_tokens, 0)
        raise
    if ctx.budget is not None:
        await ctx.budget.settle(max_tokens, len(result.token_ids))
    tokens = list(result.token_ids)
    logprobs = list(result.logprobs or [0.0] * len(tokens))
    traj.append(tokens, model=True, logprobs=logprobs, version=result.weight_version)
    traj.weight_versions.append(result.weight_version)
    return tokens, result.finish_reason


async def call_tool(
    ctx: AgentContext,
    traj: Trajectory,
    call: ParsedCall,
    create_kwargs: Mapping[str, dict[str, Any]],
) -> ToolResult:
    """One call of a turn: a malformed one is answered with what was wrong, the others by the
    executor (with the sample's ``create_kwargs`` of that tool) once one of the trajectory's
    ``max_parallel_tool_calls`` slots is free."""
    if call.error is not None:
        traj.malformed_calls += 1
        return ToolResult(f"error: {call.error}", error=True)
    kwargs = create_kwargs.get(call.name)
    async with ctx.tool_slots.hold(traj.uid, ctx.config.max_parallel_tool_calls):
        return await ctx.tools.call(traj.uid, call.name, call.arguments, kwargs)


async def _call_tools(
    ctx: AgentContext,
    traj: Trajectory,
    calls: list[ParsedCall],
    create_kwargs: Mapping[str, dict[str, Any]],
) -> list[ToolResult]:
    return list(await asyncio.gather(*(call_tool(ctx, traj, c, create_kwargs) for c in calls)))


def _tool_text(ctx: AgentContext, result: ToolResult) -> str:
    cfg = ctx.config
    return ctx.builder.truncate_text(
        result.text, cfg.max_tool_response_tokens, cfg.tool_response_truncate
    )


async def run_tool_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """Model turns and tool calls until the model stops, a budget runs out or a tool ends it."""

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        create_kwargs = create_kwargs_by_tool(sample.extra)  # extra_info.tools_kwargs
        while (stop := await take_turn(traj, ctx, create_kwargs, env)) is None:
            pass
        return stop

    return await run_episode(sample, ctx, play, drives_envs=True)


Play = Callable[[Trajectory, Environment | None], Awaitable[StopReason]]


async def run_episode(
    sample: Sample, ctx: AgentContext, play: Play, drives_envs: bool = False
) -> Trajectory:
    """A trajectory of ``sample`` played by ``play`` (which returns how it ended) from its
    prompt, or, by a loop that ``drives_envs``, against its environment (`jax_agent_rl.envs`)
    from the messages the environment starts it with (another loop refuses a sample with one):
    timed, an environment's failure kept as ``env_error`` and any other exception as
    ``agent_error``, its environment closed and its tool state released."""
    t_start = time.perf_counter()
    traj = Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        prompt_ids=[],
        messages=[dict(m) for m in sample.messages],
    )
    traj.timings["tools_s"] = 0.0
    env = None
    try:
        if not drives_envs and ctx.envs.plays(sample):
            raise ValueError(
                f"agent_name {sample.agent_name!r} does not drive environments; sample "
                f"{sample.uid!r} names one (env_class or interaction_kwargs): use tool_agent"
            )
        env = ctx.envs.make(sample)
        if env is not None:
            traj.timings["env_s"] = 0.0
            traj.env_reward = 0.0 if env.owns_reward else None
            traj.messages = await env.reset(sample)
        traj.prompt_ids = ctx.builder.prompt_ids(traj.messages)
        traj.stop_reason = await play(traj, env)
    except EnvError:  # the environment failed: this episode ends, counted
        traj.stop_reason = "env_error"
        traj.error = traceback.format_exc()
    except Exception:  # this trajectory's failure, kept with what it did until then
        traj.stop_reason = "agent_error"
        traj.error = traceback.format_exc()
    finally:
        try:
            if env is not None:
                await env.close()
        except EnvError:
            traj.stop_reason = "env_error"
            traj.error = (traj.error or "") + traceback.format_exc()
        finally:
            traj.timings["total_s"] = time.perf_counter() - t_start
            await ctx.tools.release(traj.uid)
    return traj


async def take_turn(
    traj: Trajectory,
    ctx: AgentContext,
    create_kwargs: Mapping[str, dict[str, Any]],
    env: Environment | None = None,
) -> StopReason | None:
    """One turn of ``traj``: a model turn, the tools it calls or the environment ``env``'s
    answer, and their observation. Returns the stop reason when the episode ends (a budget
    before the turn included), else None: the trajectory then ends with an observation, at a
    turn boundary."""
    stop = _budget_stop(traj, ctx, 0)
    if stop is not None:
        return stop
    turn, finish = await _model_turn(traj, ctx)
    if finish == "budget" and not turn:
        return "budget"
    return await finish_turn(ctx, traj, turn, finish, create_kwargs, env)


async def _model_turn(traj: Trajectory, ctx: AgentContext) -> tuple[list[int], str]:
    """One model turn: one or more generate requests (an inline block that stopped at its
    opening fence is continued). Returns its tokens and the last finish reason."""
    turn: list[int] = []
    while True:
        tokens, finish = await _generate(traj, ctx, len(turn))
        turn += tokens
        if finish in ("abort", "budget"):
            return turn, finish
        if not ctx.parser.needs_more(ctx.tokenizer.decode(turn)):
            return turn, finish
        if _budget_stop(traj, ctx, len(turn)):
            return turn, finish


async def finish_turn(
    ctx: AgentContext,
    traj: Trajectory,
    turn: list[int],
    finish: str,
    create_kwargs: Mapping[str, dict[str, Any]] | None = None,
    env: Environment | None = None,
) -> StopReason | None:
    """Everything after a model turn whose tokens ``turn`` are already in ``traj``: read its
    text, call the tools it asks for (each with its ``create_kwargs`` from the sample, see
    `create_kwargs_by_tool`) or let the environment ``env`` answer it, and append their
    observation. Returns the stop reason when the episode ends here, else None. This is where
    model text meets the loop: whatever the model wrote, it ends as a stop reason, never an
    exception (fuzzed in ``tests/hostile/test_model_text.py``)."""
    if env is not None and env.turns == "all":
        return await _env_turn(ctx, traj, turn, finish, env)
    text, calls, stop = read_turn(ctx, traj, turn, finish)
    if env is not None and stop in _ENV_ANSWERS:  # no calls: the environment answers the turn
        return await _env_answer(ctx, traj, turn, text, env, None)
    if stop is not None:
        return stop
    t_tools = time.perf_counter()
    try:
        results = await _call_tools(ctx, traj, calls, create_kwargs or {})
    except ToolTransportError as e:
        return tool_service_failed(traj, text, e)
    finally:
        traj.timings["tools_s"] += time.perf_counter() - t_tools
    observation, stop = record_results(ctx, traj, turn, text, calls, results)
    if stop is None:
        traj.append(observation, model=False)
    return stop


def read_turn(
    ctx: AgentContext, traj: Trajectory, turn: list[int], finish: str
) -> tuple[str, list[ParsedCall], StopReason | None]:
    """A model turn's text and calls, counted in ``traj``, and the stop reason when the
    episode ends with this turn (no call, or calls past a budget), else None: the calls run."""
    traj.num_turns += 1
    text = ctx.tokenizer.decode(turn)
    if finish == "abort":
        traj.turn_kinds.append("aborted")
        return text, [], "aborted"
    calls = ctx.parser.parse(text)
    if not calls:
        traj.messages.append({"role": "assistant", "content": text})
        ended = bool(turn) and turn[-1] == ctx.builder.eos_id
        stop = None if ended else _budget_stop(traj, ctx, len(turn))
        traj.turn_kinds.append("cut" if stop is not None else "text")
        return text, [], stop or "eos"
    traj.turn_kinds.append("call" if any(c.error is None for c in calls) else "malformed")
    if traj.num_turns >= ctx.config.max_turns:
        traj.messages.append({"role": "assistant", "content": text})
        return text, calls, "max_turns"
    if ctx.budget is not None and not ctx.budget.take_calls(len(calls)):
        traj.messages.append({"role": "assistant", "content": text})
        return text, calls, "budget"
    return text, calls, None


# how a turn without calls may end and still be answered by an environment: the model ended
# it, or it reached agent.max_tokens_per_turn (as in SkyRL and verl, a turn's length cap is
# the environment's to judge); the episode's budgets (response tokens, model length) end it
_ENV_ANSWERS = ("eos", "max_tokens_per_turn")


async def _env_turn(
    ctx: AgentContext, traj: Trajectory, turn: list[int], finish: str, env: Environment
) -> StopReason | None:
    """A model turn answered by an environment that reads every turn (its own actions, not the
    parser's calls): counted, recorded, answered, even when the episode's budget cut it (so its
    reward counts), unless the backend aborted it."""
    traj.num_turns += 1
    text = ctx.tokenizer.decode(turn)
    traj.messages.append({"role": "assistant", "content": text})
    if finish == "abort":
        traj.turn_kinds.append("aborted")
        return "aborted"
    ended = bool(turn) and turn[-1] == ctx.builder.eos_id
    cut = None if ended else _budget_stop(traj, ctx, len(turn))
    traj.turn_kinds.append("cut" if cut is not None else "text")
    if cut in _ENV_ANSWERS:  # the turn's own cap: the environment judges the turn as it is
        cut = None
    return await _env_answer(ctx, traj, turn, text, env, cut)


async def _env_answer(
    ctx: AgentContext,
    traj: Trajectory,
    turn: list[int],
    text: str,
    env: Environment,
    cut: StopReason | None,
) -> StopReason | None:
    """The environment's step on a recorded model turn (its text, and the conversation's
    model messages, without the end-of-turn token): its reward kept per turn (and summed into
    the episode's when it owns the reward), its observation appended (mask 0) unless the
    episode ends here: it says done, a budget ``cut`` the turn, the turns are used up or the
    observation does not fit."""
    t_env = time.perf_counter()
    eos = ctx.tokenizer.decode([ctx.builder.eos_id])
    if turn and turn[-1] == ctx.builder.eos_id:  # its action, as a server's text gives it
        text = ctx.tokenizer.decode(turn[:-1])
    conversation = [  # as verl's loop decodes the model's messages: no end-of-turn token
        {**m, "content": m["content"].removesuffix(eos)} if m["role"] == "assistant" else m
        for m in traj.messages
    ]
    try:
        step = await env.step(text, conversation)
    finally:
        traj.timings["env_s"] += time.perf_counter() - t_env
    traj.turn_rewards.append(step.reward)
    if traj.env_reward is not None:
        traj.env_reward += step.reward
    traj.messages.extend(step.observations)
    if step.done:
        return "env_done"
    if cut is not None:
        return cut
    if traj.num_turns >= ctx.config.max_turns:
        return "max_turns"
    observation = ctx.builder.close_assistant_turn(turn) + ctx.builder.messages_delta(
        step.observations
    )
    stop = _fits(traj, ctx, observation)
    if stop is None:
        traj.append(observation, model=False)
    return stop


def tool_service_failed(traj: Trajectory, text: str, error: ToolTransportError) -> StopReason:
    """Records a turn whose tool service failed (its calls' outcome is unknown): the episode
    ends, not trainable."""
    traj.messages.append({"role": "assistant", "content": text})
    traj.messages.append({"role": "tool", "content": f"tool service failed: {error}"})
    return "tool_error"


def record_results(
    ctx: AgentContext,
    traj: Trajectory,
    turn: list[int],
    text: str,
    calls: list[ParsedCall],
    results: list[ToolResult],
) -> tuple[list[int], StopReason | None]:
    """Records the results of a turn's ``calls`` in ``traj``. Returns the observation's tokens
    and the stop reason when the episode ends here, else None: the caller then appends them."""
    traj.tool_calls += len(calls)
    traj.tool_errors += sum(r.error for r in results)
    traj.turn_rewards.append(sum(r.reward for r in results))
    observation, tool_messages = _observation(ctx, turn, text, calls, results)
    traj.messages.extend(tool_messages)
    # The sequence ends with the model's last tokens: an observation the model would never
    # read (the episode ends here) is kept in the messages, not in the tokens.
    stop = "tool_done" if any(r.done for r in results) else _fits(traj, ctx, observation)
    return observation, stop


def _observation(
    ctx: AgentContext,
    turn: list[int],
    text: str,
    calls: list[ParsedCall],
    results: list[ToolResult],
) -> tuple[list[int], list[dict[str, Any]]]:
    """Tokens appended after a model turn with calls, and the messages they stand for."""
    if ctx.parser.style == "inline":
        parser = cast(InlineToolCallParser, ctx.parser)
        outputs = "".join(parser.format_output(_tool_text(ctx, r)) for r in results)
        messages = [{"role": "assistant", "content": text}, {"role": "tool", "content": outputs}]
        return ctx.tokenizer.encode(outputs), messages
    assistant = {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": c.name or "invalid", "arguments": c.arguments},
            }
            for c in calls
        ],
    }
    tool_messages = [
        _tool_message(c.name, _tool_text(ctx, r)) for c, r in zip(calls, results, strict=True)
    ]
    ids = ctx.builder.close_assistant_turn(turn) + ctx.builder.messages_delta(tool_messages)
    return ids, [assistant, *tool_messages]


def _tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "content": content, "name": name}


def demonstration_trajectory(
    sample: Sample,
    builder: TurnBuilder,
    turns: Sequence[tuple[str, Sequence[tuple[str, str]]]],
) -> Trajectory:
    """The trajectory `run_tool_agent` records when the model writes exactly ``turns``.

    Each turn is (assistant text, [(tool name, tool output), ...]); the text is encoded and
    ended with eos (mask 1), the tool outputs follow as template deltas (mask 0), exactly as
    in a rollout of a chat-style parser. Supervised fine-tuning on these trains the very
    tokens a rollout would score.
    """
    traj = Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        prompt_ids=builder.prompt_ids(sample.messages),
        messages=[dict(m) for m in sample.messages],
    )
    for text, outputs in turns:
        turn = [*builder.tokenizer.encode(text), builder.eos_id]
        traj.append(turn, model=True)
        traj.num_turns += 1
        traj.messages.append({"role": "assistant", "content": text})
        if outputs:
            tool_messages = [_tool_message(name, out) for name, out in outputs]
            traj.append(
                builder.close_assistant_turn(turn) + builder.messages_delta(tool_messages),
                model=False,
            )
            traj.messages.extend(tool_messages)
            traj.tool_calls += len(outputs)
    return traj


async def run_single_turn(sample: Sample, ctx: AgentContext) -> Trajectory:
    """One model turn, no tools (plain RL on completions)."""
    single = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, max_turns=1))
    return await run_tool_agent(sample, single)


async def _react_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """`jax_agent_rl.agent.langgraph_loop.run_react_agent`, imported on first use: importing
    jax_agent_rl never imports LangChain."""
    from jax_agent_rl.agent.langgraph_loop import run_react_agent

    return await run_react_agent(sample, ctx)


async def _openai_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """`jax_agent_rl.agent.openai_endpoint.run_openai_agent`, imported on first use."""
    from jax_agent_rl.agent.openai_endpoint import run_openai_agent

    return await run_openai_agent(sample, ctx)


AGENT_LOOPS: dict[str, AgentLoopFn] = {
    "tool_agent": run_tool_agent,
    "single_turn_agent": run_single_turn,
    "react_agent": _react_agent,
    "openai_agent": _openai_agent,
}


def register_agent_loop(name: str, loop: AgentLoopFn) -> None:
    if name in AGENT_LOOPS:
        raise ValueError(f"agent loop {name!r} is already registered")
    AGENT_LOOPS[name] = loop


async def run_sample(sample: Sample, ctx: AgentContext) -> Trajectory:
    """Runs the loop the sample names.

    An exception out of the loop ends this trajectory only (stop reason ``agent_error``, the
    traceback in ``error``, the prompt in ``messages`` but no tokens), so one failure does not
    lose the other trajectories gathered with it; its tool state is released here, since a
    failed loop may not have released it. Cancellation still propagates.
    """
    if sample.agent_name not in AGENT_LOOPS:
        raise KeyError(
            f"unknown agent_name {sample.agent_name!r}; registered: {sorted(AGENT_LOOPS)}"
        )
    try:
        return await AGENT_LOOPS[sample.agent_name](sample, ctx)
    except Exception:
        error = traceback.format_exc()
    try:
        await ctx.tools.release(sample.uid)
    except Exception:
        error += "\nand then releasing its tool state failed:\n" + traceback.format_exc()
    return Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        prompt_ids=[],
        messages=[dict(m) for m in sample.messages],
        stop_reason="agent_error",
        error=error,
    )
