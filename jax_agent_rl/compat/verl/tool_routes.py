"""verl-tool's protocol on the tool server: ``POST /get_observation`` (`add_verl_tool_routes`,
which the verl wing registers with `jax_agent_rl.tools.app.register_routes`).

verl-tool (``verl_tool/servers/tool_server.py``) sends the text of a model turn per trajectory;
the server reads its tool calls with one parser (``action_parser``), runs them as ``/execute``
calls and answers the observation the model reads next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, model_validator

from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import InlineToolCallParser, ParsedCall, ToolCallParser
from jax_agent_rl.tools.base import ToolResult
from jax_agent_rl.tools.body_limit import until_disconnected
from jax_agent_rl.tools.protocol import ExecuteRequest, RequestCaps, RequestNamespace
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool

# why /get_observation is refused on a server without the policy's tokenizer
NO_TOKENIZER = (
    "verl-tool's client reads special-token text in an observation as special tokens (a tool "
    "result could forge a turn): start the tool server with --tokenizer <the policy's "
    "tokenizer folder> (tool_server.tokenizer), whose special tokens' text is then written "
    "with a word joiner in observations"
)


class ObservationRequest(BaseModel):
    """verl-tool's request (``verl_tool/servers/tool_server.py`` ``ActionRequest``): per
    trajectory, an action (the text of a model turn), whether the trajectory is finished,
    whether this is its last step, and its extra fields (the dataset row's ``extra_info``)."""

    trajectory_ids: list[str] = Field(min_length=1)
    actions: list[str]
    finish: list[bool] | None = None
    is_last_step: list[bool] | None = None
    extra_fields: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_item_per_trajectory(self) -> ObservationRequest:
        n = len(self.trajectory_ids)
        for key in ("actions", "finish", "is_last_step", "extra_fields"):
            items = getattr(self, key)
            if items is not None and len(items) != n:
                raise ValueError(f"{key} has {len(items)} items for {n} trajectory_ids")
        return self


def observation_text(parser: ToolCallParser, texts: list[str], tokenizer: Tokenizer) -> str:
    """What verl-tool's client appends after the action: each result as the parser's model
    reads it (an inline parser's output block; for a chat parser, Hermes ``<tool_response>``
    blocks, the content a chat template renders for tool messages), its special tokens' text
    (``tokenizer``'s) written with a word joiner (`Tokenizer.defused`): verl-tool's client
    encodes the observation with its tokenizer's special tokens read as such, so a result
    printing ``<|im_end|>\n<|im_start|>assistant`` forged a turn in the trajectory."""
    texts = [tokenizer.defused(t) for t in texts]
    if parser.style == "inline":
        inline = cast(InlineToolCallParser, parser)
        return "".join(inline.format_output(t) for t in texts)
    return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)


