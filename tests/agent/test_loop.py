"""The agent loop end to end on the embedded engine: token exactness over three chat-template
styles, with real tool calls, malformed calls, truncated tool output and every budget.

A tiny model trained (masked cross-entropy, a few hundred Adam steps) to reproduce scripted
conversations greedily, so the real engine really emits tool calls; the loop, the tools and
the engine are then run for real, and the trajectories are checked against the requests the
engine actually served and against an independently built expectation. Its weights are
committed (tests/agent/memorised/, made by scripts/memorised_models.py: three styles' training
was ~4 CPU-minutes of every suite run) beside a fingerprint of the sequences they reproduce,
so a change to a template, the tokenizer or the scripts fails here by name.
"""

import asyncio
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_agent_rl.agent.context import AgentConfig, AgentContext
from jax_agent_rl.agent.filters import has_void_turn
from jax_agent_rl.agent.loop import AGENT_LOOPS, run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config import load_config
from jax_agent_rl.data.datasets import load_samples
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, Packed, forward, init_params, lm_logits
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, GenerateResult
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    TOOL_TOKENS,
    Tokenizer,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.base import tool
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from tests.agent.templates import CHATML_TOOLS, LLAMA3_SPECIAL, LLAMA3_STYLE, QWEN3_STYLE
from tests.tools.test_server import start_server


@tool
def echo(text: str) -> str:
    """Repeat a text ten times (a long tool output, to be truncated).

    Args:
        text: What to repeat.
    """
    return " ".join([text] * 10)


def _call(style: str, name: str, args: str) -> str:
    if style == "llama3":
        return '{"name": "' + name + '", "parameters": ' + args + "}"
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def scripts(style: str) -> dict[str, list[str]]:
    """Question -> the model turns to memorise (each ends the turn)."""
    think = "<think>I need the calculator.</think>" if style == "qwen3" else ""
    if style == "llama3":  # Llama-3 JSON calls fill the whole message; several join with ';'
        two = (
            _call(style, "calculator", '{"expression": "3 + 4"}')
            + "; "
            + _call(style, "calculator", '{"expression": "6 * 7"}')
        )
    else:
        two = (
            "Two at once.\n"
            + _call(style, "calculator", '{"expression": "3 + 4"}')
            + "\n"
            + _call(style, "calculator", '{"expression": "6 * 7"}')
        )
    bad = "{broken" if style == "llama3" else "<tool_call>\n{broken json}\n</tool_call>"
    return {
        "What is 17 + 25?": [
            think + _call(style, "calculator", '{"expression": "17 + 25"}'),
            "The answer is <answer>42</answer>.",
        ],
        "Compute 3 + 4 and 6 * 7.": [two, "So 7 and 42. <answer>49</answer>"],
        "Try a broken call.": [bad, "Sorry. <answer>0</answer>"],
        "Echo hello.": [_call(style, "echo", '{"text": "hello world"}'), "Done <answer>1</answer>"],
    }


STYLES: dict[str, dict[str, Any]] = {
    "chatml": {
        "template": CHATML_TOOLS,
        "special": CHATML_SPECIAL_TOKENS,
        "eos": "<|im_end|>",
        "parser": "hermes",
    },
    "qwen3": {
        "template": QWEN3_STYLE,
        "special": CHATML_SPECIAL_TOKENS,
        "eos": "<|im_end|>",
        "parser": "hermes",
    },
    "llama3": {
        "template": LLAMA3_STYLE,
        "special": LLAMA3_SPECIAL,
        "eos": "<|eot_id|>",
        "parser": "llama3_json",
    },
}
CONFIG = AgentConfig(
    max_turns=4,
    max_tokens_per_turn=96,
    max_response_tokens=400,
    max_tool_response_tokens=12,
    max_model_len=640,
    temperature=0.0,
)


