"""What a rollout produces: one token-exact `Trajectory`, which keeps its own books
(`Trajectory.add_sample`, `add_turn`, `add_observation`...): the agent loops call these and
never edit its fields, nor does the trainer, which returns what it adds (reward, success, filters,
reruns: `jax_agent_rl.agent.episode.Episode`). What the learner reads of it is its
`Trajectory.train_sequences`.

An episode is a sequence of model calls. Calls whose prompt extends the sequence so far
(``prompt_ids + response_ids``) append to it: that is one sample, today's append-only
trajectory. A call whose prompt does not (the harness compacted its context, stripped earlier
thinking, or called a sub-agent with a context of its own) starts a new sample
(`Trajectory.start_sample`) from exactly that prompt; a call that extends an earlier sample
again (the parent after its sub-agent answered) goes back to it (`resume_sample`). Each sample
is one training row sharing the episode's reward (the per-turn rules: docs/agents.md)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.models.moe import NO_EXPERTS
from jax_agent_rl.rewards import RewardError, checked_reward
from jax_agent_rl.rl.sequence import TrainSequence, oldest_version
from jax_agent_rl.tokenization import Message
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import ToolResult

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
    # the policy's own text made what it reached fail, where nothing can be run again to tell
    # otherwise: the environment's step on its action (raised, hung, answered malformed), or
    # the harness after a model turn reached it (it raised, sent a request the endpoint
    # refused, held its episode past agent.harness_timeout_s): its error is in
    # `Trajectory.error`; its outcome is 0 (at most, an environment's reward so far) and it
    # is trained on, as a wrong answer (docs/environments.md, docs/harness.md)
    "caused_error",
    # a harness behind the OpenAI endpoint failed before any model turn reached it: it raised,
    # sent a request the endpoint cannot take, never asked within agent.harness_timeout_s
    # (agent/openai_endpoint.py); what went wrong is in `Trajectory.error`; not trainable
    "harness_error",
    # its reward is not a finite number within rewards.MAX_ABS_REWARD (the reward function's,
    # the environment's or the weighted turn rewards' sum), or the reward function raised
    # (data.reward / data.rewards_by_source: the function, the row and the traceback); the
    # trainer's, never a loop's (`Episode.stop_reason`): what went wrong is in `Episode.error`;
    # its reward is 0 and it is not trainable
    "reward_error",
]
STOP_REASONS: tuple[str, ...] = StopReason.__args__  # type: ignore[attr-defined]
# the stop reasons of episodes cut short by infrastructure, or whose reward failed: their
# outcome says nothing of the policy, and updates leave them out
UNTRAINABLE = ("tool_error", "aborted", "agent_error", "env_error", "harness_error", "reward_error")
TurnKind = Literal["call", "malformed", "text", "cut", "aborted"]


@dataclasses.dataclass
class Trajectory:
    """A whole multi-turn episode as the model saw it.

    ``response_ids`` is every token after the prompt, model and tool alike; ``loss_mask`` is 1
    on sampled tokens and 0 elsewhere; ``rollout_logprobs`` holds the sampler's logprob of each
    sampled token (0 where the mask is 0), and ``token_versions`` the weight version that
    sampled it (-1 where the model did not sample the token here: tool and template tokens,
    demonstrations), and ``kv_versions`` the oldest weight version that computed a key or
    value it was sampled over (its KV version range runs from there to its own version: older
    where the engine kept its KV over a weight push, ``engine.keep_kv_on_update``; -1 where
    ``token_versions`` is); ``weight_versions`` has one entry per sampled request. ``prompt_ids +
    response_ids`` is exactly the last sequence the model was conditioned on plus what it
    sampled.

    ``expert_ids`` (a mixture-of-experts policy whose backend reports them, routing replay):
    [len(response_ids), sparse layers, k] ints, aligned as ``rollout_logprobs``: row i holds
    the experts, in each sparse layer, of the position response token i was sampled from;
    every id is -1 (`models.moe.NO_EXPERTS`: the learner routes that position itself) where
    the model did not sample the token here (tool and template tokens, demonstrations).
    None for a dense policy (and while no sampled token has come with experts).
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    kv_versions: list[int] = dataclasses.field(default_factory=list)
    expert_ids: np.ndarray | None = None
    # each answered turn's reward: its tool calls' (summed), or its environment step's; each
    # checked where it enters (`rewards.checked_reward`): a call's reward that fails counts 0
    # here, and its error is kept in turn_reward_error (the first such)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    turn_reward_error: str | None = None
    # the episode's reward when its environment owns it (the sum of its step rewards), else None
    env_reward: float | None = None
    # whether its environment said the episode succeeded (its last step that said), else None
    env_success: bool | None = None
    num_turns: int = 0
    stop_reason: StopReason = "eos"
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    # its requests sent again from their prompts after the engine serving them died (summed
    # `GenerateResult.resent`): marked in its trace
    resent_requests: int = 0
    messages: list[Message] = dataclasses.field(default_factory=list)
    # the calls its turns answered: run, or answered without running (each also a tool error):
    # malformed, or refused (well-formed, past the turn's agent.max_tool_calls_per_turn)
    tool_calls: int = 0
    malformed_calls: int = 0
    refused_calls: int = 0
    tool_errors: int = 0
    # observations (tool results, environment messages) cut to agent.max_observation_chars
    cut_observations: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None  # what ended it (stop reasons agent_error, harness_error)
    # how each model turn ended: "call" (a well-formed tool call), "malformed" (calls, none
    # well-formed), "text" (no call, an end of turn), "cut" (no call, a budget), "aborted"
    turn_kinds: list[TurnKind] = dataclasses.field(default_factory=list)
    # a branch of a tree rollout (agent/tree.py): the trajectory whose first
    # ``forked_tokens`` response tokens (and ``forked_calls`` tool calls) it shares
    forked_from: str | None = None
    forked_tokens: int = 0
    forked_calls: int = 0
    # the episode's samples other than the one its fields above hold (``sample``), by index
    # (module doc): each as it was left, token for token (reward 0 until `train_sequences`)
    parked: dict[int, TrainSequence] = dataclasses.field(default_factory=dict)
    sample: int = 0  # the index of the sample ``prompt_ids + response_ids`` holds

    def append(
        self,
        ids: list[int],
        model: bool,
        logprobs: list[float] | None = None,
        version: int = -1,
        experts: np.ndarray | None = None,
        versions: Sequence[int] | None = None,
        kv_versions: Sequence[int] | None = None,
    ) -> None:
        """Appends ``ids``: sampled by the model (``model``) under weight ``version`` (or
        per token ``versions``, over keys and values of ``kv_versions`` and later; None: the
        token's own) with ``logprobs`` and (a MoE model's) ``experts`` [len(ids), sparse
        layers, k], or context (tool results, template tokens)."""
        self._append_experts(len(ids), experts if model else None)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        self.rollout_logprobs.extend(logprobs if model and logprobs else [0.0] * len(ids))
        sampled = list(versions) if versions is not None else [version] * len(ids)
        kv = list(kv_versions) if kv_versions is not None else sampled
        if model and not len(sampled) == len(kv) == len(ids):
            raise ValueError(f"{len(sampled)} and {len(kv)} KV versions for {len(ids)} tokens")
        self.token_versions.extend(sampled if model else [-1] * len(ids))
        self.kv_versions.extend(kv if model else [-1] * len(ids))

    def _append_experts(self, n: int, experts: np.ndarray | None) -> None:
        """``expert_ids`` grown by ``n`` tokens: ``experts``, or `NO_EXPERTS` rows (the
        tokens before the first with experts get them too)."""
        if experts is None and self.expert_ids is None:
            return
        if experts is not None and (experts.ndim != 3 or len(experts) != n):
            raise ValueError(f"expert ids of shape {experts.shape} for {n} sampled tokens")
        like = experts if experts is not None else self.expert_ids
        assert like is not None
        rows = lambda m: np.full((m, *like.shape[1:]), NO_EXPERTS, like.dtype)  # noqa: E731
        before = rows(len(self.response_ids)) if self.expert_ids is None else self.expert_ids
        self.expert_ids = np.concatenate([before, rows(n) if experts is None else experts])

    def add_sample(
        self,
        ids: list[int],
        logprobs: list[float],
        version: int,
        experts: np.ndarray | None = None,
        versions: Sequence[int] | None = None,
        kv_versions: Sequence[int] | None = None,
    ) -> None:
        """The tokens one generate request sampled under weight ``version`` (its first
        token's), with a MoE model's ``experts``; ``versions`` and ``kv_versions`` per token
        where a push landed during the request (`GenerateResult.token_versions`)."""
        self.append(ids, True, logprobs, version, experts, versions, kv_versions)
        self.weight_versions.append(version)

    def add_turn(self, kind: TurnKind | None, text: str | None = None) -> None:
        """A model turn read: counted, how it ended kept (``kind``; None for a demonstration),
        and its ``text`` as an assistant message when given (a turn whose calls run has its
        message recorded with their results)."""
        self.num_turns += 1
        if kind is not None:
            self.turn_kinds.append(kind)
        if text is not None:
            self.messages.append({"role": "assistant", "content": text})

    def add_observation(self, ids: list[int]) -> None:
        """The tokens that answer a model turn (tool results, an environment's observation,
        template tokens): context, mask 0."""
        self.append(ids, model=False)

    def add_messages(self, messages: Sequence[Message]) -> None:
        self.messages.extend(messages)

    def add_unrun_call(self, refused: bool) -> None:
        """A call answered without running: ``refused`` (past its turn's cap), or malformed."""
        if refused:
            self.refused_calls += 1
        else:
            self.malformed_calls += 1

    def add_tool_results(
        self, results: Sequence[ToolResult], tools: Sequence[str], messages: Sequence[Message]
    ) -> None:
        """The results of one turn's calls (one per call, of the ``tools`` named): counted,
        their rewards checked (`rewards.checked_reward`, naming the tool) and summed into the
        turn's, and the ``messages`` they stand for (the turn's own included)."""
        self.tool_calls += len(results)
        self.tool_errors += sum(r.error for r in results)
        rewards = []
        for result, tool in zip(results, tools, strict=True):
            try:
                rewards.append(checked_reward(result.reward, f"the tool {tool!r}"))
            except RewardError as e:
                self.turn_reward_error = self.turn_reward_error or str(e)
                rewards.append(0.0)
        self.turn_rewards.append(sum(rewards))
        self.messages.extend(messages)

    def start_env(self, owns_reward: bool) -> None:
        """An environment plays the episode: its time is kept, and its rewards are the
        episode's when it ``owns_reward``."""
        self.timings["env_s"] = 0.0
        self.env_reward = 0.0 if owns_reward else None

    def add_env_step(
        self, reward: float, observations: Sequence[Message], success: bool | None = None
    ) -> None:
        """An environment's answer to a turn: its reward (the turn's, summed into the episode's
        when the environment owns it), its messages and whether the episode succeeded (None:
        not said)."""
        if success is not None:
            self.env_success = success
        self.turn_rewards.append(reward)
        if self.env_reward is not None:
            self.env_reward += reward
        self.messages.extend(observations)

    def set_prompt(self, messages: list[Message], prompt_ids: list[int]) -> None:
        """Starts the conversation from ``messages``, rendered as ``prompt_ids``
        (`TurnBuilder.prompt_ids`)."""
        self.messages = messages
        self.prompt_ids = prompt_ids

    def add_time(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def add_error(self, error: str) -> None:
        """Keeps what went wrong (a traceback), after what was kept before."""
        self.error = (self.error or "") + error

    def end(self, stop: StopReason, error: str | None = None) -> None:
        """Ends the episode with ``stop``, and keeps ``error`` when given (`add_error`)."""
        self.stop_reason = stop
        if error is not None:
            self.add_error(error)

    def fork(self, uid: str) -> Trajectory:
        """A copy (at a turn boundary) that goes on as ``uid``, sharing what this one did so
        far (a tree's branch, agent/tree.py)."""
        branch = copy.deepcopy(self)
        branch.uid = uid
        branch.forked_from = self.uid
        branch.forked_tokens = len(self.response_ids)
        branch.forked_calls = self.tool_calls
        branch.timings = {"tools_s": 0.0}
        return branch

    @property
    def num_samples(self) -> int:
        """Its samples: 1 for an episode whose every call extended the one before."""
        return len(self.parked) + 1

    def sample_uid(self, k: int) -> str:
        """Sample ``k``'s row uid: the episode's for the first, ``<uid>@<k>`` for the others."""
        return self.uid if k == 0 else f"{self.uid}@{k}"

    def start_sample(self, prompt_ids: list[int]) -> None:
        """The next model call's prompt ``prompt_ids`` does not extend the sequence so far: a
        new sample starts from it (mask 0, as any prompt), the current one parked as it is."""
        self._park()
        self.sample = len(self.parked)
        self._load(
            TrainSequence(self.sample_uid(self.sample), self.group_id, [], [], [], [], [], [])
        )
        self.prompt_ids = list(prompt_ids)

    def resume_sample(self, k: int) -> None:
        """The next model call extends sample ``k`` again (a parent after its sub-agent): its
        tokens become the current ones, the current sample parked."""
        if k == self.sample:
            return
        if k not in self.parked:
            raise ValueError(f"trajectory {self.uid!r} has no sample {k} (of {self.num_samples})")
        back = self.parked.pop(k)
        self._park()
        self.sample = k
        self._load(back)

    def _park(self) -> None:
        self.parked[self.sample] = self.train_sequence(0.0)

    def _load(self, seq: TrainSequence) -> None:
        self.prompt_ids = list(seq.prompt_ids)
        self.response_ids = list(seq.response_ids)
        self.loss_mask = list(seq.loss_mask)
        self.rollout_logprobs = list(seq.rollout_logprobs)
        self.token_versions = list(seq.token_versions)
        self.kv_versions = list(seq.kv_versions)
        self.expert_ids = seq.expert_ids

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version that sampled one of its tokens (of any sample) or
        computed a key or value one was sampled over (None: none sampled)."""
        versions = [s.oldest_version for s in self.parked.values()]
        versions.append(oldest_version(self.token_versions, self.kv_versions))
        return min((v for v in versions if v is not None), default=None)

    def train_sequences(self, reward: float) -> list[TrainSequence]:
        """What the learner reads of it: each sample (module doc) in the order they started,
        with ``reward`` (the trainer's, `Episode.reward`); one for an episode that only
        appended (`train_sequence`). A sample without a sampled token is left out (nothing
        of it is trained), unless it is the only one."""
        samples = {**self.parked, self.sample: self.train_sequence(reward)}
        rows = [dataclasses.replace(samples[k], reward=reward) for k in sorted(samples)]
        return [s for s in rows if any(s.loss_mask)] or [self.train_sequence(reward)]

    def train_sequence(self, reward: float) -> TrainSequence:
        """The current sample as the learner reads it: its tokens, what came with each, its
        group, and ``reward``. The lists are copied and ``expert_ids`` is never edited in place
        (`append` makes a new array), so the record does not change as the trajectory goes
        on."""
        return TrainSequence(
            uid=self.sample_uid(self.sample),
            group_id=self.group_id,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.rollout_logprobs),
            token_versions=list(self.token_versions),
            kv_versions=list(self.kv_versions),
            expert_ids=self.expert_ids,
            reward=reward,
        )

    @property
    def trainable(self) -> bool:
        """False for episodes cut short by infrastructure (their outcome says nothing)."""
        return self.stop_reason not in UNTRAINABLE

    @property
    def response_tokens(self) -> int:
        """Its tokens after a prompt (model and context alike), over every sample: what
        ``agent.max_response_tokens`` bounds, however often the context was rewritten."""
        return len(self.response_ids) + sum(len(s.response_ids) for s in self.parked.values())

    @property
    def num_model_tokens(self) -> int:
        """Its sampled tokens, over every sample."""
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.parked.values())

    @property
    def own_model_tokens(self) -> int:
        """The model tokens sampled for this trajectory alone (a branch shares the rest)."""
        return self.num_model_tokens - sum(self.loss_mask[: self.forked_tokens])

    @property
    def own_tool_calls(self) -> int:
        """The tool calls made for this trajectory alone (a branch shares the rest)."""
        return self.tool_calls - self.forked_calls


def demonstration_trajectory(
    sample: Sample,
    builder: TurnBuilder,
    turns: Sequence[tuple[str, Sequence[Message]]],
) -> Trajectory:
    """The trajectory the agent loop records when the model writes exactly ``turns``.

    Each turn is (assistant text, [the messages that answered it]): tool results
    (``{"role": "tool", "content", "name"}``) or user messages (an environment's or an
    interaction's reply). The text is encoded and ended with eos (mask 1), the answers follow
    as template deltas (mask 0), exactly as in a rollout of a chat-style parser (tool results)
    or of an environment (its observations). Supervised fine-tuning on these trains the very
    tokens a rollout would score.
    """
    traj = Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        prompt_ids=builder.prompt_ids(sample.messages),
        messages=[dict(m) for m in sample.messages],
        tool_calls=sum(m["role"] == "tool" for _, answers in turns for m in answers),
    )
    for text, answers in turns:
        turn = [*builder.tokenizer.encode(text), builder.eos_id]
        traj.append(turn, model=True)
        traj.add_turn(None, text)
        if answers:
            said = [dict(m) for m in answers]
            traj.add_observation(builder.close_assistant_turn(turn) + builder.messages_delta(said))
            traj.add_messages(said)
    return traj
