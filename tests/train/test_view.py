"""`jarl view` of a real tiny run, opened in headless Chromium: what a person would see.

Chromium (Debian's ``chromium``) is installed by scripts/setup.sh. The page is written with
``--out`` and loaded from a file URL; what the script built is read back with ``--dump-dom``
(the DOM after the script ran), a view chosen through the address's fragment.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli import main
from jax_agent_rl.rl.batch import per_turn_samples, step_batch
from jax_agent_rl.train.traces import TRACES_FILE, read_traces, trace_index
from jax_agent_rl.view import write_view
from jax_agent_rl.view.data import pick_steps

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium(page: Path, fragment: str, tmp_path: Path, *extra: str) -> str:
    """The DOM of ``page#fragment`` after its script ran (or with ``extra``, their output)."""
    assert Path(CHROMIUM).is_file(), "chromium is missing: scripts/setup.sh installs it"
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    url = f"{page.resolve().as_uri()}#{fragment}"
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *(extra or ["--dump-dom"]), url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def spans(dom: str, cls: str) -> list[str]:
    return re.findall(rf'<span class="tok {cls}"[^>]*>', dom)


def test_the_view_of_a_run_shows_tokens_by_role_ratio_and_groups(
    run: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir, _ = run
    records = read_traces(run_dir / TRACES_FILE)
    # the learner recorded what it trained on: its logprob and the GRPO advantage per token
    trained = [r for r in records if r.get("advantages")]
    assert trained
    for r in trained:
        for m, lp, llp, adv, ent in zip(
            r["loss_mask"], r["rollout_logprobs"], r["learner_logprobs"], r["advantages"],
            r["learner_entropy"], strict=True,
        ):  # fmt: skip
            if m:
                assert abs(llp - lp) < 0.1  # the learner before its update ~ the sampler
                assert adv == r["advantages"][r["loss_mask"].index(1)]  # one per sequence
                assert 0.0 < ent < 20.0  # nats, of a vocabulary far below e**20 tokens
            else:
                assert llp == 0.0 and adv == 0.0 and ent == 0.0  # not trained
    i = records.index(
        next(r for r in trained if "\n<tool_response>" in "".join(r["response_pieces"]))
    )
    out = tmp_path / "page"
    assert main(["view", str(run_dir), "--out", str(out)]) == 0
    assert (out / "reward.png").is_file()
    dom = chromium(out / "index.html", f"t={i}&mode=role", tmp_path)
    assert 'href="reward.png"' in dom
    detail = dom[dom.index('id="detail"') : dom.index('id="group"')]
    assert spans(detail, "s") and spans(detail, "t") and spans(detail, "p")
    assert "tool output" in detail and 'class="block tool"' in detail
    # the ratio colouring: every sampled token coloured, its ratio on hover
    dom = chromium(out / "index.html", f"t={i}&mode=ratio", tmp_path)
    detail = dom[dom.index('id="detail"') : dom.index('id="group"')]
    sampled = spans(detail, "s")
    assert sampled and all('style="background' in s and 'title="ratio ' in s for s in sampled)
    assert all('title="tool output (not trained)"' in s for s in spans(detail, "t"))
    dom = chromium(out / "index.html", f"t={i}&mode=entropy", tmp_path)
    detail = dom[dom.index('id="detail"') : dom.index('id="group"')]
    assert all(re.search(r'title="entropy [0-9.e-]+ nats"', s) for s in spans(detail, "s"))
    group = dom[dom.index('id="group"') : dom.index('id="tree"')]
    same = [
        r
        for r in records
        if (r["step"], r["group_id"]) == (records[i]["step"], records[i]["group_id"])
    ]
    assert len(same) == 4 == group.count('<div class="col')  # group.n = 4, side by side
    # a screenshot, for a person to look at (JARL_VIEW_SCREENSHOT=path keeps it)
    screenshot = Path(os.environ.get("JARL_VIEW_SCREENSHOT") or tmp_path / "view.png")
    chromium(
        out / "index.html",
        f"t={i}&mode=role",
        tmp_path,
        f"--screenshot={screenshot.resolve()}",
        "--window-size=1400,1600",
    )
    assert screenshot.stat().st_size > 10_000


def test_the_view_filters_by_stop_reason(run: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, _ = run
    records = read_traces(run_dir / TRACES_FILE)
    stop = records[-1]["stop_reason"]
    page = write_view(run_dir, tmp_path / "page")
    dom = chromium(page, f"stop={stop}", tmp_path)
    listed = dom[dom.index('id="list"') : dom.index('id="detail"')]
    assert listed.count('<tr class="pick') == sum(r["stop_reason"] == stop for r in records)


HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='img'\">"


def hostile_record(uid: str, forked_from: str | None) -> dict[str, object]:
    pieces = [
        HOSTILE,
        " \x1b]52;c;QUFB\x07",
        "\x1b[2J",
        "</script><script>document.title='t'</script>",
        "\u202eevil",
        "\x9b",
    ]
    return {
        "step": 1, "uid": uid, "group_id": "hostile-0", "reward": math.nan,
        "stop_reason": "eos", "filtered_by": None, "forked_from": forked_from,
        "turn_kinds": ["call", "text"], "error": "\x1b[31mboom", "num_turns": 2, "tool_calls": 1,
        "malformed_calls": 0, "turn_rewards": [0.0], "env_reward": None, "weight_versions": [0],
        "messages": [
            {"role": "user", "content": HOSTILE},
            {"role": "assistant", "content": "x", "tool_calls": [{"name": HOSTILE}]},
            {"role": "tool", "content": "</script><script>document.title='t'</script>"},
        ],
        "prompt_ids": [1], "response_ids": list(range(6)), "loss_mask": [1, 1, 1, 0, 1, 1],
        "rollout_logprobs": [math.nan, math.inf, -800.0, 0.0, -math.inf, 800.0],
        "prompt_text": HOSTILE + "</script>", "response_pieces": pieces,
        "token_versions": [0, 0, 0, -1, 0, 0],
        "learner_logprobs": [-1.0, math.nan, -1.0, None, -1.0, -1.0],
        "advantages": [math.inf, 1.0, -1.0, None, 1.0, 1.0],
        "learner_entropy": [math.nan, 1.0, 0.5, None, 1.0, 1.0],
    }  # fmt: skip


def test_a_hostile_trajectory_is_shown_inert(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [hostile_record("h/0", None), hostile_record("h/0.1.1", "h/0")]
    (run_dir / TRACES_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = write_view(run_dir, tmp_path / "page")
    for mode in ("role", "logprob", "ratio", "advantage", "version", "entropy"):
        dom = chromium(page, f"t=0&mode={mode}", tmp_path)
        assert "<title>jarl view</title>" in dom  # no script of the trajectory's ran
        assert "<img" not in dom and dom.count("<script") == 2  # the page's own two
        assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom
        assert "␛]52;c;QUFB␇" in dom and "␛[2J" in dom and "\\u202eevil" in dom
        assert "\\x9b" in dom and "reward NaN" in dom
    assert "ratio NaN" in chromium(page, "t=0&mode=ratio", tmp_path)
    assert "entropy NaN nats" in chromium(page, "t=0&mode=entropy", tmp_path)
    # the tree: the branch under its root
    tree = dom[dom.index('id="tree"') :]
    assert re.search(r"<li><a [^>]*>h/0 \(reward NaN\)</a><ul><li><a [^>]*>h/0\.1\.1", tree)


def test_trace_index_points_at_each_traced_token_in_per_turn_rows() -> None:
    trajs = []
    for k in range(3):
        t = Trajectory(uid=f"u{k}", group_id="g", prompt_ids=[1, 2, 3])
        t.append([10 + k, 11], model=True, logprobs=[-0.1, -0.2])
        t.append([5, 6, 7], model=False)
        t.append([20 + k], model=True, logprobs=[-0.3])
        trajs.append(t)
    seqs = [t.train_sequence(0.0) for t in trajs]
    for rows in (seqs, [s for t in seqs for s in per_turn_samples(t)]):
        batch, _, _ = step_batch(
            rows, np.zeros(len(rows)), [r.group_id for r in rows], np.ones(len(rows)),
            mini_batches=1, row_tokens=32, bucket=8, rows_per_micro=2,
        )  # fmt: skip
        traced = [trajs[2], trajs[0]]
        index = trace_index(batch, rows, traced)
        targets, mask = batch.targets.reshape(-1), batch.mask.reshape(-1)
        for s, t in enumerate(traced):
            n = len(t.response_ids)
            assert (index[s, n:] == -1).all()
            for j, (token, m) in enumerate(zip(t.response_ids, t.loss_mask, strict=True)):
                if m or rows is seqs:  # per-turn rows hold only the sampled tokens
                    assert targets[index[s, j]] == token and mask[index[s, j]] == m
                else:
                    assert index[s, j] == -1


def test_jarl_view_says_when_there_are_no_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["view", str(tmp_path)]) == 2
    assert "no traces.jsonl" in capsys.readouterr().err


def test_jarl_view_serves_the_page_on_loopback_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / TRACES_FILE).write_text(json.dumps(hostile_record("h/0", None)) + "\n")
    (tmp_path / "reward.png").write_bytes(b"\x89PNG plot")
    (tmp_path / "secret.txt").write_text("not served")
    cmd = [sys.executable, "-m", "jax_agent_rl.cli", "view", str(tmp_path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            url = re.search(r"http://127\.0\.0\.1:\d+/", line)
            assert url, line
            page = urllib.request.urlopen(url[0], timeout=30).read().decode()
            assert page.startswith("<!DOCTYPE html>") and "<script>document" not in page
            assert (
                urllib.request.urlopen(url[0] + "reward.png", timeout=30).read() == b"\x89PNG plot"
            )
            for path in ("secret.txt", "traces.jsonl", "../secret.txt"):
                with pytest.raises(urllib.error.HTTPError, match="404"):
                    urllib.request.urlopen(url[0] + path, timeout=30)
        finally:
            server.terminate()


def test_the_view_shows_the_latest_steps_or_the_ones_asked_for() -> None:
    steps = [3, 1, 2, 2, 5, 4]
    assert pick_steps(steps, None, 2) == [4, 5]  # a long run: the latest, not every trace
    assert pick_steps(steps, None, 50) == [1, 2, 3, 4, 5]
    assert pick_steps(steps, "2", 1) == [2]
    assert pick_steps(steps, "2:4", 1) == [2, 3, 4]
    assert pick_steps(steps, "4:", 1) == [4, 5]
    assert pick_steps(steps, ":2", 1) == [1, 2]
    assert pick_steps(steps, "9:", 1) == []
    for bad in ("x", "1:y", "1.5"):
        with pytest.raises(ValueError, match="--steps"):
            pick_steps(steps, bad, 1)


def test_jarl_view_names_a_bad_steps_value_and_a_broken_traces_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRACES_FILE).write_text('{"step": 1, "uid": "a"}\n{"step": 2, "ui', "utf-8")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "o"), "--steps", "a:b"]) == 2
    assert "--steps 'a:b'" in capsys.readouterr().err
    # a line cut by a killed run, then a record missing its fields: one line each, exit 2
    assert main(["view", str(run_dir), "--out", str(tmp_path / "o")]) == 2
    assert "line 2 is not valid JSON" in capsys.readouterr().err
    (run_dir / TRACES_FILE).write_text('{"step": 1, "uid": "a"}\n', "utf-8")
    assert main(["view", str(run_dir), "--out", str(tmp_path / "o")]) == 2
    assert "is not a trace record" in capsys.readouterr().err