async def expected_sequence(
    builder: TurnBuilder,
    tokenizer: Tokenizer,
    parser_name: str,
    question: str,
    turns: list[str],
    tools: LocalTools,
) -> tuple[list[int], list[int]]:
    """The token sequence (and mask) the loop must build when the model says ``turns``,
    constructed independently of the loop from the builder's primitives."""
    parser = make_parser(parser_name)
    ids = builder.prompt_ids([{"role": "user", "content": question}])
    mask = [0] * len(ids)
    for n, text in enumerate(turns):
        model = [*tokenizer.encode(text), builder.eos_id]
        ids += model
        mask += [1] * len(model)
        calls = parser.parse(text)
        if not calls or n == len(turns) - 1:
            break
        results = []
        for c in calls:
            if c.error:
                results.append(f"error: {c.error}")
            else:
                results.append((await tools.call("x", c.name, c.arguments)).text)
        msgs = [
            {
                "role": "tool",
                "content": builder.truncate_text(r, CONFIG.max_tool_response_tokens, "right"),
                "name": c.name,
            }
            for c, r in zip(calls, results, strict=True)
        ]
        obs = builder.close_assistant_turn(model) + builder.messages_delta(msgs)
        ids += obs
        mask += [0] * len(obs)
    await tools.release("x")
    return ids, mask


