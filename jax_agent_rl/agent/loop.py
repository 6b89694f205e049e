"""The agent loop: one coroutine per trajectory, tokens in and tokens out.

``run_tool_agent`` alternates model turns and tool calls against any `RolloutBackend` and any
`ToolExecutor`. Model tokens are appended exactly as sampled (mask 1, with their logprobs);
every other token comes from the chat template as a delta (mask 0), so ``prompt_ids +
response_ids`` is what the model saw. Tool calls of one turn run concurrently, at most
``agent.max_parallel_tool_calls`` of a trajectory at once (`ToolCallSlots`) and at most
``agent.max_tool_calls_per_turn`` of a turn in all (`cap_calls`); a malformed or refused call
is answered with a tool message saying what was wrong. Every trajectory ends with a
`StopReason`, and its tool state is always released; an unexpected exception ends only its own
trajectory (``agent_error``, see `run_sample`).

The steps a loop is made of are public, each taking ``(ctx, traj, ...)``, and every other loop
(the LangGraph loop, the OpenAI endpoint, a tree's episodes) is made of them: `budget_stop`
(before a turn), `model_turn` (sampled into the trajectory), `read_turn` (its text and calls),
`call_tools` / `call_tool`, `record_results` (and `fits`: whether an observation fits), then
`Trajectory.add_observation`; `take_turn` is one whole turn, `run_episode` one whole episode.

A sample's ``agent_name`` picks the loop from `AGENT_LOOPS`: ``tool_agent`` and
``single_turn_agent``, spelled as verl spells them, ``react_agent`` (the same episode driven by
a LangGraph graph, `jax_agent_rl.agent.langgraph_loop`, loaded by name on first use),
``openai_agent`` (the episode driven by a user's harness through an OpenAI-compatible endpoint,
`jax_agent_rl.agent.openai_endpoint`, likewise), or a user loop added with
`register_agent_loop`. Datasets are checked against these names when they are loaded."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import traceback
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from jax_agent_rl.agent.context import AgentContext, RefusedCall, cap_calls
from jax_agent_rl.agent.observations import env_observation, tool_observation
from jax_agent_rl.agent.trajectory import UNTRAINABLE, StopReason, Trajectory, TurnKind
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.base import EnvError, Environment, EnvStepError
from jax_agent_rl.protocol import GenerateRequest, SamplingParams
from jax_agent_rl.rollout.stops import stop_string_end
from jax_agent_rl.tokenization import Message
from jax_agent_rl.tokenization.tool_calls import ParsedCall
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.registry import ToolTransportError
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool
from jax_agent_rl.usercode.load import load_function

AgentLoopFn = Callable[[Sample, AgentContext], Awaitable[Trajectory]]


def budget_stop(ctx: AgentContext, traj: Trajectory, turn_tokens: int = 0) -> StopReason | None:
    """The budget that ends the episode before its next model token (a turn that has sampled
    ``turn_tokens`` so far), else None."""
    cfg = ctx.config
    if ctx.budget is not None and ctx.budget.spent:
        return "budget"
    if len(traj.prompt_ids) + len(traj.response_ids) >= cfg.max_model_len:
        return "max_model_len"
    if traj.response_tokens >= cfg.max_response_tokens:
        return "max_response_tokens"
    if turn_tokens >= cfg.max_tokens_per_turn:
        return "max_tokens_per_turn"
    return None


def fits(ctx: AgentContext, traj: Trajectory, ids: list[int]) -> StopReason | None:
    """None if ``ids`` plus at least one more model token fit the budgets, else the budget
    that they exhaust."""
    total = len(traj.prompt_ids) + len(traj.response_ids) + len(ids)
    if total >= ctx.config.max_model_len:
        return "max_model_len"
    if traj.response_tokens + len(ids) >= ctx.config.max_response_tokens:
        return "max_response_tokens"
    return None


def _request_seed(ctx: AgentContext, tag: str) -> int | None:
    """The seed of request ``tag``: none without a run seed, and none for a backend that
    draws seeds itself (it refuses them: sampling is set per server)."""
    if ctx.seed is None or not ctx.backend.capabilities.per_request_sampling:
        return None
    return zlib.crc32(f"{ctx.seed}/{tag}".encode())


async def _generate(ctx: AgentContext, traj: Trajectory, turn_tokens: int) -> tuple[list[int], str]:
    """One request for the trajectory's next tokens (its ``n``-th: one weight version is
    recorded per request), appended to it: those up to the one that completes a stop string
    (``agent.stop``, `stop_string_end`; finish ``stop_string``), whatever the backend sent
    after it dropped with their logprobs."""
    cfg = ctx.config
    n = len(traj.weight_versions)
    max_tokens = min(
        cfg.max_tokens_per_turn - turn_tokens,
        cfg.max_response_tokens - traj.response_tokens,
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
        stop=cfg.stop,
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
    tokens, finish = list(result.token_ids), str(result.finish_reason)
    logprobs = list(result.logprobs or [0.0] * len(tokens))
    experts, versions, kv = result.expert_ids, result.token_versions, result.kv_versions
    turn = [*traj.response_ids[len(traj.response_ids) - turn_tokens :], *tokens]
    end = stop_string_end(ctx.tokenizer.decode, turn, cfg.stop, len(tokens))
    if end is not None and finish != "abort":
        kept = end - turn_tokens
        tokens, logprobs, finish = tokens[:kept], logprobs[:kept], "stop_string"
        experts = None if experts is None else experts[:kept]
        versions, kv = (None if x is None else x[:kept] for x in (versions, kv))
    traj.add_sample(tokens, logprobs, result.weight_version, experts, versions, kv)
    traj.resent_requests += result.resent
    return tokens, finish


async def model_turn(ctx: AgentContext, traj: Trajectory) -> tuple[list[int], str]:
    """One model turn, appended to ``traj``: one or more generate requests (an inline block
    that stopped at its opening fence is continued). Returns its tokens and the last finish
    reason."""
    turn: list[int] = []
    while True:
        tokens, finish = await _generate(ctx, traj, len(turn))
        turn += tokens
        if finish in ("abort", "budget", "stop_string"):
            return turn, finish
        if not ctx.parser.needs_more(ctx.tokenizer.decode(turn)):
            return turn, finish
        if budget_stop(ctx, traj, len(turn)):
            return turn, finish


def read_turn(
    ctx: AgentContext, traj: Trajectory, turn: list[int], finish: str
) -> tuple[str, list[ParsedCall], StopReason | None]:
    """A model turn's text and calls (those past its cap refused, `cap_calls`), counted in
    ``traj``, and the stop reason when the episode ends with this turn (no call, or calls past
    a budget), else None: the calls run (and `record_results` records the turn's message with
    theirs)."""
    text = ctx.tokenizer.decode(turn)
    if finish == "abort":
        traj.add_turn("aborted")
        return text, [], "aborted"
    calls = cap_calls(ctx.parser.parse(text), ctx.config.max_tool_calls_per_turn)
    if not calls:
        ended = bool(turn) and turn[-1] == ctx.builder.eos_id
        cut = None if ended else budget_stop(ctx, traj, len(turn))
        traj.add_turn("cut" if cut is not None else "text", text)
        return text, [], cut or "eos"
    kind: TurnKind = "call" if any(c.error is None for c in calls) else "malformed"
    stop: StopReason | None = None
    if traj.num_turns + 1 >= ctx.config.max_turns:
        stop = "max_turns"
    elif ctx.budget is not None and not ctx.budget.take_calls(len(calls)):
        stop = "budget"
    traj.add_turn(kind, None if stop is None else text)
    return text, calls, stop


async def call_tool(
    ctx: AgentContext,
    traj: Trajectory,
    call: ParsedCall,
    create_kwargs: Mapping[str, dict[str, Any]],
) -> ToolResult:
    """One call of a turn: a malformed or refused one (`RefusedCall`) is answered with what was
    wrong, the others by the executor (with the sample's ``create_kwargs`` of that tool) once
    one of the trajectory's ``max_parallel_tool_calls`` slots is free."""
    if call.error is not None:
        traj.add_unrun_call(refused=isinstance(call, RefusedCall))
        return ToolResult(f"error: {call.error}", error=True)
    kwargs = create_kwargs.get(call.name)
    async with ctx.tool_slots.hold(traj.uid, ctx.config.max_parallel_tool_calls):
        return await ctx.tools.call(traj.uid, call.name, call.arguments, kwargs)


async def call_tools(
    ctx: AgentContext,
    traj: Trajectory,
    calls: list[ParsedCall],
    create_kwargs: Mapping[str, dict[str, Any]],
) -> list[ToolResult]:
    """A turn's calls, run concurrently (`call_tool`); their time is kept in ``traj``. A turn
    that calls ``agent.sub_agent_tool`` runs its calls one after another, each sub-agent in
    the trajectory's samples (`run_sub_agent`)."""
    t_tools = time.perf_counter()
    try:
        if ctx.sub_builder is None or all(c.name != ctx.config.sub_agent_tool for c in calls):
            calls_run = (call_tool(ctx, traj, c, create_kwargs) for c in calls)
            return list(await asyncio.gather(*calls_run))
        return [await _sub_or_tool(ctx, traj, c, create_kwargs) for c in calls]
    finally:
        traj.add_time("tools_s", time.perf_counter() - t_tools)


async def _sub_or_tool(
    ctx: AgentContext, traj: Trajectory, call: ParsedCall, create_kwargs: Mapping[str, Any]
) -> ToolResult:
    if call.error is None and call.name == ctx.config.sub_agent_tool:
        return await run_sub_agent(ctx, traj, call, create_kwargs)
    return await call_tool(ctx, traj, call, create_kwargs)


async def run_sub_agent(
    ctx: AgentContext,
    traj: Trajectory,
    call: ParsedCall,
    create_kwargs: Mapping[str, dict[str, Any]],
) -> ToolResult:
    """A call of ``agent.sub_agent_tool``: the same policy in a context of its own (the call's
    ``task`` as its user message, the tools but this one) plays turns in a new sample of
    ``traj`` until it answers without calls or a budget ends it; then the parent's sample goes
    on, and the call's result is the sub-agent's last answer (its text, thinking and the
    end-of-turn token dropped), an error result when a budget cut it. The episode's budgets
    span it (its turns count in ``agent.max_turns``, its tokens in
    ``agent.max_response_tokens``); its samples are the episode's, trained with its reward
    (docs/agents.md)."""
    assert ctx.sub_builder is not None
    task = call.arguments.get("task") if isinstance(call.arguments, dict) else None
    if not isinstance(task, str) or not task:
        return ToolResult(f'error: {call.name} takes {{"task": a non-empty string}}', error=True)
    sub = dataclasses.replace(
        ctx,
        builder=ctx.sub_builder,
        sub_builder=None,
        config=dataclasses.replace(ctx.config, sub_agent_tool=""),
    )
    asked: Message = {"role": "user", "content": task}
    parent = traj.sample
    prompt = await asyncio.to_thread(sub.builder.prompt_ids, [asked])
    traj.start_sample(prompt)
    traj.add_messages([asked])
    start = len(traj.messages)
    try:
        while (stop := await take_turn(sub, traj, create_kwargs)) is None:
            pass
    finally:
        traj.resume_sample(parent)
    said = [m for m in traj.messages[start:] if m["role"] == "assistant"]
    text = said[-1]["content"] if said else ""
    answer = THINKING.sub("", text.removesuffix(ctx.tokenizer.eos_token or ""))
    if stop in UNTRAINABLE:  # (aborted, a tool service down: not the policy's outcome)
        raise RuntimeError(f"the sub-agent's episode ended {stop}")
    return ToolResult(answer, error=stop != "eos")


def record_results(
    ctx: AgentContext,
    traj: Trajectory,
    turn: list[int],
    text: str,
    calls: list[ParsedCall],
    results: list[ToolResult],
) -> tuple[list[int], StopReason | None]:
    """Records the results of a turn's ``calls`` in ``traj``. Returns the observation's tokens
    and the stop reason when the episode ends here, else None: the caller then appends them
    (`Trajectory.add_observation`)."""
    observation, messages = tool_observation(ctx, traj, turn, text, calls, results)
    traj.add_tool_results(results, [c.name for c in calls], messages)
    # The sequence ends with the model's last tokens: an observation the model would never
    # read (the episode ends here) is kept in the messages, not in the tokens.
    stop = "tool_done" if any(r.done for r in results) else fits(ctx, traj, observation)
    return observation, stop


def tool_service_failed(traj: Trajectory, text: str, error: ToolTransportError) -> StopReason:
    """Records a turn whose tool service failed (its calls' outcome is unknown): the episode
    ends, not trainable."""
    assistant = {"role": "assistant", "content": text}
    traj.add_messages([assistant, {"role": "tool", "content": f"tool service failed: {error}"}])
    return "tool_error"


async def take_turn(
    ctx: AgentContext,
    traj: Trajectory,
    create_kwargs: Mapping[str, dict[str, Any]],
    env: Environment | None = None,
) -> StopReason | None:
    """One turn of ``traj``: a model turn, the tools it calls or the environment ``env``'s
    answer, and their observation. Returns the stop reason when the episode ends (a budget
    before the turn included), else None: the trajectory then ends with an observation, at a
    turn boundary."""
    stop = budget_stop(ctx, traj)
    if stop is not None:
        return stop
    turn, finish = await model_turn(ctx, traj)
    if finish == "budget" and not turn:
        return "budget"
    return await finish_turn(ctx, traj, turn, finish, create_kwargs, env)


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
    try:
        results = await call_tools(ctx, traj, calls, create_kwargs or {})
    except ToolTransportError as e:
        return tool_service_failed(traj, text, e)
    observation, stop = record_results(ctx, traj, turn, text, calls, results)
    if stop is None:
        traj.add_observation(observation)
    return stop


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
    text = ctx.tokenizer.decode(turn)
    if finish == "abort":
        traj.add_turn("aborted", text)
        return "aborted"
    ended = bool(turn) and turn[-1] == ctx.builder.eos_id
    cut = None if ended else budget_stop(ctx, traj, len(turn))
    traj.add_turn("cut" if cut is not None else "text", text)
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
    try:  # (a `GuardedEnvironment`: its answer is checked, native environments' included)
        step = await env.step(text, conversation)
    finally:
        traj.add_time("env_s", time.perf_counter() - t_env)
    observations = env_observation(step.observations, ctx.config.max_observation_chars, traj)
    traj.add_env_step(step.reward, observations, step.success)
    if step.done:
        return "env_done"
    if cut is not None:
        return cut
    if traj.num_turns >= ctx.config.max_turns:
        return "max_turns"
    observation = ctx.builder.close_assistant_turn(turn) + ctx.builder.messages_delta(observations)
    stop = fits(ctx, traj, observation)
    if stop is None:
        traj.add_observation(observation)
    return stop


# The tool loop's context rewrites between turns (``agent.context``): compaction and thinking
# stripping. Each gives the next model call a prompt that does not extend the sequence so far,
# so that call starts a new sample of the episode (`Trajectory.start_sample`), trained
# token-exactly with the episode's reward (docs/agents.md).
#
# - ``compact``: once the current sample's context (prompt and response) reaches
#   ``agent.context.compact`` tokens at a turn boundary, the model is asked for a summary: its
#   conversation rendered again, then a user message ``compact_prompt``, is the prompt of a new
#   sample whose response is the summary (a model turn, mask 1; calls in it are not run). The
#   episode goes on from a third context: its prompt messages and the summary (after
#   ``summary_prefix``, as a user message), thinking dropped from it.
# - ``strip_thinking``: after a model turn that thought (``<think>...</think>``), the
#   conversation is rendered again with every assistant message's thinking dropped, and the
#   next turn samples from that (a new sample), as Qwen3's chat templates render history.
#
# A context rendered again holds each assistant message as its text (the model's calls as it
# wrote them) without its end-of-turn token, and each other message's role, content and name.

THINKING = re.compile(r"<think>.*?</think>\s*", re.S)


@dataclasses.dataclass
class Context:
    """The conversation the current sample holds: ``head`` (the messages a compaction put
    there), then the trajectory's messages from ``start`` on; ``prompt``: the episode's."""

    prompt: list[Message]
    head: list[Message] = dataclasses.field(default_factory=list)
    start: int = 0

    @classmethod
    def of(cls, traj: Trajectory) -> Context:
        """The context of an episode whose prompt is set, before its first turn."""
        return cls([dict(m) for m in traj.messages])

    def messages(self, traj: Trajectory) -> list[Message]:
        return [*self.head, *traj.messages[self.start :]]


def context_messages(ctx: AgentContext, messages: list[Message], strip: bool) -> list[Message]:
    """``messages`` as a context rendered again shows them (module doc), each assistant
    message's thinking dropped when ``strip``."""
    eos = ctx.tokenizer.eos_token or ""
    out: list[Message] = []
    for m in messages:
        if m["role"] == "assistant":
            text = m["content"].removesuffix(eos)
            out.append({"role": "assistant", "content": THINKING.sub("", text) if strip else text})
        else:
            out.append({k: m[k] for k in ("role", "content", "name") if k in m})
    return out


async def rewrite_context(
    ctx: AgentContext, traj: Trajectory, context: Context
) -> StopReason | None:
    """At a turn boundary of ``traj``: compacts it when its context is due (`compact`), else
    renders it again without thinking when its last turn thought and ``strip_thinking`` is
    on. Returns the stop reason when the episode ends here (the summary turn met a budget)."""
    cfg = ctx.config.context
    if cfg.compact and len(traj.prompt_ids) + len(traj.response_ids) >= cfg.compact:
        return await compact(ctx, traj, context)
    said = context.messages(traj)
    last = next((m for m in reversed(said) if m["role"] == "assistant"), None)
    if cfg.strip_thinking and last is not None and THINKING.search(last["content"]):
        await _restart(ctx, traj, context_messages(ctx, said, strip=True))
    return None


async def compact(ctx: AgentContext, traj: Trajectory, context: Context) -> StopReason | None:
    """The summary turn, in a sample of its own, then the episode's context from its prompt
    and the summary (module doc); the stop reason when the summary turn ends the episode."""
    cfg = ctx.config.context
    ask: Message = {"role": "user", "content": cfg.compact_prompt}
    said = context_messages(ctx, context.messages(traj), cfg.strip_thinking)
    await _restart(ctx, traj, [*said, ask])
    traj.add_messages([ask])
    stop = budget_stop(ctx, traj)
    if stop is not None:
        return stop
    turn, finish = await model_turn(ctx, traj)
    if finish == "budget" and not turn:
        return "budget"
    text = ctx.tokenizer.decode(turn)
    if finish == "abort":
        traj.add_turn("aborted", text)
        return "aborted"
    traj.add_turn("text" if turn and turn[-1] == ctx.builder.eos_id else "cut", text)
    summary = THINKING.sub("", text.removesuffix(ctx.tokenizer.eos_token or ""))
    told: Message = {"role": "user", "content": cfg.summary_prefix + summary}
    traj.add_messages([told])
    context.head, context.start = [*context.prompt, told], len(traj.messages)
    await _restart(ctx, traj, context.head)
    return None


async def _restart(ctx: AgentContext, traj: Trajectory, messages: list[Message]) -> None:
    """A new sample from ``messages`` rendered as a prompt (in a thread: a long conversation
    renders for seconds, and the event loop holds every other episode)."""
    traj.start_sample(await asyncio.to_thread(ctx.builder.prompt_ids, messages))


Play = Callable[[Trajectory, Environment | None], Awaitable[StopReason]]


async def run_episode(
    sample: Sample, ctx: AgentContext, play: Play, drives_envs: bool = False
) -> Trajectory:
    """A trajectory of ``sample`` played by ``play`` (which returns how it ended) from its
    prompt, or, by a loop that ``drives_envs``, against its environment (`jax_agent_rl.envs`)
    from the messages the environment starts it with (another loop refuses a sample with one):
    timed, an environment's failure kept as ``env_error`` (its step's on the policy's action
    as ``caused_error``) and any other exception as ``agent_error``, its environment closed
    (a close that fails after a trainable end keeps it: the steps decided the outcome, and a
    policy that made the close fail would otherwise escape it) and its tool state released."""
    t_start = time.perf_counter()
    traj = Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        prompt_ids=[],
        messages=[dict(m) for m in sample.messages],
        timings={"tools_s": 0.0},
    )
    env = None
    try:
        if not drives_envs and ctx.envs.plays(sample):
            raise ValueError(
                f"agent_name {sample.agent_name!r} does not drive environments; sample "
                f"{sample.uid!r} names one (env_class or interaction_kwargs): use tool_agent"
            )
        env = ctx.envs.make(sample)
        messages = traj.messages
        if env is not None:
            traj.start_env(env.owns_reward)
            messages = await env.reset(sample)
        # built in a thread: templating and tokenizing an environment's 12M-character prompt
        # held the event loop, and every other episode, 34.9 s
        traj.set_prompt(messages, await asyncio.to_thread(ctx.builder.prompt_ids, messages))
        traj.end(await play(traj, env))
    except EnvStepError:  # on the policy's action: its fault (`GuardedEnvironment.step`)
        traj.end("caused_error", traceback.format_exc())
    except EnvError:  # the environment failed: this episode ends, counted
        traj.end("env_error", traceback.format_exc())
    except Exception:  # this trajectory's failure, kept with what it did until then
        traj.end("agent_error", traceback.format_exc())
    finally:
        try:
            if env is not None:
                await env.close()
        except EnvError:  # after its outcome was decided by its steps, it keeps it, else ends
            if traj.trainable:  # (trained on its real outcome: no escape, no false penalty)
                traj.add_error(f"\nthen its environment's close failed:\n{traceback.format_exc()}")
            else:
                traj.end("env_error", traceback.format_exc())
        finally:
            traj.add_time("total_s", time.perf_counter() - t_start)
            await ctx.tools.release(traj.uid)
    return traj


