"""MLflow rollout traces: the turns of hand-made trajectories (real tokenizer), recorded in a
run's SQLite store and read back through mlflow's client as span trees; the trace hook writes
them only with trainer.trace_backend=mlflow; `jarl traces RUN --mlflow` names the UI command."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Span, Trace
from rich.console import Console

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli import main
from jax_agent_rl.cli.demo import DEMO_CONFIG, prepare
from jax_agent_rl.config import load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.train import StepEnd, build_run
from jax_agent_rl.train.hooks import write_traces
from jax_agent_rl.train.mlflow_traces import model_turns, record_traces, split_messages
from jax_agent_rl.train.traces import MLFLOW_DB, TRACES_FILE, read_traces, tracking_uri

CORPUS = [
    "What is 7 * 6? The calculator says 42, so the answer is <answer>42</answer>.\n",
    '{"name": "calculator", "arguments": {"expression": "7 * 6"}}\n',
    "<tool_response>\n42\n</tool_response> user assistant tool\n",
] * 30
PROMPT = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 7 * 6?"},
]
ANSWER = "The answer is <answer>42</answer>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path, train_bpe(CORPUS, vocab_size=400), chat_template("chatml_tools"))
    return Tokenizer.from_pretrained(path)


def episode(
    tok: Tokenizer,
    uid: str,
    calls_per_turn: tuple[int, ...],
    prompt: list[dict] = PROMPT,
) -> Trajectory:
    """What the tool loop records when the model makes ``calls_per_turn[i]`` calculator calls
    in turn i (the i-th sampled under weight version 10 + i), then answers."""
    traj = Trajectory(
        uid=uid,
        group_id="g0",
        prompt_ids=tok.encode_chat(prompt, add_generation_prompt=True),
        messages=[dict(m) for m in prompt],
        stop_reason="eos",
        timings={"total_s": 2.0, "tools_s": 0.5},
    )
    end = tok.token_id("<|im_end|>")
    for i, calls in enumerate(calls_per_turn):
        expressions = [f"{7 + i} * {6 + j}" for j in range(calls)]
        text = "".join(
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n'
            "</tool_call>"
            for e in expressions
        )
        turn = [*tok.encode(text), end]
        traj.append(turn, model=True, logprobs=[-0.5 - i] * len(turn), version=10 + i)
        traj.weight_versions.append(10 + i)
        traj.num_turns += 1
        traj.turn_kinds.append("call")
        traj.tool_calls += calls
        traj.messages.append(
            {
                "role": "assistant",
                "content": text,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "calculator", "arguments": {"expression": e}},
                    }
                    for e in expressions
                ],
            }
        )
        results = [str((7 + i) * (6 + j)) for j in range(calls)]  # the calculator
        observation = "".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        traj.append(tok.encode(f"\nuser\n{observation}\nassistant\n"), model=False)
        traj.messages += [{"role": "tool", "content": r, "name": "calculator"} for r in results]
    answer = [*tok.encode(ANSWER), end]
    n = len(calls_per_turn)
    traj.append(answer, model=True, logprobs=[-0.25] * len(answer), version=10 + n)
    traj.weight_versions.append(10 + n)
    traj.num_turns += 1
    traj.turn_kinds.append("text")
    traj.messages.append({"role": "assistant", "content": ANSWER})
    return traj


def aborted(tok: Tokenizer) -> Trajectory:
    """A prompt that holds an earlier exchange (an assistant message); one call, then a turn
    the backend aborted: it sampled tokens but left no message."""
    prompt = [*PROMPT[:1], {"role": "user", "content": "2+2?"}]
    prompt += [{"role": "assistant", "content": "4"}, PROMPT[1]]
    traj = episode(tok, "u-aborted", (1,), prompt)
    traj.messages.pop()  # the answer turn is the aborted one
    traj.turn_kinds[-1] = "aborted"
    traj.stop_reason = "aborted"
    return traj


def model_tokens(traj: Trajectory) -> list[int]:
    return [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]


def test_turns_are_the_runs_of_model_tokens(tokenizer: Tokenizer) -> None:
    traj = episode(tokenizer, "u0", (2, 1))
    prompt, exchanges = split_messages(traj)
    assert prompt == PROMPT
    assert [len(replies) for _, replies in exchanges] == [2, 1, 0]
    turns = model_turns(traj)
    assert len(turns) == traj.num_turns == 3
    assert [t.kind for t in turns] == ["call", "call", "text"]
    assert [sorted(set(t.versions)) for t in turns] == [[10], [11], [12]]
    assert [tok for t in turns for tok in t.token_ids] == model_tokens(traj)
    assert [r["content"] for r in turns[0].replies] == ["42", "49"]
    assert turns[2].message is not None and turns[2].message["content"] == ANSWER
    assert tokenizer.decode(turns[2].token_ids) == ANSWER + "<|im_end|>"


def test_an_aborted_turn_has_no_message_and_the_prompt_keeps_its_own(
    tokenizer: Tokenizer,
) -> None:
    traj = aborted(tokenizer)
    prompt, exchanges = split_messages(traj)
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
    assert len(exchanges) == 1
    turns = model_turns(traj)
    assert [t.kind for t in turns] == ["call", "aborted"]
    assert turns[1].message is None and turns[1].replies == []


@pytest.fixture(scope="module")
def recorded(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose store holds the traces of four episodes of step 5."""
    run_dir = tmp_path_factory.mktemp("runs") / "calc-run"
    failed = episode(tokenizer, "u-failed", (1,))
    failed.stop_reason, failed.error = "agent_error", "Traceback: the parser broke"
    episodes = [
        Episode(episode(tokenizer, "u0", (2, 1)), reward=1.0),
        Episode(episode(tokenizer, "u1", ()), reward=0.5),
        Episode(aborted(tokenizer)),
        Episode(failed),
    ]
    record_traces(run_dir, episodes, tokenizer, step=5)
    return run_dir