class Recording:
    """Delegates to a real backend and keeps every request and result (for the exactness check)."""

    def __init__(self, backend: EmbeddedBackend) -> None:
        self.backend = backend
        self.capabilities = backend.capabilities
        self.log: list[tuple[GenerateRequest, GenerateResult]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self.backend.generate(request)
        self.log.append((request, result))
        return result

    async def update_weights(self, params: Any, version: int) -> None:
        await self.backend.update_weights(params, version)

    async def abort(self, request_id: str) -> None:
        await self.backend.abort(request_id)

    async def close(self) -> None:
        await self.backend.close()


def _memorise(
    cfg: ModelConfig, seqs: list[tuple[list[int], list[int]]], steps: int = 400
) -> tuple[Any, int, float]:
    """Adam on the sequences' masked cross-entropy until they are reproduced: the weights,
    the steps taken and the last loss."""
    T = max(len(s) for s, _ in seqs) + 1
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), np.float32)
    segs = np.zeros((len(seqs), T), np.int32)
    for i, (s, m) in enumerate(seqs):
        tokens[i, : len(s)] = s
        mask[i, : len(s) - 1] = m[1:]  # predict token t+1 where t+1 is a model token
        segs[i, : len(s)] = 1
    positions = np.broadcast_to(np.arange(T), tokens.shape)
    w = init_params(jax.random.key(0), cfg, sharder=one_device_sharder())
    opt = optax.adam(3e-3)
    state = opt.init(w)

    def loss_fn(w: Any) -> jax.Array:
        logits = lm_logits(
            w, forward(w, cfg, Packed(tokens, positions, segs), sharder=one_device_sharder()).hidden
        )
        lp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, :-1]).sum() / mask.sum()

    @jax.jit
    def step(w: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        loss, g = jax.value_and_grad(loss_fn)(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss

    for i in range(steps):
        w, state, loss = step(w, state)
        if i % 25 == 24 and float(loss) < 0.002:
            break
    assert float(loss) < 0.01, f"memorisation failed (loss {float(loss):.3f})"
    return w, i + 1, float(loss)


def memorised(style: str, folder: Path) -> dict[str, Any]:
    """The engine, tokenizer, tools and memorised weights of one chat style: the ``setup``
    fixture (tests/conftest.py, once per session and style for every module that uses it)."""
    return with_engine(trained(style, folder))


def with_engine(made: dict[str, Any]) -> dict[str, Any]:
    """``made`` (what `trained` returns) with the engine and tools that serve it."""
    engine = Engine(
        made["cfg"], max_concurrent_decodes=4, max_len=1024, sharder=one_device_sharder()
    )
    return {**made, "engine": engine, "tools": LocalTools(ToolRegistry([calculator, echo]))}


MEMORISED = Path(__file__).parent / "memorised"


def fingerprint(made: dict[str, Any]) -> str:
    """What the memorised weights were trained on: every expected sequence with its mask (the
    model's shape is checked against the arrays themselves, in `trained`)."""
    seqs = {q: [list(map(int, ids)), list(map(int, m))] for q, (ids, m) in made["expected"].items()}
    return hashlib.sha256(json.dumps(seqs, sort_keys=True).encode()).hexdigest()


def trained(style: str, folder: Path) -> dict[str, Any]:
    """The tokenizer, expected sequences and committed memorised weights of one chat style
    (plain data: a test run's processes can share them)."""
    made = scripted(style, folder)
    record = json.loads((MEMORISED / f"{style}.json").read_text())
    if record["fingerprint"] != fingerprint(made):
        pytest.fail(
            f"tests/agent/memorised/{style}.npz was trained on other sequences than the "
            f"{style} scripts now give (a template, the tokenizer or a script changed): "
            f"rerun .venv/bin/python scripts/memorised_models.py {style}"
        )
    sharder = one_device_sharder()
    abstract = jax.eval_shape(lambda: init_params(jax.random.key(0), made["cfg"], sharder=sharder))
    leaves, tree = jax.tree.flatten(abstract)
    with np.load(MEMORISED / f"{style}.npz") as saved:
        arrays = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert [(a.shape, a.dtype) for a in arrays] == [(x.shape, x.dtype) for x in leaves], style
    return {**made, "weights": jax.tree.unflatten(tree, arrays)}


def memorise(style: str, folder: Path) -> dict[str, Any]:
    """Trains the memorised weights of ``style`` and writes them, with their fingerprint, to
    tests/agent/memorised/ (scripts/memorised_models.py)."""
    made = scripted(style, folder)
    weights, steps, loss = _memorise(made["cfg"], list(made["expected"].values()))
    MEMORISED.mkdir(exist_ok=True)
    np.savez(MEMORISED / f"{style}.npz", *jax.device_get(jax.tree.leaves(weights)))
    record = {"style": style, "fingerprint": fingerprint(made), "steps": steps, "loss": loss}
    (MEMORISED / f"{style}.json").write_text(json.dumps(record, indent=1) + "\n")
    return {**made, "weights": weights}


def scripted(style: str, folder: Path) -> dict[str, Any]:
    """The tokenizer (trained on the style's rendered scripts), the expected sequences and the
    model shape of one chat style."""
    spec = STYLES[style]
    tools = LocalTools(ToolRegistry([calculator, echo]))
    extra = (*TOOL_TOKENS, "<answer>", "</answer>")

    def make_tokenizer(corpus: list[str], vocab: int) -> Tokenizer:
        backend_tok = train_bpe(corpus, vocab, spec["special"], extra)
        saved = save_tokenizer(
            folder / f"tokenizer-{vocab}",
            backend_tok,
            spec["template"],
            spec["eos"],
            spec["special"][0],
        )
        tok = Tokenizer.from_pretrained(saved)
        return dataclasses.replace(tok, bos_token="<|begin_of_text|>") if style == "llama3" else tok

    # train the final tokenizer on rendered conversations, so the long tool header is short
    texts = [q + " " + " ".join(t) for q, t in scripts(style).items()]
    draft = make_tokenizer(texts, 300)
    schemas = asyncio.run(tools.schemas())
    rendered = [
        draft.render_chat(
            [{"role": "user", "content": q}, {"role": "assistant", "content": t[0]}], schemas
        )
        for q, t in scripts(style).items()
    ]
    tokenizer = make_tokenizer((rendered + texts) * 20 + ["error: hello world 42 49 7"] * 5, 1200)
    builder = TurnBuilder(tokenizer, schemas)
    expected = {
        q: asyncio.run(expected_sequence(builder, tokenizer, spec["parser"], q, turns, tools))
        for q, turns in scripts(style).items()
    }
    cfg = ModelConfig(
        family="qwen2",
        vocab_size=tokenizer.vocab_size,
        hidden_size=96,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qkv_bias=True,
        max_position_embeddings=1024,
    )
    return {
        "style": style,
        "tokenizer": tokenizer,
        "cfg": cfg,
        "expected": expected,
        "parser": spec["parser"],
    }


def _run(
    setup: dict[str, Any], question: str, config: AgentConfig = CONFIG, tools: Any = None
) -> tuple[Trajectory, Recording]:
    engine = setup["engine"]  # one engine per style: its compiled programs are reused
    backend = Recording(EmbeddedBackend(engine, setup["weights"]))

    async def go() -> Trajectory:
        executor = tools or setup["tools"]
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], executor, make_parser(setup["parser"]), config
        )
        sample = Sample(
            uid=f"t-{abs(hash(question))}", messages=[{"role": "user", "content": question}]
        )
        traj = await run_sample(sample, ctx)
        await backend.close()
        return traj

    return asyncio.run(go()), backend