async def run_tool_agent(sample: Sample, ctx: AgentContext) -> Trajectory:
    """Model turns and tool calls until the model stops, a budget runs out or a tool ends it;
    between turns, the context rewrites ``agent.context`` asks for (`rewrite_context`)."""

    async def play(traj: Trajectory, env: Environment | None) -> StopReason:
        create_kwargs = create_kwargs_by_tool(sample.extra)  # extra_info.tools_kwargs
        context = Context.of(traj)
        while (stop := await take_turn(ctx, traj, create_kwargs, env)) is None:
            if (stop := await rewrite_context(ctx, traj, context)) is not None:
                break
        return stop

    return await run_episode(sample, ctx, play, drives_envs=True)


async def run_single_turn(sample: Sample, ctx: AgentContext) -> Trajectory:
    """One model turn, no tools (plain RL on completions)."""
    single = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, max_turns=1))
    return await run_tool_agent(sample, single)


# the loops by agent_name: a function, or the module:function of a loop in a module of its own,
# loaded on first use as user code is (`load_function`): importing jax_agent_rl never imports
# LangChain or FastAPI, and those loops import this one, never the other way round
AGENT_LOOPS: dict[str, AgentLoopFn | str] = {
    "tool_agent": run_tool_agent,
    "single_turn_agent": run_single_turn,
    "react_agent": "jax_agent_rl.agent.langgraph_loop:run_react_agent",
    "openai_agent": "jax_agent_rl.agent.openai_endpoint:run_openai_agent",
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
    loop = AGENT_LOOPS[sample.agent_name]
    try:
        if isinstance(loop, str):
            loop = load_function(loop, f"agent_name {sample.agent_name}")
        return await loop(sample, ctx)
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
