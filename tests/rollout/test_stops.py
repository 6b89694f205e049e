"""Stop strings cut a turn token-exactly: the embedded engine ends a request at the decode call
that completes one, keeping the tokens up to the one that completes it (those after it in the
same call dropped, logprobs aligned), and the agent loop cuts any backend's result the same
way. The reference is the same request sampled without the stop string (same seed, so the
same tokens) and a plain scan of its prefixes for the first whose text holds the stop."""

import asyncio
import zlib
from pathlib import Path

import pytest

from jax_agent_rl.agent.context import AgentConfig, AgentContext, turn_stop_ids
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.cli.demo import prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import load_hf
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult, SamplingParams
from jax_agent_rl.rollout.stops import stop_string_end
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry

STEPS = 4  # tokens per decode call: the prefill samples token 0, call j tokens 4j-3 .. 4j
MAX_TOKENS = 16
SEED = 3
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _first_holding(tokenizer: Tokenizer, ids: list[int], stop: str) -> int:
    """The length of the shortest prefix of ``ids`` whose text holds ``stop`` (a plain scan)."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = prepare(tmp_path_factory.mktemp("stops"), ArithmeticTask(), n_train=4, n_val=2, n_sft=8)
    return task.model


def test_a_stop_string_over_several_tokens_and_decode_calls_cuts_exactly(files: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(files)
    model, weights = load_hf(files, sharder=one_device_sharder())
    prompt = tuple(TurnBuilder(tokenizer).prompt_ids(MESSAGES))
    seed = zlib.crc32(f"{SEED}/g-0/0".encode())  # the loop's seed of this sample's request
    stop_ids = turn_stop_ids(tokenizer, make_parser("hermes"))  # and its stop ids

    engine = Engine(
        model, max_concurrent_decodes=1, max_len=256, sharder=one_device_sharder()
    )  # its programs, once

    def backend(decode: bool) -> EmbeddedBackend:
        return EmbeddedBackend(
            engine, weights, steps_per_call=STEPS, decode=tokenizer.decode if decode else None
        )

    async def generate(stop: tuple[str, ...]) -> GenerateResult:
        served = backend(decode=True)
        try:
            sampling = SamplingParams(
                MAX_TOKENS, temperature=1.0, seed=seed, stop_token_ids=stop_ids, stop=stop
            )
            return await served.generate(GenerateRequest("r", prompt, sampling))
        finally:
            await served.close()

    reference = asyncio.run(generate(()))
    ids, logprobs = list(reference.token_ids), list(reference.logprobs or [])
    assert len(ids) == MAX_TOKENS and reference.finish_reason == "length"
    # a stop string from the text of tokens 3, 4 and most of 5: it starts in the first decode
    # call and is completed in the second by token 5, whose text runs on past it
    text = [tokenizer.decode(ids[:k]) for k in range(MAX_TOKENS + 1)]
    assert all(text[k + 1].startswith(text[k]) for k in range(MAX_TOKENS))
    assert all(len(text[k + 1]) > len(text[k]) for k in (3, 4)) and len(text[6]) - len(text[5]) > 1
    stop = text[6][len(text[3]) : len(text[6]) - 1]
    end = _first_holding(tokenizer, ids, stop)
    assert end == 6 and stop not in tokenizer.decode(ids[5:6])  # several tokens make it
    assert stop_string_end(tokenizer.decode, ids, [stop], MAX_TOKENS) == end

    cut = asyncio.run(generate((stop,)))
    assert cut.finish_reason == "stop"
    assert list(cut.token_ids) == ids[:end]  # tokens 6..8 of the same decode call dropped
    assert list(cut.logprobs or []) == logprobs[:end]

    # the agent loop cuts a backend that runs on past the stop string (no tokenizer) the same
    async def episode() -> tuple[list[int], list[float], str]:
        served = backend(decode=False)
        tools = LocalTools(ToolRegistry([]))
        config = AgentConfig(max_tokens_per_turn=MAX_TOKENS, max_model_len=256, stop=(stop,))
        ctx = await AgentContext.create(
            served, tokenizer, tools, make_parser("hermes"), config, seed=SEED
        )
        try:
            sample = Sample("g-0", MESSAGES, "4", agent_name="single_turn_agent")
            traj = await run_sample(sample, ctx)
            return traj.response_ids, traj.rollout_logprobs, traj.stop_reason
        finally:
            await served.close()

    response, rollout_logprobs, _ = asyncio.run(episode())
    assert response == ids[:end] and rollout_logprobs == logprobs[:end]