def add_verl_tool_routes(
    app: FastAPI,
    parser: ToolCallParser,
    caps: RequestCaps,
    run: Callable[[str, ExecuteRequest], Awaitable[dict[str, Any]]],
    free: Callable[[str, str], Awaitable[dict[str, Any]]],
    authorize: Callable[..., Awaitable[None]],
    tokenizer: Tokenizer | None,
) -> None:
    """Adds verl-tool's protocol to ``app``, over the calls and releases of its ``/execute``
    and ``/release`` routes (``run`` and ``free``, in the request's namespace).

    ``POST /get_observation`` serves verl-tool's client (``verl_tool/agent_loop``): for each
    trajectory, ``finish`` releases its state and answers an empty observation; otherwise the
    action is parsed into tool calls, which run like ``/execute`` calls (concurrently, with
    the create kwargs of ``extra_fields[i]["tools_kwargs"]``), and the observation is
    ``{"obs": text, "reward": sum of the calls' rewards}``; ``is_last_step`` releases the state
    afterwards. ``dones`` is whether a tool ended the trajectory (or it finished); ``valids``
    whether the action held calls and none was malformed (``invalid_reason`` says why not).
    An action of more than ``caps.max_action_calls`` calls runs none of them: its observation
    is an error naming the cap, and it is invalid. A request of more than
    ``caps.max_batch_calls`` trajectories, or with an id over ``caps.max_id_bytes``, is refused,
    and so is every request to a server without the policy's ``tokenizer`` (501, naming
    ``--tokenizer``): the observation's special-token text is written with its tokenizer
    (`observation_text`).
    verl-tool instead routes each action to the first of its tools whose own
    ``parse_action`` accepts it; here the one parser reads them all. verl-tool's client sends
    no bearer token and no namespace: give the server no token (loopback) or put a proxy that
    adds both headers in front; without a namespace its trajectories are in the unnamed one.
    """

    async def run_call(
        namespace: str, trajectory_id: str, call: ParsedCall, create_kwargs: dict[str, Any]
    ) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: {call.error}", error=True)
        request = ExecuteRequest(
            trajectory_id=trajectory_id,
            name=call.name,
            arguments=call.arguments,
            create_kwargs=create_kwargs,
        )
        return ToolResult(**await run(namespace, request))

    async def observe(
        namespace: str,
        trajectory_id: str,
        action: str,
        last: bool,
        create_kwargs: dict[str, dict[str, Any]],
        known: Tokenizer,
    ) -> tuple[dict[str, Any], bool, bool]:
        """One trajectory's observation, done and valid for its action (see above)."""
        calls = parser.parse(action)
        if len(calls) > caps.max_action_calls:
            why = (
                f"{len(calls)} tool calls in one action, over the cap of "
                f"{caps.max_action_calls} (max_action_calls); none ran"
            )
            if last:
                await free(namespace, trajectory_id)
            text = observation_text(parser, [f"error: {why}"], known)
            return {"obs": text, "reward": None, "invalid_reason": why}, False, False
        results = await asyncio.gather(
            *(run_call(namespace, trajectory_id, c, create_kwargs.get(c.name, {})) for c in calls)
        )
        if last:
            await free(namespace, trajectory_id)
        obs: dict[str, Any] = {
            "obs": observation_text(parser, [r.text for r in results], known),
            "reward": sum(r.reward for r in results) if results else None,
        }
        malformed = [c.error for c in calls if c.error is not None]
        if not calls:
            obs["invalid_reason"] = f"no tool call found by the {parser.name} parser"
        elif malformed:
            obs["invalid_reason"] = f"malformed tool call(s): {malformed}"
        return obs, any(r.done for r in results), bool(calls) and not malformed

    @app.post("/get_observation", dependencies=[Depends(authorize)])
    async def get_observation(
        req: ObservationRequest, namespace: RequestNamespace, request: Request
    ) -> dict[str, Any]:
        known = tokenizer
        if known is None:
            raise HTTPException(status_code=501, detail=NO_TOKENIZER)
        n = len(req.trajectory_ids)
        caps.check_batch(n, "trajectories")
        for trajectory_id in req.trajectory_ids:
            caps.check_id(trajectory_id)
        finish = req.finish or [False] * n
        last = req.is_last_step or [False] * n
        try:
            create_kwargs = [create_kwargs_by_tool(f) for f in req.extra_fields or [{}] * n]
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from e

        async def one(i: int) -> tuple[dict[str, Any], bool, bool]:
            if finish[i]:
                await free(namespace, req.trajectory_ids[i])
                return {"obs": "", "reward": None}, True, True
            trajectory_id, action = req.trajectory_ids[i], req.actions[i]
            return await observe(namespace, trajectory_id, action, last[i], create_kwargs[i], known)

        # (a client that went away: its calls are cancelled, not run on, holding the slots)
        out = await until_disconnected(request, asyncio.gather(*(one(i) for i in range(n))))
        return {
            "observations": [o for o, _, _ in out],
            "dones": [d for _, d, _ in out],
            "valids": [v for _, _, v in out],
        }
