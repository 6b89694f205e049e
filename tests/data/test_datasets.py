"""verl-layout prompt files (jsonl, parquet) and the resumable prompt sampler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_agent_rl.agent.loop import AGENT_LOOPS
from jax_agent_rl.config import AgentSection
from jax_agent_rl.data.datasets import DatasetError, PromptSampler, load_samples, write_jsonl
from jax_agent_rl.data.sample import Sample

DEFAULT = AgentSection().default_agent_loop  # what a row without agent_name runs


def verl_row(i: int, **overrides: Any) -> dict[str, Any]:
    """A row as verl's preprocessing scripts write it (gsm8k layout)."""
    row: dict[str, Any] = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Think, then answer."},
            {"role": "user", "content": f"What is {i} + {i}? Zürich café 日本語"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i, "split": "train"},
    }
    row.update(overrides)
    return row


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    if path.suffix == ".parquet":  # every row has every column, null where it had none
        columns = list(dict.fromkeys(key for row in rows for key in row))
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(n: int) -> list[Sample]:
    return [
        Sample(
            uid=f"arith-{i}",
            messages=[{"role": "user", "content": f"{i} * 3 = ?"}],
            ground_truth=str(3 * i),
            data_source="arith",
            agent_name="single_turn_agent" if i % 2 else "tool_agent",
            extra={"index": i, "kind": "mul"},
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_rows_load(tmp_path: Path, suffix: str) -> None:
    rows = [verl_row(i) for i in (3, 1, 4)]
    loaded = load_samples(
        write_rows(tmp_path / f"gsm8k{suffix}", rows), agents=AGENT_LOOPS, default_agent=DEFAULT
    )
    assert [s.uid for s in loaded] == ["openai/gsm8k-3", "openai/gsm8k-1", "openai/gsm8k-4"]
    first = loaded[0]
    assert first.messages == rows[0]["prompt"]
    assert first.ground_truth == "6"
    assert first.data_source == "openai/gsm8k"
    assert first.agent_name == "single_turn_agent"  # verl's default loop
    assert first.extra == {"index": 3, "split": "train"}


def test_parquet_null_message_fields_are_dropped(tmp_path: Path) -> None:
    """Parquet gives every message the fields of all messages (here ``name``), null if unset."""
    prompt = [
        {"role": "user", "content": "look it up"},
        {"role": "tool", "content": "found", "name": "search"},
    ]
    path = write_rows(tmp_path / "p.parquet", [verl_row(0, prompt=prompt)])
    assert load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)[0].messages == prompt


def test_defaults_and_top_level_ground_truth(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "ground_truth": "a"},
        {"prompt": [{"role": "user", "content": "yo"}], "ground_truth": "b", "agent_name": "x"},
    ]
    path = write_rows(tmp_path / "plain.jsonl", rows)
    loaded = load_samples(path, agents={"tool_agent", "x"}, default_agent="tool_agent")
    assert [s.uid for s in loaded] == ["plain-0", "plain-1"]
    assert [s.ground_truth for s in loaded] == ["a", "b"]
    assert [s.agent_name for s in loaded] == ["tool_agent", "x"]
    assert loaded[0].extra == {}


def test_a_row_without_agent_name_runs_the_default_loop(tmp_path: Path) -> None:
    """verl's default, single_turn_agent, unless the caller (agent.default_agent_loop) says
    otherwise; a SkyRL row (env_class) runs tool_agent, as SkyRL's generator plays it."""
    rows = [verl_row(0), {**verl_row(1), "env_class": "guess_number"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    assert DEFAULT == "single_turn_agent"
    loaded = load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)
    assert [s.agent_name for s in loaded] == ["single_turn_agent", "tool_agent"]
    loaded = load_samples(path, agents=AGENT_LOOPS, default_agent="react_agent")
    assert [s.agent_name for s in loaded] == ["react_agent", "tool_agent"]
    with pytest.raises(DatasetError, match=r"would run 'tool_agnet', which is not a registered"):
        load_samples(path, agents=AGENT_LOOPS, default_agent="tool_agnet")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verls_agent_names_are_the_registered_loops(tmp_path: Path, suffix: str) -> None:
    """verl writes ``single_turn_agent`` (its default) and ``tool_agent``: both load and both
    name a loop the rollout runs."""
    rows = [verl_row(0, agent_name="single_turn_agent"), verl_row(1, agent_name="tool_agent")]
    loaded = load_samples(
        write_rows(tmp_path / f"verl{suffix}", rows), agents=AGENT_LOOPS, default_agent=DEFAULT
    )
    assert [s.agent_name for s in loaded] == ["single_turn_agent", "tool_agent"]
    assert all(s.agent_name in AGENT_LOOPS for s in loaded)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_limit(tmp_path: Path, suffix: str) -> None:
    path = write_rows(tmp_path / f"d{suffix}", [verl_row(i) for i in range(5)])
    assert [
        s.uid for s in load_samples(path, limit=2, agents=AGENT_LOOPS, default_agent=DEFAULT)
    ] == [
        "openai/gsm8k-0",
        "openai/gsm8k-1",
    ]


def test_write_jsonl_round_trip(tmp_path: Path) -> None:
    original = samples(4)
    path = write_jsonl(tmp_path / "out" / "arith.jsonl", original)
    assert load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT) == original
    row = json.loads(path.read_text().splitlines()[0])
    assert row["reward_model"] == {"style": "rule", "ground_truth": "0"}


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "arith.jsonl", samples(3))
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    parquet = write_rows(tmp_path / "arith.parquet", rows)
    assert load_samples(parquet, agents=AGENT_LOOPS, default_agent=DEFAULT) == load_samples(
        jsonl, agents=AGENT_LOOPS, default_agent=DEFAULT
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: no such dataset file"):
        load_samples(tmp_path / "nope.jsonl", agents=AGENT_LOOPS, default_agent=DEFAULT)


def test_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("prompt\n")
    with pytest.raises(DatasetError, match=r"data\.csv: unknown dataset suffix '\.csv'"):
        load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)