def read_back(run_dir: Path) -> dict[str, Trace]:
    """The traces of ``run_dir``'s store by uid, read through mlflow's client."""
    client = MlflowClient(tracking_uri(run_dir))
    experiment = client.get_experiment_by_name(run_dir.name)
    assert experiment is not None, "the experiment is named after the run folder"
    found = client.search_traces(locations=[experiment.experiment_id])
    traces = [client.get_trace(t.info.trace_id) for t in found]
    return {t.data.spans[0].attributes["uid"]: t for t in traces}


def tree(trace: Trace) -> tuple[Span, list[Span]]:
    """The root span and its children in time order."""
    (root,) = [s for s in trace.data.spans if s.parent_id is None]
    children = [s for s in trace.data.spans if s.parent_id == root.span_id]
    assert len(children) == len(trace.data.spans) - 1, "every span is the root's child"
    return root, sorted(children, key=lambda s: s.start_time_ns)


def test_recorded_traces_are_span_trees_of_the_episodes(
    recorded: Path, tokenizer: Tokenizer
) -> None:
    traces = read_back(recorded)
    assert sorted(traces) == ["u-aborted", "u-failed", "u0", "u1"]
    traj = episode(tokenizer, "u0", (2, 1))
    root, children = tree(traces["u0"])
    assert root.name == "episode u0" and root.span_type == "AGENT"
    attributes = root.attributes
    assert attributes["reward"] == 1.0 and attributes["step"] == 5
    assert attributes["group_id"] == "g0" and attributes["stop_reason"] == "eos"
    assert attributes["num_turns"] == 3 and attributes["tool_calls"] == 3
    assert attributes["weight_versions"] == [10, 11, 12]
    assert attributes["filtered_by"] is None
    assert attributes["prompt_text"] == tokenizer.decode(traj.prompt_ids)
    assert root.inputs == {"messages": PROMPT}
    assert root.outputs == ANSWER
    assert traces["u0"].info.tags["step"] == "5"

    assert [s.name for s in children] == [
        "turn 1", "tool calculator", "tool calculator", "turn 2", "tool calculator", "turn 3",
    ]  # fmt: skip
    turns = [s for s in children if s.span_type == "LLM"]
    assert len(turns) == traj.num_turns
    assert [t for s in turns for t in s.attributes["token_ids"]] == model_tokens(traj)
    assert [s.attributes["num_tokens"] for s in turns] == [
        len(t.token_ids) for t in model_turns(traj)
    ]
    assert [s.attributes["kind"] for s in turns] == ["call", "call", "text"]
    assert [s.attributes["weight_versions"] for s in turns] == [[10], [11], [12]]
    assert [s.attributes["mean_logprob"] for s in turns] == pytest.approx([-0.5, -1.5, -0.25])
    assert turns[2].outputs == ANSWER + "<|im_end|>"
    tools = [s for s in children if s.span_type == "TOOL"]
    replies = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert [s.outputs for s in tools] == replies
    assert [s.inputs for s in tools] == [
        {"name": "calculator", "arguments": {"expression": e}} for e in ("7 * 6", "7 * 7", "8 * 6")
    ]