def _assert_token_exact(traj: Trajectory, backend: Recording) -> None:
    full = traj.prompt_ids + traj.response_ids
    last_request, last_result = backend.log[-1]
    assert full == list(last_request.prompt_ids) + list(last_result.token_ids)
    # every request's prompt is a prefix of the final sequence, extended by what it sampled
    for request, result in backend.log:
        n = len(request.prompt_ids)
        assert full[: n + len(result.token_ids)] == [*request.prompt_ids, *result.token_ids]
    sampled = [t for _, r in backend.log for t in r.token_ids]
    assert [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m] == sampled
    lps = [lp for _, r in backend.log for lp in (r.logprobs or ())]
    assert [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m] == lps
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.rollout_logprobs)


def test_scripted_episodes_are_token_exact(setup: dict[str, Any]) -> None:
    for question, (ids, mask) in setup["expected"].items():
        traj, backend = _run(setup, question)
        _assert_token_exact(traj, backend)
        assert traj.prompt_ids + traj.response_ids == ids, question
        assert [0] * len(traj.prompt_ids) + traj.loss_mask == mask
        assert traj.stop_reason == "eos"
        assert traj.num_turns == 2


def test_tool_calls_malformed_and_truncated(setup: dict[str, Any]) -> None:
    two, _ = _run(setup, "Compute 3 + 4 and 6 * 7.")
    assert two.tool_calls == 2 and two.malformed_calls == 0
    assert [m["content"] for m in two.messages if m["role"] == "tool"] == ["7", "42"]
    bad, _ = _run(setup, "Try a broken call.")
    assert bad.malformed_calls == 1 and bad.tool_errors == 1
    # the error observation (cut to the tool-response budget like any tool output)
    assert next(m["content"] for m in bad.messages if m["role"] == "tool").startswith("error")
    echo_traj, _ = _run(setup, "Echo hello.")
    (out,) = [m["content"] for m in echo_traj.messages if m["role"] == "tool"]
    assert out.endswith("...(truncated)...") and len(out) < len(" ".join(["hello world"] * 10))
    # how each turn ended, as the void_turn filter reads it (tests/agent/test_filters.py)
    assert two.turn_kinds == ["call", "text"] and bad.turn_kinds == ["malformed", "text"]
    assert has_void_turn(bad) and not has_void_turn(two)


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"max_turns": 1}, "max_turns"),
        ({"max_tokens_per_turn": 5}, "max_tokens_per_turn"),
        ({"max_response_tokens": 30}, "max_response_tokens"),
        ({"max_model_len": 30}, "max_model_len"),  # 30 tokens past the prompt
    ],
)
def test_every_budget_ends_the_episode_exactly(
    setup: dict[str, Any], override: dict[str, int], reason: str
) -> None:
    question = "What is 17 + 25?"
    if "max_model_len" in override:
        prompt_len = setup["expected"][question][1].index(1)
        override = {"max_model_len": prompt_len + override["max_model_len"]}
    config = dataclasses.replace(CONFIG, **override)
    traj, backend = _run(setup, question, config)
    assert traj.stop_reason == reason
    _assert_token_exact(traj, backend)
    assert len(traj.response_ids) <= config.max_response_tokens
    assert len(traj.prompt_ids) + len(traj.response_ids) <= config.max_model_len