def test_bad_json_line_names_row_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(verl_row(0)) + "\n\n{oops\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 1 \(line 3\): not valid JSON"):
        load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)


BAD_ROWS = {
    "missing_prompt": ({"prompt": None}, r"no 'prompt' column"),
    "empty_prompt": ({"prompt": []}, r"prompt must be a non-empty list of messages"),
    "string_prompt": ({"prompt": "hello"}, r"prompt must be a non-empty list.*got str"),
    "bad_role": (
        {"prompt": [{"role": "bot", "content": "x"}]},
        r"prompt message 0 has role 'bot'; allowed: system, user, assistant, tool",
    ),
    "no_content": (
        {"prompt": [{"role": "user", "content": "x"}, {"role": "user"}]},
        r"prompt message 1 \(user\) has no string 'content'",
    ),
    "no_ground_truth": (
        {"reward_model": {"style": "rule"}},
        r"no ground truth \(expected reward_model.ground_truth, reward_spec.ground_truth or "
        r"ground_truth\)",
    ),
    "unknown_agent": (  # a typo is caught at load time, not mid-rollout
        {"agent_name": "single_turn"},
        r"unknown agent_name 'single_turn'; registered: \[.*'single_turn_agent'.*'tool_agent'.*\]",
    ),
}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_names_file_row_and_problem(tmp_path: Path, suffix: str, case: str) -> None:
    change, problem = BAD_ROWS[case]
    bad = {k: v for k, v in verl_row(2, **change).items() if v is not None}
    if suffix == ".parquet" and case in ("string_prompt", "missing_prompt"):
        rows = [bad]  # a parquet column has one type: a lone row
        row_number = 0
    else:
        rows = [verl_row(0), verl_row(1), bad]
        row_number = 2
    path = write_rows(tmp_path / f"bad{suffix}", rows)
    where = rf"row {row_number}" + (rf" \(line {row_number + 1}\)" if suffix == ".jsonl" else "")
    with pytest.raises(DatasetError, match=rf"bad\{suffix}: {where}: {problem}"):
        load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)


def test_duplicate_uids_are_an_error(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "dup.jsonl", [verl_row(0), verl_row(1), verl_row(0)])
    with pytest.raises(DatasetError, match=r"row 2 \(line 3\): uid 'openai/gsm8k-0' repeats"):
        load_samples(path, agents=AGENT_LOOPS, default_agent=DEFAULT)


def uids(batch: list[Sample]) -> list[str]:
    return [s.uid for s in batch]


def test_sampler_epochs_are_permutations() -> None:
    data = samples(5)
    sampler = PromptSampler(data, seed=0)
    epochs = [uids(sampler.next_batch(5)) for _ in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(uids(data))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled at each epoch end
    assert sampler.state() == {"epoch": 4, "position": 0}


def test_sampler_is_deterministic_and_seeded() -> None:
    def draws(seed: int) -> list[list[str]]:
        sampler = PromptSampler(samples(7), seed=seed)
        return [uids(sampler.next_batch(3)) for _ in range(6)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_batch_spans_epochs() -> None:
    sampler = PromptSampler(samples(5), seed=3)
    reference = PromptSampler(samples(5), seed=3)
    first, second = uids(reference.next_batch(5)), uids(reference.next_batch(5))
    assert uids(sampler.next_batch(3)) == first[:3]
    assert uids(sampler.next_batch(4)) == first[3:] + second[:2]
    assert sampler.state() == {"epoch": 1, "position": 2}


@pytest.mark.parametrize("stop_after", [0, 1, 2, 5])
def test_sampler_resumes_exactly(stop_after: int) -> None:
    uninterrupted = PromptSampler(samples(7), seed=11)
    expected = [uids(uninterrupted.next_batch(3)) for _ in range(10)]

    first = PromptSampler(samples(7), seed=11)
    got = [uids(first.next_batch(3)) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    resumed = PromptSampler(samples(7), seed=11)
    resumed.restore(state)
    got += [uids(resumed.next_batch(3)) for _ in range(10 - stop_after)]
    assert got == expected


def test_sampler_rejects_bad_state() -> None:
    sampler = PromptSampler(samples(3), seed=0)
    with pytest.raises(ValueError, match="out of range"):
        sampler.restore({"epoch": 0, "position": 3})
    with pytest.raises(ValueError, match="needs keys epoch and position"):
        sampler.restore({"epoch": 0})
    with pytest.raises(ValueError, match="at least one sample"):
        PromptSampler([], seed=0)