def test_spans_share_the_episode_time_end_to_end(recorded: Path, tokenizer: Tokenizer) -> None:
    """total_s 2 and tools_s 0.5: the turns share 1.5 s by token count, the three tool
    messages 0.5 s equally, one after the other over the root's 2 s."""
    root, children = tree(read_back(recorded)["u0"])
    assert root.end_time_ns - root.start_time_ns == 2_000_000_000
    assert children[0].start_time_ns == root.start_time_ns
    for before, after in itertools.pairwise(children):
        assert before.end_time_ns == after.start_time_ns
    durations = [s.end_time_ns - s.start_time_ns for s in children]
    assert [d for s, d in zip(children, durations, strict=True) if s.span_type == "TOOL"] == [
        166_666_666
    ] * 3
    sizes = [len(t.token_ids) for t in model_turns(episode(tokenizer, "u0", (2, 1)))]
    turn_ns = [d for s, d in zip(children, durations, strict=True) if s.span_type == "LLM"]
    assert turn_ns == [1_500_000_000 * n // sum(sizes) for n in sizes]


def test_episodes_without_tools_aborted_or_failed(recorded: Path, tokenizer: Tokenizer) -> None:
    traces = read_back(recorded)
    root, children = tree(traces["u1"])  # answered at once
    assert [s.name for s in children] == ["turn 1"]
    assert root.attributes["reward"] == 0.5 and root.attributes["tool_calls"] == 0
    root, children = tree(traces["u-aborted"])
    assert [s.name for s in children] == ["turn 1", "tool calculator", "turn 2"]
    assert children[-1].attributes["kind"] == "aborted"
    assert root.inputs == {"messages": split_messages(aborted(tokenizer))[0]}
    assert root.attributes["stop_reason"] == "aborted"
    assert traces["u-aborted"].info.state.value == "OK"
    assert traces["u-failed"].info.state.value == "ERROR"
    root, _ = tree(traces["u-failed"])
    assert root.attributes["error"] == "Traceback: the parser broke"


def test_jarl_traces_mlflow_prints_the_ui_command(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["traces", str(recorded), "--mlflow"]) == 0
    db = (recorded / MLFLOW_DB).resolve()
    assert capsys.readouterr().out == (
        f"mlflow ui --backend-store-uri sqlite:///{db} --port 5000\n"
    )
    assert main(["traces", str(tmp_path), "--mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"no mlflow.db in {tmp_path}" in err and "trainer.trace_backend=mlflow" in err


def test_the_hook_records_mlflow_traces_only_with_the_mlflow_backend(tmp_path: Path) -> None:
    task = prepare(tmp_path / "task", ArithmeticTask(), n_train=16, n_val=4, n_sft=16)
    overrides = [
        f"model.path={task.model}", f"data.train={task.train}", "data.val=", "sft.data=",
        f"tools.config={task.tools}", f"trainer.run_dir={tmp_path / 'built'}", "mesh.data=1",
        "trainer.tensorboard=false", "trainer.traces_per_step=2",
    ]  # fmt: skip
    cfg = load_config(DEMO_CONFIG, overrides)
    run, state = build_run(cfg, Console(file=io.StringIO()))
    run.checkpoints.close()
    run.metrics.close()
    trajs = [Episode(episode(run.tokenizer, f"u{i}", (1,)), reward=float(i)) for i in range(4)]
    for backend in ("jsonl", "mlflow"):
        trainer = dataclasses.replace(cfg.trainer, trace_backend=backend)
        traced = dataclasses.replace(
            run, cfg=dataclasses.replace(cfg, trainer=trainer), run_dir=tmp_path / backend
        )
        asyncio.run(write_traces(traced, None, StepEnd(3, False, {}, trajs, state)))
    for backend in ("jsonl", "mlflow"):
        records = read_traces(tmp_path / backend / TRACES_FILE)
        assert [r["uid"] for r in records] == ["u0", "u2"]  # written with either backend
    assert not (tmp_path / "jsonl" / MLFLOW_DB).exists()
    traces = read_back(tmp_path / "mlflow")
    assert sorted(traces) == ["u0", "u2"]
    for uid, trace in traces.items():
        root, children = tree(trace)
        assert root.attributes["step"] == 3
        tokens = [t for s in children if s.span_type == "LLM" for t in s.attributes["token_ids"]]
        record = next(r for r in records if r["uid"] == uid)
        assert tokens == [
            t for t, m in zip(record["response_ids"], record["loss_mask"], strict=True) if m
        ]