def test_same_episode_through_the_tool_server(setup: dict[str, Any], tmp_path: Any) -> None:
    """HTTP tools give the same tokens as in-process tools; a dead server ends the episodes
    with stop reason tool_error (not trainable), and the rollout still completes."""
    yaml = (
        "- class: jax_agent_rl.tools.calculator:calculator\n- class: tests.agent.test_loop:echo\n"
    )
    proc, url = start_server(tmp_path, tools_yaml=yaml)
    try:
        question = "Compute 3 + 4 and 6 * 7."
        traj, _ = _run(setup, question, tools=HttpTools(url))
        assert traj.prompt_ids + traj.response_ids == setup["expected"][question][0]
    finally:
        proc.kill()
        proc.wait()

    engine = setup["engine"]  # one engine per style: its compiled programs are reused
    backend = EmbeddedBackend(engine, setup["weights"])
    dead = HttpTools(url, retries=1, backoff_s=0.01)

    async def rollout() -> list[Trajectory]:
        # schemas were fetched while the server lived; then it died mid-rollout
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), CONFIG
        )
        ctx = dataclasses.replace(ctx, tools=dead)
        samples = [  # the scripts whose calls reach the server (a malformed one never does)
            Sample(uid=f"dead-{i}", messages=[{"role": "user", "content": q}])
            for i, q in enumerate(setup["expected"])
            if q != "Try a broken call."
        ]
        out = await asyncio.gather(*(run_sample(s, ctx) for s in samples))
        await backend.close()
        return list(out)

    trajectories = asyncio.run(rollout())
    assert len(trajectories) == len(setup["expected"]) - 1
    assert all(t.stop_reason == "tool_error" and not t.trainable for t in trajectories)
    for t in trajectories:
        assert sum(t.loss_mask) == len(t.response_ids)  # the model turn, nothing after it


def test_prompt_longer_than_the_model_length(setup: dict[str, Any]) -> None:
    traj, backend = _run(setup, "What is 17 + 25?", dataclasses.replace(CONFIG, max_model_len=20))
    assert traj.stop_reason == "max_model_len"
    assert traj.response_ids == [] and backend.log == []


@pytest.mark.parametrize("setup", ["chatml"], indirect=True)  # not a template matter
def test_a_row_without_agent_name_runs_one_turn_unless_the_config_says(
    setup: dict[str, Any], tmp_path: Any
) -> None:
    """As in verl, a data row naming no loop runs single_turn_agent: one model turn, and the
    tool call the model writes in it is not run; agent.default_agent_loop=tool_agent runs it."""
    question = "What is 17 + 25?"  # the model calls the calculator, then answers
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": question}], "ground_truth": "42"})
    )

    def run(*overrides: str) -> Trajectory:
        cfg = load_config(None, ["model.path=unused", f"data.train={path}", *overrides])
        (sample,) = load_samples(
            path, agents=AGENT_LOOPS, default_agent=cfg.agent.default_agent_loop
        )
        backend = EmbeddedBackend(setup["engine"], setup["weights"])

        async def go() -> Trajectory:
            ctx = await AgentContext.create(
                backend, setup["tokenizer"], setup["tools"], make_parser(setup["parser"]), CONFIG
            )
            traj = await run_sample(sample, ctx)
            await backend.close()
            return traj

        return asyncio.run(go())

    single = run()
    assert single.num_turns == 1 and single.tool_calls == 0
    assert single.stop_reason == "max_turns" and single.turn_kinds == ["call"]
    assert not any(m["role"] == "tool" for m in single.messages)
    tools = run("agent.default_agent_loop=tool_agent")
    assert tools.num_turns == 2 and tools.tool_calls == 1 and tools.stop_reason == "eos"
    assert [m["content"] for m in tools.messages if m["role"] == "tool"] == ["42"]
    # the same first turn, sampled greedily: only what follows it differs
    assert tools.response_ids[: len(single.response_ids)] == single.response_ids
