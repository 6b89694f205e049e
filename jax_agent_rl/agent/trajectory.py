"""What a rollout produces and the learner consumes: one token-exact `Trajectory`."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jax_agent_rl.tokenization import Message

StopReason = Literal[
    "eos",  # the model ended its turn without calling a tool
    "max_turns",  # it asked for tools after its last allowed turn
    "max_tokens_per_turn",  # one turn used its whole token budget without a call
    "max_response_tokens",  # all response tokens (model + tool) used up
    "max_model_len",  # prompt + response reached the model length
    "tool_done",  # a tool ended the episode
    "tool_error",  # the tool service failed (transport); the trajectory is not trainable
    "aborted",  # the rollout backend aborted a generation
    "budget",  # the rollout strategy's budget ran out (a tree's model tokens or tool calls)
    "env_done",  # the environment (jax_agent_rl.envs) ended the episode
    # the environment failed (raised, hung, answered malformed); its error is in
    # `Trajectory.error`; not trainable
    "env_error",
    # an unexpected exception (a parser, a tool executor, a custom loop, the tokenizer...) ended
    # this trajectory only; its traceback is in `Trajectory.error`; not trainable
    "agent_error",
    # a harness behind the OpenAI endpoint rewrote earlier turns or sent a request the endpoint
    # cannot take (agent/openai_endpoint.py); what went wrong is in `Trajectory.error`; not
    # trainable
    "harness_error",
]
STOP_REASONS: tuple[str, ...] = StopReason.__args__  # type: ignore[attr-defined]
TurnKind = Literal["call", "malformed", "text", "cut", "aborted"]


@dataclasses.dataclass
class Sample:
    """One prompt of a dataset, in verl's column layout."""

    uid: str
    messages: list[Message]
    ground_truth: Any = None
    data_source: str = ""
    agent_name: str = "tool_agent"
    env_class: str = ""  # the environment that plays it (SkyRL's column; jax_agent_rl.envs)
    group_id: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trajectory:
    """A whole multi-turn episode as the model saw it.

    ``response_ids`` is every token after the prompt, model and tool alike; ``loss_mask`` is 1
    on sampled tokens and 0 elsewhere; ``rollout_logprobs`` holds the sampler's logprob of each
    sampled token (0 where the mask is 0), and ``token_versions`` the weight version that
    sampled it (-1 where the model did not sample the token here: tool and template tokens,
    demonstrations); ``weight_versions`` has one entry per sampled turn. ``prompt_ids +
    response_ids`` is exactly the last sequence the model was conditioned on plus what it
    sampled.
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    # each answered turn's reward: its tool calls' (summed), or its environment step's
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    # the episode's reward when its environment owns it (the sum of its step rewards), else None
    env_reward: float | None = None
    num_turns: int = 0
    stop_reason: StopReason = "eos"
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    messages: list[Message] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    malformed_calls: int = 0
    tool_errors: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None  # what ended it (stop reasons agent_error, harness_error)
    reruns: int = 0  # times it was run again from its prompt after its tool service failed
    # how each model turn ended: "call" (a well-formed tool call), "malformed" (calls, none
    # well-formed), "text" (no call, an end of turn), "cut" (no call, a budget), "aborted"
    turn_kinds: list[TurnKind] = dataclasses.field(default_factory=list)
    filtered_by: str | None = None  # the filter (agent.filters) that left it out of updates
    # a branch of a tree rollout (agent/tree.py): the trajectory whose first
    # ``forked_tokens`` response tokens (and ``forked_calls`` tool calls) it shares
    forked_from: str | None = None
    forked_tokens: int = 0
    forked_calls: int = 0
    # per response token, for traced trajectories the learner trained on (`train.step.learn`):
    # its "learner_logprobs" and "advantages" (None where it trained no such token)
    learner_signals: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)

    def append(
        self,
        ids: list[int],
        model: bool,
        logprobs: list[float] | None = None,
        version: int = -1,
    ) -> None:
        """Appends ``ids``: sampled by the model (``model``) under weight ``version`` with
        ``logprobs``, or context (tool results, template tokens)."""
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        self.rollout_logprobs.extend(logprobs if model and logprobs else [0.0] * len(ids))
        self.token_versions.extend([version if model else -1] * len(ids))

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version that sampled one of its tokens (None: none sampled)."""
        return min((v for v in self.token_versions if v >= 0), default=None)

    @property
    def trainable(self) -> bool:
        """False for episodes cut short by infrastructure (their outcome says nothing), and
        for those a filter left out."""
        return self.filtered_by is None and self.stop_reason not in (
            "tool_error",
            "aborted",
            "agent_error",
            "env_error",
            "harness_error",
        )

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def own_model_tokens(self) -> int:
        """The model tokens sampled for this trajectory alone (a branch shares the rest)."""
        return sum(self.loss_mask[self.forked_tokens :])

    @property
    def own_tool_calls(self) -> int:
        """The tool calls made for this trajectory alone (a branch shares the rest)."""
        return self.tool_calls - self.forked_calls
